"""pytest plugin: every trace with an expectation becomes a test, per
expectation (a policy and a cache). The schema and the checking live in
``replay.analysis.expectations`` (``replay test`` runs the same checks).

``pytest traces/`` checks the expectations against this project's
coordinator; ``pytest --replay-coordinator vllm traces/`` (or
``REPLAY_COORDINATOR=vllm``) against the installed vLLM's own coordinators,
where only the expectations whose policy answers as the installed vLLM's
release in their cache are checked and the others are skipped with the
reason. An expectation without a policy takes the release that recorded the
trace (``source.vllm_version``), else the default, as every command does.
Registered through
the ``pytest11`` entry point (``-p no:cache_trace_replay`` turns it off), so once the
package is installed ``pytest traces/`` runs a corpus, and ``pytest
--replay-corpus`` (from any directory) runs the corpus shipped inside the
package (``pytest --pyargs replay.corpus`` names the same directory). Test
ids name the trace, the policy and the cache:
``issue-43559.parquet::issue-43559[vllm-0.33-gpu]``.

The flags take the choices of ``replay check`` (``replay.analysis.selection``):
``--replay-ignore FLAG|SEVERITY,...`` leaves those flags out of the
comparison on both sides; an entry without ``flags`` fails when a flag that
``--replay-fail-on SEVERITY|FLAG,...`` selects fires (default: corruption).
Both also read from the ini options ``replay_fail_on`` and ``replay_ignore``.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from replay.analysis.expectations import read_expectations
from replay.base.errors import ReplayError, worded
from replay.rules.coordinator.kinds import COORDINATORS, DEFAULT_COORDINATOR, get_coordinator

__all__ = ["read_expectations"]

#: How many of the lookups that differ a failure explains.
EXPLAINED = 3
COORDINATOR_ENV = "REPLAY_COORDINATOR"
#: The library's parameters, as this plugin names them
#: (``replay.base.errors.worded``); a limit keeps its environment variable.
OPTIONS = {
    "coordinator": "--replay-coordinator",
    "fail_on": "--replay-fail-on",
    "ignore": "--replay-ignore",
    "policy": "the entry's policy",
    "cache": "the entry's cache",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cache-trace-replay", "regression traces (replay.expect)")
    group.addoption(
        "--replay-coordinator",
        choices=tuple(COORDINATORS),
        default=None,
        help="Check regression traces against this project's coordinator (reference, the "
        f"default) or the installed vLLM's own (vllm); also ${COORDINATOR_ENV}.",
    )
    group.addoption(
        "--replay-corpus",
        action="store_true",
        default=False,
        help="Collect the regression corpus shipped inside the package (replay/corpus), "
        "from any directory; without test paths, only the corpus.",
    )
    group.addoption(
        "--replay-fail-on",
        action="append",
        default=[],
        metavar="SEVERITY|FLAG,...",
        help="flags that fail a trace entry without a 'flags' expectation (default: corruption)",
    )
    group.addoption(
        "--replay-ignore",
        action="append",
        default=[],
        metavar="FLAG|SEVERITY,...",
        help="flags left out of every comparison",
    )
    parser.addini("replay_fail_on", "as --replay-fail-on", default="")
    parser.addini("replay_ignore", "as --replay-ignore", default="")


#: Per session: regression-trace expectations checked and skipped.
_TALLY = pytest.StashKey[dict[str, int]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_TALLY] = {"checked": 0, "skipped": 0}
    if not config.getoption("--replay-corpus", default=False):
        return
    from replay.analysis.expectations import corpus_dir

    corpus = str(corpus_dir())
    # Paths given on the command line are collected beside the corpus; with
    # none (the invocation directory or testpaths), the corpus alone.
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(corpus)
    else:
        config.args[:] = [corpus]


def _choice(config: pytest.Config, name: str) -> list[str]:
    given: list[str] = config.getoption(f"--replay-{name.replace('_', '-')}") or []
    ini = str(config.getini(f"replay_{name}") or "")
    return given or ([ini] if ini.strip() else [])


def _coordinator(config: pytest.Config) -> str:
    chosen = config.getoption("--replay-coordinator", default=None)
    if chosen:
        return str(chosen)
    env = os.environ.get(COORDINATOR_ENV, "").strip()
    if env and env not in COORDINATORS:
        raise pytest.UsageError(f"{COORDINATOR_ENV}={env!r}: expected {' or '.join(COORDINATORS)}")
    return env or DEFAULT_COORDINATOR


def pytest_report_header(config: pytest.Config) -> str | None:
    """Under ``vllm``, the line that says which policy a vLLM no policy
    models (a newer release, a development build) is checked as."""
    if not get_coordinator(_coordinator(config)).installed_vllm:
        return None
    from replay.adapters.vllm.backend import installed_version_policy

    try:
        return installed_version_policy().note or None
    except ReplayError as exc:
        return worded(str(exc), OPTIONS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    if not isinstance(item, TraceItem):
        return
    report: pytest.TestReport = outcome.get_result()
    tally = item.config.stash[_TALLY]
    if report.when == "setup" and report.skipped:
        tally["skipped"] += 1
    elif report.when == "call":
        tally["checked"] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Nothing checked is never a pass: a run whose every trace expectation
    was skipped (the installed vLLM is modelled by no policy the traces pin)
    fails, with the line that says why."""
    tally = session.config.stash.get(_TALLY, None)
    if tally is None or tally["checked"] or not tally["skipped"]:
        return
    line = (
        f"replay: no expectation was checked ({tally['skipped']} skipped, see the reasons "
        "above): nothing checked is not a pass"
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line, red=True)
    if exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Collector | None:
    if file_path.suffix != ".parquet" or file_path.name.endswith(".results.parquet"):
        return None
    if read_expectations(file_path) is None:
        return None
    return TraceFile.from_parent(parent, path=file_path)


class TraceFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        from replay.analysis.expectations import planned_verdicts
        from replay.format.tracedir import open_trace

        coordinator = _coordinator(self.config)
        config = open_trace(self.path).config
        for verdict in planned_verdicts(self.path, config, coordinator):
            item = TraceItem.from_parent(
                self,
                name=f"{self.path.stem}[{verdict.policy}-{verdict.cache}]",
                entry=verdict.entry,
                coordinator=coordinator,
                policy=verdict.policy,
                cache=verdict.cache,
            )
            if verdict.skipped is not None:
                item.add_marker(pytest.mark.skip(reason=verdict.skipped))
            yield item


class ExpectationMismatch(Exception):
    pass


class TraceItem(pytest.Item):
    def __init__(
        self, *, entry: dict[str, Any], coordinator: str, policy: str, cache: str, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.entry = entry
        self.coordinator = coordinator
        #: the entry's policy, else the trace's recorded release's (``entry_policy``)
        self.policy = policy
        #: the cache that answers (the entry's, else the trace's own)
        self.cache = cache

    def runtest(self) -> None:
        from replay.analysis.expectations import check_trace, failure_block

        verdicts = check_trace(
            self.path,
            self.coordinator,
            explained=EXPLAINED,
            only=self.entry,
            fail_on=_choice(self.config, "fail_on"),
            ignore=_choice(self.config, "ignore"),
        )
        (verdict,) = verdicts
        if verdict.problems:
            # The text replay test prints for it (its cause line included).
            raise ExpectationMismatch("\n".join(failure_block(verdict)).removeprefix("FAILED "))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ExpectationMismatch):
            return str(excinfo.value)
        if isinstance(excinfo.value, ReplayError):
            # A library error, in this plugin's words (its options).
            return f"{self.path.name}: {worded(str(excinfo.value), OPTIONS)}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"trace {self.path.name} [{self.policy}-{self.cache}]"

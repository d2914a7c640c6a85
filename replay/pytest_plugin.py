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
the ``pytest11`` entry point, so ``pip install cache-trace-replay`` then
``pytest traces/`` runs a corpus.

The flags take the choices of ``replay check`` (``replay.analysis.selection``):
``--replay-ignore FLAG|SEVERITY,...`` leaves those flags out of the
comparison on both sides; an entry without ``flags`` fails when a flag that
``--replay-fail-on SEVERITY|FLAG,...`` selects fires (default: corruption).
Both also read from the ini options ``replay_fail_on`` and ``replay_ignore``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replay.analysis.expectations import entry_label, read_expectations
from replay.base.errors import ReplayError, worded
from replay.rules.coordinator.kinds import COORDINATORS, DEFAULT_COORDINATOR

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
                name=f"{self.path.stem}[{entry_label(verdict.entry, config.source)}]",
                entry=verdict.entry,
                coordinator=coordinator,
                policy=verdict.policy,
            )
            if verdict.skipped is not None:
                item.add_marker(pytest.mark.skip(reason=verdict.skipped))
            yield item


class ExpectationMismatch(Exception):
    pass


class TraceItem(pytest.Item):
    def __init__(
        self, *, entry: dict[str, Any], coordinator: str, policy: str, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.entry = entry
        self.coordinator = coordinator
        #: the entry's policy, else the trace's recorded release's (``entry_policy``)
        self.policy = policy
        #: the cache that answers; unset: the trace's own (``source.cache``)
        self.cache = str(entry["cache"]) if entry.get("cache") else None

    def runtest(self) -> None:
        from replay.analysis.expectations import check_trace

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
            raise ExpectationMismatch("\n".join(verdict.problems + verdict.explained))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ExpectationMismatch):
            where = f" in the {self.cache} cache" if self.cache else ""
            return f"{self.path.name} under policy {self.policy}{where}:\n{excinfo.value}"
        if isinstance(excinfo.value, ReplayError):
            # A library error, in this plugin's words (its options).
            return f"{self.path.name}: {worded(str(excinfo.value), OPTIONS)}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"trace {self.path.name} [{self.policy}]"

"""The options and arguments more than one command takes, declared once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from replay.base.errors import ReplayError
from replay.base.text import close_names, did_you_mean
from replay.base.units import (
    INT64_MAX,
    parse_bytes,
    parse_count,
    parse_fraction,
    parse_integer,
    parse_seconds,
    parse_seed,
    parse_segment,
    shown,
)
from replay.cli.common import fail, note_at_end, reworded
from replay.rules.coordinator import CACHES, DEFAULT_POLICY, POLICIES, choose_policies
from replay.sources.archetypes import ARCHETYPES

if TYPE_CHECKING:
    from replay.rules.store_rules import StoreSettings

F = TypeVar("F", bound=Callable[..., Any])

# ---------------------------------------------------------------- numbers
#
# Every number is parsed by the one set of exact parsers in replay.base.units
# (no float on the way, ranges checked, one-line errors); the click types
# below only wrap them.


class _Parsed(click.ParamType):  # type: ignore[type-arg]
    """A click type over one of the parsers above: its error is the one line."""

    def __init__(self, name: str, parse: Callable[[str, str], Any]) -> None:
        self.name = name
        self._parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # a default, already a number
        option = param.opts[0] if param is not None and param.opts else self.name
        try:
            return self._parse(value, option)
        except ReplayError as exc:
            raise fail(reworded(exc)) from None


def count_type(least: int = 0, most: int = INT64_MAX) -> _Parsed:
    """The click type of a count (k/M/G/T suffixes)."""
    return _Parsed("N", lambda t, o: parse_count(t, o, least=least, most=most))


def integer_type(least: int = -INT64_MAX - 1, most: int = INT64_MAX) -> _Parsed:
    """The click type of a plain integer in a range (a seq, a group id)."""
    return _Parsed("N", lambda t, o: parse_integer(t, o, least=least, most=most))


def bytes_type(least: int = 1, most: int = INT64_MAX) -> _Parsed:
    return _Parsed("SIZE", lambda t, o: parse_bytes(t, o, least=least, most=most))


def fraction_type() -> _Parsed:
    """The click type of a fraction in (0, 1] (``--sample 0.1``)."""
    return _Parsed("FRACTION", parse_fraction)


def segment_type() -> _Parsed:
    """``--segment``: a duration or a count of events (``parse_segment``)."""
    return _Parsed("SECONDS|Nevents", parse_segment)


def seconds_type(most: int = 366 * 86400) -> _Parsed:
    return _Parsed("SECONDS", lambda t, o: parse_seconds(t, o, most=most))


SEED = _Parsed("N", parse_seed)

TRACE = click.argument("trace", type=click.Path(path_type=Path))


def output_option(
    help: str, *, required: bool = False, metavar: str | None = None
) -> Callable[[F], F]:
    """``-o/--output PATH``, the file (or directory) a command writes."""
    return click.option(
        "-o",
        "--output",
        type=click.Path(path_type=Path),
        required=required,
        metavar=metavar,
        help=help,
    )


def count_option(
    name: str,
    *,
    default: int | None = None,
    least: int = 0,
    most: int = INT64_MAX,
    **attrs: Any,
) -> Callable[[F], F]:
    """A count option (k/M/G/T suffixes) from ``least`` to ``most``, its
    default shown when it has one."""
    return click.option(
        name,
        type=count_type(least, most),
        default=default,
        show_default=default is not None,
        **attrs,
    )


class Names(click.Choice):  # type: ignore[type-arg]
    """A choice among named things (policies, caches, coordinators): a typo
    is answered with the close names (``did you mean 'vllm-0.33'?``), not
    the whole list, which stays for a name nothing is close to."""

    def __init__(self, choices: Iterable[str], what: str) -> None:
        super().__init__(list(choices))
        self.what = what

    def get_invalid_choice_message(self, value: Any, ctx: click.Context | None) -> str:
        close = close_names(str(value), [str(c) for c in self.choices])
        if not close:
            return super().get_invalid_choice_message(value, ctx)
        return f"no {self.what} {value!r}, did you mean " + " or ".join(map(repr, close)) + "?"


def repeated_choice(
    name: str, dest: str, choices: Iterable[str], help: str, what: str | None = None
) -> Callable[[F], F]:
    """An option given any number of times, each one of ``choices`` (``what``
    they are: the option's name by default); the command gets them as the
    tuple ``dest``."""
    names = Names(choices, what or name.lstrip("-"))
    return click.option(name, dest, type=names, multiple=True, help=help)


#: Sizes in tokens (block sizes, budgets, intervals): what a trace's config allows.
SIZE_LIMIT = (1 << 31) - 1

CAPACITY_BLOCKS = count_option(
    "--capacity-blocks",
    least=1,
    most=1 << 40,
    help="LRU store capacity in blocks across all groups [default: unbounded].",
)

LOOKAHEAD_TOKENS = count_option(
    "--lookahead-tokens",
    default=0,
    most=1 << 20,
    help="vLLM's num_hash_lookahead_tokens: tokens past each block that its hash also "
    "covers (the drafter's prefill lookahead, with --eagle, from vLLM 0.33.0; the "
    "Mooncake store takes them from 0.34.0).",
)

MODEL_HELP = "Model archetype: " + "; ".join(f"{a.name}: {a.models}" for a in ARCHETYPES.values())


def retention_interval(text: str, option: str = "--retention-interval") -> int | None:
    """``--retention-interval N|none``: vLLM's prefix_cache_retention_interval."""
    if text.strip().lower() == "none":
        return None
    try:
        return parse_count(text, option, most=SIZE_LIMIT)
    except ReplayError:
        raise ReplayError(
            f"{option} {shown(text)}: expected a whole number from 0 to {SIZE_LIMIT:,} or 'none'"
        ) from None


#: The click type of ``--retention-interval``.
RETENTION = _Parsed("N|none", retention_interval)


def _cache(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if value not in CACHES:
        if close_names(value, CACHES):
            raise fail(f"--cache: no cache {value!r}, {did_you_mean(value, CACHES)}")
        raise fail(f"--cache: expected one of {', '.join(CACHES)}, got {value!r}")
    return value


def optional_retention(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> int | str | None:
    """``--retention-interval`` parsed (``RETENTION``), or ``"release"`` when
    not given: the release's default, resolved once the release is known."""
    return "release" if value is None else RETENTION.convert(value, _param, _ctx)


def release_choice(policy: str | None, vllm_version: str | None) -> tuple[str, str | None]:
    """The release whose stores a source or what-if produces, by the one
    policy rule (``choose_policies``: ``--policy``, else ``--vllm``'s release,
    else the default); with the version given (recorded in the trace's
    ``source.vllm_version``)."""
    try:
        chosen = choose_policies(
            (policy,) if policy else (), vllm=(vllm_version,) if vllm_version else ()
        )
    except ReplayError as exc:
        raise fail(reworded(exc)) from None
    return chosen.policies[0], vllm_version


def release_retention(given: int | str | None, policy: str) -> int | None:
    """``--retention-interval`` as given, else the release's default (0 from
    vLLM 0.29.0, dense before: the setting was an unset environment variable)."""
    from replay.rules.coordinator.stores import policy_stores

    if given == "release":
        return policy_stores(policy).default_retention
    assert not isinstance(given, str)
    return given


def store_settings(
    retention: int | str | None,
    max_num_batched_tokens: int,
    cache: str,
    policy: str | None,
    vllm_version: str | None,
) -> StoreSettings:
    """A source's store settings from ``store_options``: the release chosen by
    ``--policy``/``--vllm``, its default retention unless one is given."""
    from replay.rules.store_rules import StoreSettings

    name, version = release_choice(policy, vllm_version)
    return StoreSettings(
        retention_interval=release_retention(retention, name),
        max_num_batched_tokens=max_num_batched_tokens,
        cache=cache,
        policy=name,
        vllm_version=version,
    )


RETENTION_HELP = (
    "vLLM's prefix_cache_retention_interval: 0 keeps only the states and sliding-window "
    "tails a replay can resume at, N also one per N tokens, none all of them (dense). "
    "[default: the release's: 0 from vLLM 0.29.0, none before]"
)


def release_options(fn: F) -> F:
    """``--policy`` / ``--vllm VERSION``: whose stores (and lookups) to produce."""
    for decorator in reversed(
        [
            click.option(
                "--policy",
                type=Names(POLICIES, "policy"),
                default=None,
                help=f"The vLLM release policy whose stores and hits to produce [default: "
                f"{DEFAULT_POLICY}]; recorded in the trace's source.",
            ),
            click.option(
                "--vllm",
                "vllm_version",
                metavar="VERSION",
                default=None,
                help="Produce what this vLLM release (e.g. 0.26.0) stores: its policy; "
                "recorded as the trace's source.vllm_version.",
            ),
        ]
    ):
        fn = decorator(fn)
    return fn


def store_options(fn: F) -> F:
    """The store rules' options of a trace source (``replay.rules.store_rules.StoreSettings``)."""
    for decorator in reversed(
        [
            click.option(
                "--retention-interval",
                default=None,
                callback=optional_retention,
                metavar="N|none",
                help=RETENTION_HELP,
            ),
            click.option(
                "--max-num-batched-tokens",
                default=8192,
                show_default=True,
                type=count_type(1, SIZE_LIMIT),
                help="vLLM's token budget per step: the longest prefill chunk (Mamba "
                "states are kept only at chunk ends).",
            ),
            click.option(
                "--cache",
                default="mooncake",
                show_default=True,
                callback=_cache,
                metavar="|".join(CACHES),
                help="Which cache's stores to emit: the Mooncake store connector's, or the "
                "GPU block pool's BlockStored events.",
            ),
        ]
    ):
        fn = decorator(fn)
    return release_options(fn)


# ---------------------------------------------------------------- the shared option bundles


def policy_default(*, results: bool = False) -> str:
    """What every command that reads a trace answers under when neither
    ``--policy`` nor ``--vllm`` is given (``choose_policies``)."""
    own = "a results file's own policy, else " if results else ""
    return f"Default: {own}the release that recorded the trace (source.vllm_version), else {DEFAULT_POLICY}."


def vllm_option(multiple: bool = False) -> Callable[[F], F]:
    """``--vllm VERSION``: as ``--policy``, by a vLLM version (the policy that
    models it); repeatable where ``--policy`` is."""
    return click.option(
        "--vllm",
        "vllm_versions",
        metavar="VERSION",
        multiple=True,
        help="As --policy, by a vLLM release (e.g. 0.26.0): the policy that models it"
        + ("; repeatable like --policy" if multiple else "")
        + ".",
    )


def policy_options(
    what: str, *, multiple: bool = False, results: bool = False, described: bool = True
) -> Callable[[F], F]:
    """``--policy`` and ``--vllm VERSION``, declared once for every command
    that reads a trace: the vLLM release whose semantics ``what`` says the
    command applies, its default the one rule (``policy_default``).
    ``multiple``: repeatable (the command gets ``policies``, else
    ``policy``); ``results``: a results file's own policy comes first;
    ``described``: each policy's meaning in the help."""
    listing = (
        " Policies: " + "; ".join(f"{p.name}: {p.description}" for p in POLICIES.values())
        if described
        else ""
    )
    help = f"The vLLM release policy {what}. {policy_default(results=results)}{listing}"
    policy = (
        repeated_choice("--policy", "policies", POLICIES, help)
        if multiple
        else click.option("--policy", type=Names(POLICIES, "policy"), default=None, help=help)
    )
    vllm = vllm_option(multiple)

    def apply(fn: F) -> F:
        return policy(vllm(fn))

    return apply


CACHE_DEFAULT = "Default: the trace's source.cache (recorded KV events: gpu), else mooncake."


def cache_option(
    what: str = "", *, multiple: bool = False, default: str = CACHE_DEFAULT
) -> Callable[[F], F]:
    """``--cache``, declared once: which of vLLM's caches answers, ``what``
    the command does with it; ``multiple``: repeatable (``caches``)."""
    help = (
        "Which vLLM cache answers: "
        + "; ".join(f"{c.name}: {c.description}" for c in CACHES.values())
        + (f". {what}" if what else "")
        + f". {default}"
    )
    if multiple:
        return repeated_choice("--cache", "caches", CACHES, help)
    return click.option("--cache", type=Names(CACHES, "cache"), default=None, help=help)


def coordinator_option(what: str = "", *, multiple: bool = False) -> Callable[[F], F]:
    """``--coordinator``, declared once: who answers the lookups (the
    registry's entries and their descriptions), ``what`` the command does
    with it; ``multiple``: repeatable (``coordinators``)."""
    from replay.rules.coordinator import COORDINATORS, DEFAULT_COORDINATOR

    help = (
        "Who answers the lookups: "
        + "; ".join(f"{k.name}: {k.description}" for k in COORDINATORS.values())
        + (f". {what}" if what else "")
        + "."
    )
    if multiple:
        return repeated_choice(
            "--coordinator", "coordinators", COORDINATORS, f"{help} Default: {DEFAULT_COORDINATOR}."
        )
    return click.option(
        "--coordinator",
        type=Names(COORDINATORS, "coordinator"),
        default=DEFAULT_COORDINATOR,
        show_default=True,
        help=help,
    )


#: ``--fail-on`` and ``--ignore``: which flags fail (``replay.analysis.selection``).
FAIL_ON = click.option(
    "--fail-on",
    "fail_on",
    multiple=True,
    metavar="SEVERITY|FLAG,...",
    help="Which flags fail: severities (corruption, inconsistent, performance, observed), "
    "flag names or all, comma-separated  [default: corruption]",
)
IGNORE = click.option(
    "--ignore",
    multiple=True,
    metavar="FLAG|SEVERITY,...",
    help="Flags (or severities) that never fail, taken from what --fail-on selects.",
)


def selection_options(fn: F) -> F:
    """``--fail-on`` and ``--ignore``, declared once."""
    return FAIL_ON(IGNORE(fn))


def chosen_policies(
    trace: Path | None,
    given: Iterable[str] = (),
    vllm: Iterable[str] = (),
    *,
    results_policy: str | None = None,
    quiet: bool = False,
    most: int | None = 1,
    alias_notes: bool = True,
) -> tuple[str, ...]:
    """The policies a command answers with (``choose_policies``: ``--policy``,
    ``--vllm``, a results file's own, the trace's recorded release, the
    default); what was inferred, and what an alias means, goes to stderr
    when the command is done (an error stays the one line)."""
    given, vllm = tuple(given), tuple(vllm)
    if most is not None and len(vllm) > most:
        raise fail(f"--vllm given {len(vllm)} times, expected at most {most}")
    source = None
    if not given and not vllm and results_policy is None and trace is not None:
        from replay.format.tracedir import open_trace

        source = open_trace(trace).config.source
    try:
        chosen = choose_policies(
            given, vllm=vllm, source=source, results_policy=results_policy, alias_notes=alias_notes
        )
    except ReplayError as exc:
        if source is None:
            raise
        raise ReplayError(f"{trace}: {exc}") from None  # the file whose source said it
    if not quiet:
        note_at_end(*chosen.notes)
    return chosen.policies

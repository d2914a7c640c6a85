"""``replay watch``: click only; the service is ``replay.watch``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import click

from replay.cli.common import command, fail
from replay.cli.options import (
    chosen_policies,
    count_type,
    policy_options,
    seconds_type,
    segment_type,
)
from replay.format.paths import check_outputs


def _say(message: str) -> None:
    click.echo(message, err=True)


@command()
@click.option(
    "--engine",
    "engines",
    multiple=True,
    required=True,
    metavar="kv=EP,lookups=EP[,replay=EP][,name=N][,topic=T]",
    help="An engine to watch (repeat for each; a data-parallel rank is an engine): its KV "
    "events (vLLM's kv_events_config endpoint), the vLLM plugin's lookup stream "
    "(REPLAY_LOOKUPS=tcp://...), optionally vLLM's replay endpoint (gaps are filled from it) "
    "and a name for its metrics and files (default engine0, engine1, ...).",
)
@policy_options(
    "every engine's lookups are judged under (an engine's own release is the vllm_version "
    "its plugin reports, its trace's source.vllm_version)",
    described=False,
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    metavar="DIR",
    help="Write a rolling trace: DIR/ENGINE/ is a trace directory of segments, each a "
    "complete trace with the store at its start (replay run / explain / report read it).",
)
@click.option(
    "--segment",
    type=segment_type(),
    default="10m",
    show_default=True,
    help="Close a segment of -o after this long (60, 30s, 10m, 1h) or this many events "
    "(100k, 10000events), as replay record's.",
)
@click.option(
    "--flags-out",
    type=click.Path(path_type=Path),
    default=None,
    metavar="FILE.jsonl",
    help="Append one JSON object per flagged lookup as it happens (engine, request, seq, "
    "flags, hits, and the replay explain command that shows it); a new file.",
)
@click.option(
    "--metrics",
    default=None,
    metavar="HOST:PORT",
    help="Serve Prometheus metrics on http://HOST:PORT/metrics (needs the watch extra).",
)
@click.option(
    "--duration",
    type=seconds_type(),
    default=None,
    help="Stop after this long (default: until SIGTERM or Ctrl-C).",
)
@click.option(
    "--status-every",
    type=seconds_type(),
    default=5.0,
    show_default=True,
    help="How often the one-line status goes to stderr.",
)
@click.option(
    "--hwm",
    type=count_type(1),
    default=10_000,
    show_default=True,
    help="Messages each socket queues before ZMQ drops (counted as gaps; vLLM never waits).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the final counts as one JSON object.")
def watch(
    engines: tuple[str, ...],
    policy: str | None,
    vllm_versions: tuple[str, ...],
    output: Path | None,
    segment: tuple[float | None, int | None],
    flags_out: Path | None,
    metrics: str | None,
    duration: float | None,
    status_every: float,
    hwm: int,
    as_json: bool,
) -> None:
    """Check a running fleet's every lookup as it happens.

    Each engine's store is folded from its KV events as they arrive; each
    lookup the vLLM plugin reports is answered under the policy of the
    engine's vLLM release and judged as `replay check` judges it (the flags,
    and the hit vLLM served against the policy's). Runs until SIGTERM or
    Ctrl-C (then closes the open segments and exits 0). An engine restart
    resets its store; a gap is filled from the replay endpoint, else counted.
    """
    from replay.sources.live import EngineEndpoints
    from replay.sources.record import require_extra, stop_on_signals
    from replay.watch import WatchOptions
    from replay.watch import watch as run_watch

    require_extra("replay watch", "zmq", "msgspec")
    seconds, events = segment
    if policy is not None or vllm_versions:
        # One policy for every engine, by the one rule (--policy, else --vllm's release).
        (policy,) = chosen_policies(None, (policy,) if policy else (), vllm_versions)
    check_outputs({"--flags-out": flags_out}, [], text=True, directories={"-o": output})
    if flags_out is not None and flags_out.exists():
        raise fail(f"--flags-out {flags_out}: already exists (not overwritten)")
    options = WatchOptions(
        engines=tuple(EngineEndpoints.parse(text, i) for i, text in enumerate(engines)),
        policy=policy,
        output=output,
        segment_seconds=seconds,
        segment_events=events,
        flags_out=flags_out,
        metrics=metrics,
        duration=duration,
        status_every=status_every,
        hwm=hwm,
    )
    stop = threading.Event()
    with stop_on_signals(stop):
        summary = run_watch(options, stop=stop, report=_say, status=_say)
    if as_json:
        click.echo(json.dumps(summary.to_json(), sort_keys=True))
        return
    for name, e in summary.engines.items():
        flags = ", ".join(f"{f['lookups']} {f['flag']}" for f in e["flags"]) or "no flags"
        click.echo(
            f"{name}: {e['lookups']:,} lookups, {e['flagged_lookups']:,} flagged ({flags}), "
            f"{e['observed_mismatch']:,} observed mismatches, {e['gaps']} gaps, "
            f"{e['restarts']} restarts" + (f"; trace {e['trace']}" if e["trace"] else "")
        )

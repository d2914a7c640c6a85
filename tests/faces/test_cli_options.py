"""replay.cli.options: every number a user types is parsed exactly and
range-checked, one line and exit status 2 when it is not one (issue 25)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.base.errors import ReplayError
from replay.base.units import (
    parse_bytes,
    parse_count,
    parse_integer,
    parse_seconds,
    parse_seed,
)
from tests.conftest import run_cli

I64 = "9,223,372,036,854,775,807"


def test_counts_take_suffixes_exactly() -> None:
    assert parse_count("1000", "-n") == 1000
    assert parse_count("64k", "-n") == 64_000
    assert parse_count("2M", "-n") == 2_000_000
    assert parse_count("1.5G", "-n") == 1_500_000_000
    assert parse_count(" 12 ", "-n") == 12
    assert parse_count("9223372036854775807", "-n") == (1 << 63) - 1
    for bad in ("²", "٣", "-1", "0x10", "1e3", "1.5", "1.0001k", "nan", "", "9223372036854775808"):
        with pytest.raises(ReplayError, match="expected a whole number from 0 to"):
            parse_count(bad, "-n")


def test_bytes_are_exact_and_bounded() -> None:
    assert parse_bytes("64GiB", "-b") == 64 << 30
    assert parse_bytes("1.5KiB", "-b") == 1536
    assert parse_bytes("500mb", "-b") == 500 * 10**6
    for bad in ("0.3KiB", "0", "1" * 400, "1" * 400 + "GiB", "9EiB", "1e9", "8192PiB"):
        with pytest.raises(ReplayError, match="expected a whole number of bytes"):
            parse_bytes(bad, "-b")


def test_durations_seeds_and_integers() -> None:
    assert parse_seconds("2.5", "-d") == 2.5
    assert parse_seconds("10m", "-d") == 600.0
    assert parse_seconds("250ms", "-d") == 0.25
    for bad in ("nan", "inf", "1e308", "0", "-1", "400d"):
        with pytest.raises(ReplayError, match="expected a duration above 0"):
            parse_seconds(bad, "-d")
    assert parse_seed("18446744073709551615") == (1 << 64) - 1
    for bad in ("-1", "18446744073709551616", "1k"):
        with pytest.raises(ReplayError, match="expected a whole number from 0 to"):
            parse_seed(bad)
    assert parse_integer("-5", "--seq", least=-10, most=10) == -5
    with pytest.raises(ReplayError, match="expected an integer from -10 to 10"):
        parse_integer("--5", "--seq", least=-10, most=10)


CASES = {
    "capacity superscript": (
        ["whatif", "{t}", "--capacity-blocks", "²", "-o", "{o}"],
        "--capacity-blocks '²': expected a whole number from 1 to 1,125,899,906,842,624, k/M/G/T suffixes allowed",
    ),
    "capacity 2^63": (
        ["whatif", "{t}", "--capacity-blocks", "9223372036854775808", "-o", "{o}"],
        "--capacity-blocks '9223372036854775808': expected a whole number from 1 to 1,125,899,906,842,624, k/M/G/T suffixes allowed",
    ),
    "400-digit size": (
        ["whatif", "{t}", "--capacity-bytes", "9" * 400, "--page-bytes", "4KiB", "-o", "{o}"],
        "--capacity-bytes '" + "9" * 40 + f"…': expected a whole number of bytes from 1 to {I64}, such as 4096, 500MB or 64GiB",
    ),
    "page bytes above 1 TiB": (
        ["whatif", "{t}", "--capacity-bytes", "1GiB", "--page-bytes", "2TiB", "-o", "{o}"],
        "--page-bytes: a page is at most 1099511627776 bytes (1TiB)",
    ),
    "sample nan": (
        ["whatif", "{t}", "--capacity", "100", "--sample", "nan", "-o", "{o}"],
        "--sample 'nan': expected a fraction above 0 and up to 1, such as 0.1",
    ),
    "sample above 1": (
        ["whatif", "{t}", "--capacity", "100", "--sample", "1.5", "-o", "{o}"],
        "--sample '1.5': expected a fraction above 0 and up to 1, such as 0.1",
    ),
    "seed -1": (
        ["synth", "-o", "{o}", "--model", "full", "--seed", "-1"],
        "--seed '-1': expected a whole number from 0 to 18,446,744,073,709,551,615",
    ),
    "duration nan": (
        ["record", "--endpoint", "tcp://127.0.0.1:1", "-o", "{o}", "--block-size", "16", "--duration", "nan"],
        "--duration 'nan': expected a duration above 0 and up to 31,622,400 seconds, such as 30, 2.5s, 10m or 1h",
    ),
    "duration 1e308": (
        ["record", "--endpoint", "tcp://127.0.0.1:1", "-o", "{o}", "--block-size", "16", "--duration", "1e308"],
        "--duration '1e308': expected a duration above 0 and up to 31,622,400 seconds, such as 30, 2.5s, 10m or 1h",
    ),
    "kv-events block size 2^40": (
        ["ingest", "kv-events", "{t}", "-o", "{o}", "--block-size", str(1 << 40)],
        "--block-size '1099511627776': expected a whole number from 1 to 2,147,483,647, k/M/G/T suffixes allowed",
    ),
    "state at 2^63": (
        ["state", "{t}", "--at", str(1 << 63)],
        f"--at '{1 << 63}': expected an integer from -9,223,372,036,854,775,808 to {I64}",
    ),
    "limit not whole": (
        ["--max-row-hashes", "1.5", "validate", "{t}"],
        f"--max-row-hashes '1.5': expected a whole number from 1 to {I64}, k/M/G/T suffixes allowed",
    ),
    "points beyond 10k": (
        ["whatif", "{t}", "--points", "1000000000000", "--min", "1", "--max", "10", "-o", "{o}"],
        "--points '1000000000000': expected a whole number from 2 to 10,000, k/M/G/T suffixes allowed",
    ),
    "percent zero": (
        ["whatif", "{t}", "--capacity", "0%", "-o", "{o}"],
        "--capacity '0%': expected a percentage above 0% and up to 1,000,000%, such as 10%",
    ),
    "percent exponent": (
        ["whatif", "{t}", "--capacity", "1e3%", "-o", "{o}"],
        "--capacity '1e3%': expected a percentage above 0% and up to 1,000,000%, such as 10%",
    ),
    "capacity list of commas": (
        ["whatif", "{t}", "--capacity", ",,", "-o", "{o}"],
        "--capacity ',,': expected at least one value",
    ),
    "retention 1e9": (
        ["whatif", "{t}", "--capacity", "10", "--retention-interval", "1e9", "-o", "{o}"],
        "--retention-interval '1e9': expected a whole number from 0 to 2,147,483,647 or 'none'",
    ),
    "budget zero": (
        ["ingest", "mooncake", "{t}", "--max-num-batched-tokens", "0", "-o", "{o}"],
        "--max-num-batched-tokens '0': expected a whole number from 1 to 2,147,483,647, k/M/G/T suffixes allowed",
    ),
    "workers": (
        ["run", "{t}", "--workers", "0", "-q"],
        "--workers '0': expected a whole number from 1 to 4,096, k/M/G/T suffixes allowed",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_numbers_are_one_line_exit_2_and_nothing_written(
    tmp_path: Path, trace_43559: Path, case: str
) -> None:
    args, message = CASES[case]
    out = tmp_path / "o.parquet"
    result = run_cli([a.format(t=trace_43559, o=out) for a in args])
    assert (result.exit_code, result.stderr) == (2, f"error: {message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [trace_43559.name]


def test_a_capacity_beyond_what_the_requests_use_runs_at_what_they_use(
    tmp_path: Path, trace_43559: Path
) -> None:
    """A billion GPU blocks once allocated ~40 GB up front; the runs are the
    same as at the largest size the trace can fill (nothing is evicted)."""
    from replay.format.sweepfile import read_sweep

    out = tmp_path / "w.parquet"
    args = ["whatif", str(trace_43559), "--cache", "gpu", "--capacity-blocks", "1000000000,1T", "-o", str(out), "-q", "--jobs", "1"]  # fmt: skip
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    frame, _ = read_sweep(out)
    assert frame["capacity_blocks"].to_list() == [10**9, 10**12]
    assert frame["evicted_blocks"].to_list() == [0, 0]
    assert frame["hit_tokens"][0] == frame["hit_tokens"][1]


def test_a_limit_from_the_environment_is_parsed_by_the_same_parser(
    trace_43559: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPLAY_MAX_ROW_HASHES", "4²")
    result = run_cli(["validate", str(trace_43559)])
    assert (result.exit_code, result.stderr) == (
        2,
        f"error: REPLAY_MAX_ROW_HASHES '4²': expected a whole number from 1 to {I64}, "
        "k/M/G/T suffixes allowed\n",
    )

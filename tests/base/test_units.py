"""``replay.base.units``: exact counts, byte sizes, percentages and log ranges."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from replay.base.errors import ReplayError
from replay.base.units import (
    Capacity,
    log_spaced,
    model_page_bytes,
    parse_bytes,
    parse_capacities,
    parse_count,
)
from replay.cli.common import reworded


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("10k", 10_000),
        ("10K", 10_000),
        ("1.5M", 1_500_000),
        ("2G", 2 * 10**9),
        ("1Ki", 1024),
        ("0.5Mi", 2**19),
        ("3T", 3 * 10**12),
        (" 7 ", 7),
    ],
)
def test_counts_take_suffixes_exactly(text: str, value: int) -> None:
    assert parse_count(text, "-n") == value


@pytest.mark.parametrize(
    "text",
    [
        "1.5",
        "10x",
        "",
        "0",
        "-3",
        "1.0001k",
        "1e3",
        "0x10",
        "²",
        "1" * 41,
        "1125899906842625",
    ],
)
def test_bad_counts_are_one_line(text: str) -> None:
    with pytest.raises(ReplayError) as info:
        parse_count(text, "--opt", least=1, most=1 << 50)
    shown = repr(text if len(text) <= 40 else text[:40] + "…")
    assert str(info.value) == (
        f"--opt {shown}: expected a whole number from 1 to 1,125,899,906,842,624, "
        "k/M/G/T suffixes allowed"
    )


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64GiB", 64 * 2**30),
        ("500MB", 500 * 10**6),
        ("4096", 4096),
        ("1.5KiB", 1536),
        ("2mib", 2 * 2**20),
        ("1B", 1),
        ("0.5TB", 5 * 10**11),
    ],
)
def test_bytes(text: str, value: int) -> None:
    assert parse_bytes(text, "-b") == value


def test_bytes_refuse_fractions_of_a_byte_and_zero() -> None:
    for text in ("1.0001KB", "0GiB"):
        with pytest.raises(ReplayError) as info:
            parse_bytes(text, "-b")
        assert str(info.value) == (
            f"-b {text!r}: expected a whole number of bytes from 1 to 9,223,372,036,854,775,807, "
            "such as 4096, 500MB or 64GiB"
        )


def test_capacities_keep_their_unit_and_resolve_to_blocks() -> None:
    assert [c.unit for c in parse_capacities("10k,2M")] == ["blocks", "blocks"]
    gib = parse_capacities("8GiB,16GiB")
    assert [c.blocks(block_bytes=2**21, working_set=None) for c in gib] == [4096, 8192]
    assert gib[0].bytes == 8 * 2**30
    pct = parse_capacities("10%,50%,10%")
    assert [c.value for c in pct] == [Fraction(1, 10), Fraction(1, 2)]
    # 10% of 1,234 blocks is 123.4: rounded down, never to zero
    assert [c.blocks(block_bytes=None, working_set=1234) for c in pct] == [123, 617]
    assert (
        Capacity("percent", Fraction(1, 10**6), "0.0001%").blocks(block_bytes=None, working_set=10)
        == 1
    )
    with pytest.raises(ReplayError, match="holds no block of 4096 bytes"):
        parse_capacities("1KiB")[0].blocks(block_bytes=4096, working_set=None)


def test_log_spaced_ranges_include_both_ends_and_round_to_whole_blocks() -> None:
    low, high = parse_capacities("10k")[0], parse_capacities("2M")[0]
    values = [int(c.value) for c in log_spaced(low, high, 10)]
    assert values[0] == 10_000 and values[-1] == 2_000_000 and len(values) == 10
    ratios = [b / a for a, b in itertools.pairwise(values)]
    assert all(abs(r - 200 ** (1 / 9)) < 1e-3 for r in ratios)
    assert [
        int(c.value) for c in log_spaced(parse_capacities("1")[0], parse_capacities("4")[0], 4)
    ] == [1, 2, 3, 4]
    # More points than whole sizes in the range: refused, not fewer runs silently (issue 36).
    with pytest.raises(ReplayError) as caught:
        log_spaced(parse_capacities("1")[0], parse_capacities("4")[0], 9)
    assert str(caught.value) == (
        "`points` 9: from `min` 1 to `max` 4 there are only 4 sizes in blocks; give `points` 2 to 4"
    )
    # The command line says its flags (``replay.cli.common.reworded``).
    assert reworded(caught.value) == (
        "--points 9: from --min 1 to --max 4 there are only 4 sizes in blocks; give --points 2 to 4"
    )
    pct = log_spaced(parse_capacities("1%")[0], parse_capacities("100%")[0], 3)
    assert [c.text for c in pct] == ["1%", "10%", "100%"]
    with pytest.raises(ReplayError, match="must be larger"):
        log_spaced(high, low, 3)


def test_model_config_sizes_a_page_from_the_attention_layers() -> None:
    llama = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    }
    # K and V x 32 layers x 8 heads x 128 dims x 16 tokens x 2 bytes
    assert model_page_bytes(llama, 16, "c.json") == 2 * 32 * 8 * 128 * 16 * 2
    hybrid = {**llama, "layer_types": ["mamba", "mamba", "mamba", "attention"] * 8}
    assert model_page_bytes(hybrid, 16, "c.json") == 2 * 8 * 8 * 128 * 16 * 2
    with pytest.raises(ReplayError, match=r"c\.json: needs num_hidden_layers"):
        model_page_bytes({}, 16, "c.json")

"""Quantities as an operator types them: counts (``10k``, ``2M``), byte sizes
(``8GiB``, ``500MB``), percentages (``10%``) and log-spaced ranges of them.

Pure and exact: numbers are parsed as decimal fractions (``1.5k`` is 1500,
``0.5KiB`` is 512), never through a float, and a count or a byte size that
is not a whole number is refused. Every error is a ``ReplayError`` whose
message is one line naming the option and the text. No click here: the
command-line types (``replay.cli.options``) wrap these functions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from replay.base.errors import ReplayError

#: Decimal count suffixes (``k``/``K`` both mean 1000) and binary ones.
COUNT_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
#: Byte units, case-insensitive: ``KB`` = 1000, ``KiB`` = 1024.
BYTE_UNITS = {
    "b": 1,
    **{p + "b": 1000**i for i, p in enumerate("kmgtp", start=1)},
    **{p + "ib": 1024**i for i, p in enumerate("kmgtp", start=1)},
}

# ASCII digits only ("²" or "٣" are not numbers here), and at most
# _MAX_CHARS characters: a 400-digit size is refused before it is read.
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_COUNT = re.compile(rf"^{_NUMBER}\s*([kKMGT]i?)?$", re.ASCII)
_BYTES = re.compile(rf"^{_NUMBER}\s*([kKmMgGtTpP]?[iI]?[bB])$", re.ASCII)
_PERCENT = re.compile(rf"^{_NUMBER}\s*%$", re.ASCII)
_MAX_CHARS = 40
#: The largest count (2**50) and byte size (what int64 holds) taken; a
#: what-if pool beyond what its requests can fill runs at what they fill.
MAX_COUNT = 1 << 50
MAX_BYTES = (1 << 63) - 1

Unit = Literal["blocks", "bytes", "percent"]


def _label(option: str, text: str) -> str:
    given = text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS] + "…"
    return f"{option}: {given!r}" if option else repr(given)


def parse_count(text: str, option: str = "", *, least: int = 1) -> int:
    """``10k``, ``1.5M``, ``2Gi``, ``4096``: a whole count of at least ``least``."""
    m = _COUNT.match(text.strip()) if len(text) <= _MAX_CHARS else None
    if m is None:
        raise ReplayError(f"{_label(option, text)}: expected a count such as 4096, 10k, 1.5M or 2G")
    value = Fraction(m.group(1)) * COUNT_SUFFIXES[m.group(2) or ""]
    if value.denominator != 1:
        raise ReplayError(f"{_label(option, text)}: is not a whole number ({float(value):g})")
    if value < least:
        raise ReplayError(f"{_label(option, text)}: must be at least {least}")
    if value > MAX_COUNT:
        raise ReplayError(f"{_label(option, text)}: must be at most {MAX_COUNT:,}")
    return int(value)


def parse_bytes(text: str, option: str = "") -> int:
    """``64GiB``, ``500MB``, ``1.5KiB``, ``4096``: a positive whole byte count
    (``KB`` = 1000, ``KiB`` = 1024; a bare number is bytes)."""
    t = text.strip()
    if len(t) > _MAX_CHARS:
        raise ReplayError(f"{_label(option, text)}: expected a size such as 4096, 500MB or 64GiB")
    m = _BYTES.match(t)
    if m is not None:
        value = Fraction(m.group(1)) * BYTE_UNITS[m.group(2).lower()]
    elif re.fullmatch(_NUMBER, t, re.ASCII):
        value = Fraction(t)
    else:
        raise ReplayError(f"{_label(option, text)}: expected a size such as 4096, 500MB or 64GiB")
    if value.denominator != 1:
        raise ReplayError(f"{_label(option, text)}: is not a whole number of bytes")
    if value <= 0:
        raise ReplayError(f"{_label(option, text)}: must be positive")
    if value > MAX_BYTES:
        raise ReplayError(f"{_label(option, text)}: must be at most {MAX_BYTES:,} bytes")
    return int(value)


def parse_percent(text: str, option: str = "") -> Fraction:
    """``10%``, ``0.5%``, ``150%``: a positive fraction (0.1 for ``10%``)."""
    m = _PERCENT.match(text.strip()) if len(text) <= _MAX_CHARS else None
    if m is None:
        raise ReplayError(f"{_label(option, text)}: expected a percentage such as 10%")
    value = Fraction(m.group(1)) / 100
    if value <= 0:
        raise ReplayError(f"{_label(option, text)}: must be positive")
    return value


@dataclass(frozen=True, slots=True)
class Capacity:
    """One cache size as given: ``value`` blocks, bytes, or a fraction of
    the working set (``percent``: 0.1 for ``10%``)."""

    unit: Unit
    value: Fraction
    text: str

    def blocks(self, *, block_bytes: int | None, working_set: int | None) -> int:
        """The size in blocks, rounded down (at least one block)."""
        if self.unit == "blocks":
            return int(self.value)
        if self.unit == "bytes":
            if block_bytes is None:
                raise ReplayError(
                    f"capacity {self.text!r} is in bytes: the trace does not record its page "
                    "sizes; give --page-bytes or --model-config"
                )
            blocks = self.value // block_bytes
            if blocks < 1:
                raise ReplayError(f"capacity {self.text!r} holds no block of {block_bytes} bytes")
            return int(blocks)
        assert working_set is not None
        return max(1, int(self.value * working_set))

    @property
    def bytes(self) -> int | None:
        return int(self.value) if self.unit == "bytes" else None


def parse_capacity(text: str, option: str = "--capacity") -> Capacity:
    """A block count (``10k``), a byte size (``8GiB``: a unit ending in B) or
    a percentage of the working set (``10%``)."""
    t = text.strip()
    if t.endswith("%"):
        return Capacity("percent", parse_percent(t, option), t)
    if t[-1:] in "bB":
        return Capacity("bytes", Fraction(parse_bytes(t, option)), t)
    return Capacity("blocks", Fraction(parse_count(t, option)), t)


def parse_capacities(text: str, option: str = "--capacity") -> list[Capacity]:
    """A comma-separated list of capacities, all in one unit, duplicates dropped."""
    parts = [p for p in (s.strip() for s in text.split(",")) if p]
    if not parts:
        raise ReplayError(f"{option}: no capacity given")
    out: list[Capacity] = []
    for part in parts:
        cap = parse_capacity(part, option)
        if out and cap.unit != out[0].unit:
            raise ReplayError(
                f"{option}: {part!r} is in {cap.unit}, {out[0].text!r} in {out[0].unit}: "
                "give every capacity in one unit"
            )
        if all(c.value != cap.value for c in out):
            out.append(cap)
    return out


def log_spaced(
    low: Capacity, high: Capacity, points: int, option: str = "--points"
) -> list[Capacity]:
    """``points`` capacities from ``low`` to ``high`` (both included), evenly
    spaced on a log axis, in their unit; whole counts and bytes are rounded
    to the nearest whole number, duplicates after rounding dropped."""
    if low.unit != high.unit:
        raise ReplayError(f"--min {low.text!r} and --max {high.text!r} are in different units")
    if points < 2:
        raise ReplayError(f"{option}: a range needs at least 2 points, got {points}")
    if high.value <= low.value:
        raise ReplayError(f"--max {high.text!r} must be larger than --min {low.text!r}")
    ratio = math.log(high.value / low.value)
    values: list[Fraction] = []
    for i in range(points):
        if i == 0:
            v = low.value
        elif i == points - 1:
            v = high.value
        else:
            x = Fraction(float(low.value) * math.exp(ratio * i / (points - 1)))
            v = Fraction(round(x)) if low.unit != "percent" else x.limit_denominator(10**6)
        if v not in values:
            values.append(v)
    return [Capacity(low.unit, v, _show(low.unit, v)) for v in values]


def _show(unit: Unit, value: Fraction) -> str:
    if unit == "percent":
        return f"{float(value * 100):g}%"
    return str(int(value)) + ("B" if unit == "bytes" else "")


def human_bytes(n: int) -> str:
    """``8589934592`` -> ``8GiB``; exact when a binary unit divides it."""
    for suffix, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            q = Fraction(n, size)
            return f"{float(q):.4g}{suffix}"
    return f"{n}B"


def human_count(n: int) -> str:
    for suffix, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.4g}{suffix}"
    return str(n)


# ---------------------------------------------------------------- page sizes

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


def model_page_bytes(config: dict[str, object], block_size: int, where: str) -> int:
    """Bytes of one ``block_size``-token block across the model's attention
    layers, from a Hugging Face ``config.json``: K and V, ``num_key_value_heads``
    x ``head_dim`` each, per attention layer, in the model's dtype. Hybrid
    models list their attention layers (``layer_types`` / ``layers_block_type``
    / ``full_attention_interval``); without them every layer counts."""
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}

    def number(*names: str) -> int | None:
        for name in names:
            v = config.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    layers = number("num_hidden_layers", "n_layer", "num_layers")
    heads = number("num_attention_heads", "n_head")
    if layers is None or heads is None:
        raise ReplayError(
            f"{where}: needs num_hidden_layers and num_attention_heads to size a KV page"
        )
    kv_heads = number("num_key_value_heads", "num_kv_heads") or heads
    head_dim = number("head_dim")
    if head_dim is None:
        hidden = number("hidden_size", "d_model")
        if hidden is None:
            raise ReplayError(f"{where}: needs head_dim or hidden_size to size a KV page")
        head_dim = hidden // heads
    types = config.get("layer_types") or config.get("layers_block_type")
    if isinstance(types, list):
        attention = sum(1 for t in types if "attention" in str(t).lower())
    elif isinstance(config.get("full_attention_interval"), int):
        attention = layers // int(config["full_attention_interval"])  # type: ignore[call-overload]
    else:
        attention = layers
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").lower()
    dtype = dtype.removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise ReplayError(f"{where}: unknown torch_dtype {dtype!r}")
    return 2 * attention * kv_heads * head_dim * block_size * _DTYPE_BYTES[dtype]


def describe(capacities: Sequence[Capacity]) -> str:
    return ",".join(c.text for c in capacities)

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from replay.base.errors import ReplayError

# ---------------------------------------------------------------- numbers
#
# Every number a user types (an option, a limit's environment variable, a
# capacity) is parsed here, exactly (integers and decimal fractions, never a
# float on the way) and range-checked, so nothing a user gives reaches
# int(), float() or numpy unchecked. Each error is one line:
# ``OPTION 'TEXT': expected ...``. The command line's click types
# (``replay.cli.options``) wrap these functions.

#: The largest count, byte size or seed most options take: what int64 holds.
INT64_MAX = (1 << 63) - 1
#: The largest capacity in blocks (2**50); a what-if pool beyond what its
#: requests can fill runs at what they fill.
MAX_COUNT = 1 << 50
#: Longer text is refused before it is read as a number (a 400-digit size).
_MAX_CHARS = 40
#: A decimal number (ASCII digits only: "²" and other Unicode digits are not
#: numbers here), an optional fraction, an optional unit.
_NUMBER = re.compile(r"([0-9]+)(?:\.([0-9]+))?\s*([A-Za-z%]*)", re.ASCII)

#: Count suffixes, case-insensitive: k/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024.
COUNT_UNITS: dict[str, int] = {
    "": 1,
    **{u: 1000 ** "_kmgt".index(u) for u in "kmgt"},
    **{f"{u}i": 1024 ** "_kmgt".index(u) for u in "kmgt"},
}
#: Byte units, case-insensitive: ``KB`` and ``k`` = 1000, ``KiB`` and ``Ki`` = 1024.
BYTE_UNITS: dict[str, int] = {
    "": 1,
    **{u: 1000 ** "_kmgtp".index(u) for u in "kmgtp"},
    **{f"{u}i": 1024 ** "_kmgtp".index(u) for u in "kmgtp"},
}
BYTE_UNITS = {**BYTE_UNITS, **{f"{u}b": f for u, f in BYTE_UNITS.items()}}
SECOND_UNITS: dict[str, int | Fraction] = {
    "": 1, "s": 1, "ms": Fraction(1, 1000), "m": 60, "min": 60, "h": 3600, "d": 86400
}  # fmt: skip
PERCENT_UNITS = {"%": Fraction(1, 100)}

Unit = Literal["blocks", "bytes", "percent"]


def shown(text: str) -> str:
    """How an error quotes what the user typed (a 400-digit value, cut)."""
    given = text.strip()
    return repr(given if len(given) <= _MAX_CHARS else given[:_MAX_CHARS] + "…")


def _exact(text: str, units: Mapping[str, int | Fraction]) -> Fraction | None:
    """``text`` as an exact number in ``units``, or None."""
    given = text.strip()
    m = _NUMBER.fullmatch(given) if len(given) <= _MAX_CHARS else None
    unit = m.group(3).lower() if m is not None else ""
    if m is None or unit not in units:
        return None
    whole, frac = m.group(1), m.group(2) or ""
    return Fraction(int(whole + frac), 10 ** len(frac)) * Fraction(units[unit])


def parse_count(
    text: str, option: str, *, least: int = 0, most: int = INT64_MAX, units: bool = True
) -> int:
    """A whole number, optionally with a suffix (k/M/G/T: powers of 1000,
    Ki/Mi/Gi/Ti: of 1024): ``1000``, ``64k``, ``2M``, ``1.5k``, ``2Gi``;
    from ``least`` to ``most``."""
    value = _exact(text, COUNT_UNITS if units else {"": 1})
    if value is None or value.denominator != 1 or not least <= value <= most:
        suffixes = ", k/M/G/T suffixes allowed" if units else ""
        raise ReplayError(
            f"{option} {shown(text)}: expected a whole number from {least:,} to {most:,}{suffixes}"
        )
    return int(value)


def parse_bytes(text: str, option: str, *, least: int = 1, most: int = INT64_MAX) -> int:
    """A byte size: ``4096``, ``500MB`` (powers of 1000), ``64GiB`` (powers
    of 1024), ``1.5KiB``; a whole number of bytes from ``least`` to ``most``."""
    value = _exact(text, BYTE_UNITS)
    if value is None or value.denominator != 1 or not least <= value <= most:
        raise ReplayError(
            f"{option} {shown(text)}: expected a whole number of bytes from {least:,} to "
            f"{most:,}, such as 4096, 500MB or 64GiB"
        )
    return int(value)


def parse_seconds(text: str, option: str, *, most: int = 366 * 86400) -> float:
    """A positive duration: seconds (``30``, ``2.5``) or with a unit (``ms``,
    ``s``, ``m``/``min``, ``h``, ``d``); at most ``most`` seconds."""
    value = _exact(text, SECOND_UNITS)
    if value is None or not 0 < value <= most:
        raise ReplayError(
            f"{option} {shown(text)}: expected a duration above 0 and up to {most:,} "
            "seconds, such as 30, 2.5s, 10m or 1h"
        )
    return float(value)


def parse_segment(text: str, option: str = "--segment") -> tuple[float | None, int | None]:
    """How often a segmented writer (``replay record -o DIR``, ``replay
    watch -o DIR``) closes a segment: a duration (``60``, ``30s``, ``10m``,
    ``1h``; a bare number is seconds) or a count of events (``10000events``,
    ``50k events``, or a count suffix that is no unit of time: ``100k``,
    ``1M``, ``2G``; ``m`` is minutes). Returns (seconds, None) or (None,
    events)."""
    given = text.strip()
    lowered = given.lower()
    count: str | None = None
    for word in ("events", "event"):
        if lowered.endswith(word):
            count = given[: -len(word)].strip()
            break
    else:
        m = _NUMBER.fullmatch(given) if len(given) <= _MAX_CHARS else None
        unit = m.group(3) if m is not None else ""
        # Counts and durations share "m": lower case is minutes, M millions.
        minutes = unit.lower() in ("m", "mi") and not unit.startswith("M")
        if unit and unit.lower() in COUNT_UNITS and not minutes:
            count = given
    try:
        if count is not None:
            return None, parse_count(count, option, least=1)
        return parse_seconds(given, option), None
    except ReplayError:
        raise ReplayError(
            f"{option} {shown(text)}: expected a duration (60, 30s, 10m, 1h) or a number of "
            "events (10000events, 50k events, 100k)"
        ) from None


def parse_seed(text: str, option: str = "--seed") -> int:
    """A random seed: a whole number from 0 to 2**64 - 1."""
    return parse_count(text, option, least=0, most=(1 << 64) - 1, units=False)


def parse_integer(text: str, option: str, *, least: int, most: int) -> int:
    """A plain integer, negative ones too (a seq), from ``least`` to ``most``."""
    given = text.strip()
    negative = given.startswith("-")
    body = given[1:] if given[:1] in "+-" else given
    value = _exact(body, {"": 1})
    number = None if value is None else -int(value) if negative else int(value)
    if number is None or not least <= number <= most:
        raise ReplayError(f"{option} {shown(text)}: expected an integer from {least:,} to {most:,}")
    return number


def parse_fraction(text: str, option: str) -> float:
    """A fraction above 0 and at most 1, as a decimal (``0.1``, ``1``)."""
    value = _exact(text, {"": 1})
    if value is None or not 0 < value <= 1:
        raise ReplayError(
            f"{option} {shown(text)}: expected a fraction above 0 and up to 1, such as 0.1"
        )
    return float(value)


def parse_percent(text: str, option: str) -> Fraction:
    """``10%``, ``0.5%``, ``150%``: a positive fraction (0.1 for ``10%``), at
    most 1,000,000%."""
    value = _exact(text, PERCENT_UNITS)
    if value is None or not 0 < value <= 10**4:
        raise ReplayError(
            f"{option} {shown(text)}: expected a percentage above 0% and up to 1,000,000%, "
            "such as 10%"
        )
    return value


#: The most values a comma-separated option takes, and the most capacities
#: a log-spaced range (``--points``) makes.
MAX_LIST = 1000
MAX_POINTS = 10_000


def split_list(text: str, option: str) -> list[str]:
    """The non-empty parts of a comma-separated option, at most :data:`MAX_LIST`."""
    parts = [p for p in (s.strip() for s in text.split(",")) if p]
    if not parts:
        raise ReplayError(f"{option} {shown(text)}: expected at least one value")
    if len(parts) > MAX_LIST:
        raise ReplayError(f"{option}: at most {MAX_LIST:,} values, got {len(parts):,}")
    return parts


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
                    "sizes; give `page_bytes` or `model_config`"
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
    if t[-1:] in ("b", "B"):
        return Capacity("bytes", Fraction(parse_bytes(t, option)), t)
    return Capacity("blocks", Fraction(parse_count(t, option, least=1, most=MAX_COUNT)), t)


def parse_capacities(text: str, option: str = "--capacity") -> list[Capacity]:
    """A comma-separated list of capacities, all in one unit, duplicates dropped."""
    out: list[Capacity] = []
    for part in split_list(text, option):
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
    low: Capacity, high: Capacity, points: int, option: str = "`points`"
) -> list[Capacity]:
    """``points`` capacities from ``low`` to ``high`` (both included), evenly
    spaced on a log axis, in their unit; whole counts and bytes are rounded
    to the nearest whole number, duplicates after rounding dropped."""
    if low.unit != high.unit:
        raise ReplayError(f"`min` {low.text!r} and `max` {high.text!r} are in different units")
    if not 2 <= points <= MAX_POINTS:
        raise ReplayError(f"{option}: a range takes 2 to {MAX_POINTS:,} points, got {points:,}")
    if high.value <= low.value:
        raise ReplayError(f"`max` {high.text!r} must be larger than `min` {low.text!r}")
    whole = high.value - low.value + 1
    if low.unit != "percent" and points > whole:
        # Rounded to whole blocks or bytes, the range holds fewer sizes.
        raise ReplayError(
            f"{option} {points:,}: from `min` {low.text} to `max` {high.text} there are "
            f"only {int(whole):,} sizes in {low.unit}; give `points` 2 to {int(whole):,}"
        )
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

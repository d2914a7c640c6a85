"""Sizes for the what-if: byte counts (64GiB, 500MB), the groups' page sizes, and
the blocks a byte capacity holds."""

from __future__ import annotations

import re
from collections.abc import Sequence

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


def parse_bytes(text: str) -> int:
    """``64GiB``, ``500MB``, ``4096``: a byte count (``Ki`` = 1024, ``K`` = 1000)."""
    m = _SIZE.match(text)
    if m is None:
        raise ReplayError(f"size {text!r}: expected a number with an optional unit such as 64GiB")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = unit[:1]
    factor = 1024 ** "_kmgtp".index(base) if unit[1:2] == "i" else _UNITS[base]
    value = int(number * factor)
    if value <= 0:
        raise ReplayError(f"size {text!r}: must be positive")
    return value


def page_sizes(config: TraceConfig, page_bytes: str | None) -> tuple[int, ...]:
    """Per group, the bytes of one block (all of its layers): ``--page-bytes``
    (one size for every group, or one per group, comma-separated), else the
    trace's ``source.page_bytes``."""
    if page_bytes is None:
        source = config.source or {}
        given = source.get("page_bytes")
        if given is None:
            raise ReplayError(
                "--capacity-bytes needs the groups' page sizes: give --page-bytes "
                "(e.g. 2MiB, or one size per group: 2MiB,512KiB)"
            )
        parts = [str(p) for p in given] if isinstance(given, list) else [str(given)]
    else:
        parts = [p for p in page_bytes.split(",") if p.strip()]
    sizes = [parse_bytes(p) for p in parts]
    if len(sizes) == 1:
        sizes *= config.num_groups
    if len(sizes) != config.num_groups:
        raise ReplayError(
            f"--page-bytes: {len(sizes)} sizes for {config.num_groups} KV-cache groups"
        )
    return tuple(sizes)


def blocks_for_bytes(capacity_bytes: int, pages: Sequence[int]) -> int:
    """Blocks of ``capacity_bytes``: the gpu pool gives every group one page
    size, so a block costs the largest page; the mooncake store counts each
    key's own page against the bytes, and this is only its nominal size."""
    blocks = capacity_bytes // max(pages)
    if blocks < 1:
        raise ReplayError(f"{capacity_bytes} bytes hold no block of {max(pages)} bytes")
    return blocks

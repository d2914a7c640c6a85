"""Sizes for the what-if: the groups' page sizes and the blocks a byte capacity
holds (byte counts a user types are parsed by ``replay.cli.options``)."""

from __future__ import annotations

from collections.abc import Sequence

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig

#: The largest page a group's block may take (1 TiB): a size beyond it is a typo.
MAX_PAGE_BYTES = 1 << 40


def page_sizes(config: TraceConfig, page_bytes: Sequence[int] | None) -> tuple[int, ...]:
    """Per group, the bytes of one block (all of its layers): ``--page-bytes``
    (one size for every group, or one per group, parsed by the command
    line), else the trace's ``source.page_bytes`` (an integer, or one per
    group)."""
    if page_bytes is None:
        source = config.source or {}
        given = source.get("page_bytes")
        if given is None:
            raise ReplayError(
                "--capacity-bytes needs the groups' page sizes: give --page-bytes "
                "(e.g. 2MiB, or one size per group: 2MiB,512KiB)"
            )
        parts = given if isinstance(given, list) else [given]
        for part in parts:
            if type(part) is not int or not 1 <= part <= MAX_PAGE_BYTES:
                raise ReplayError(
                    f"source.page_bytes {part!r}: expected a whole number of bytes from 1 "
                    f"to {MAX_PAGE_BYTES} (or give --page-bytes)"
                )
        page_bytes = parts
    sizes = list(page_bytes)
    if any(not 1 <= size <= MAX_PAGE_BYTES for size in sizes):
        raise ReplayError(f"--page-bytes: a page is at most {MAX_PAGE_BYTES} bytes (1TiB)")
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

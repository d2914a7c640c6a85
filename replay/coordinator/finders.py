"""Per-kind hit finders, one per KV-cache group kind (vLLM 0.33.0's
``single_type_kv_cache_manager``), behind a registry keyed by ``GroupKind``.

Every finder is a pure function of the request's hashes (``hash_block_size``
granular), a membership test for the spec group's keys, the bound
(``max_length``), the EAGLE drop flag and the hit alignment. It returns the
shape of the group's load mask (skipped blocks, then loaded ones) and the
hit length. Membership is probed in bulk with ``map(contains, ...)`` so the
common single-group case runs at C speed over a Python set.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from replay.spec import GroupKind, GroupSpec

Contains = Callable[[Any], bool]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class FinderResult:
    """A group's answer: ``null_blocks`` skipped blocks, then ``loaded_blocks``
    loaded ones; ``hit_tokens`` after the EAGLE drop and re-alignment;
    ``matched_tokens`` before them (what ``replay explain`` shows)."""

    null_blocks: int
    loaded_blocks: int
    hit_tokens: int
    matched_tokens: int

    @property
    def mask_blocks(self) -> int:
        return self.null_blocks + self.loaded_blocks


class Finder(Protocol):
    #: Whether the finder can land a hit on a hash unit inside a block
    #: (vLLM's ``supports_fine_grained_hash_lookup``).
    fine_grained: bool

    def __call__(
        self,
        spec: GroupSpec,
        hashes: Sequence[Hashable],
        contains: Contains,
        *,
        max_length: int,
        drop_eagle: bool,
        alignment: int,
        hash_block_size: int,
    ) -> FinderResult: ...


def block_view(
    hashes: Sequence[Hashable], hash_block_size: int, block_size: int
) -> Sequence[Hashable]:
    """The group's per-block hashes: the last hash unit inside each block names
    the block, since every unit is chained over its whole prefix."""
    k = block_size // hash_block_size
    if k == 1:
        return hashes
    return hashes[k - 1 :: k]


def _uses_fine_view(fine_grained: bool, block_size: int, alignment: int) -> bool:
    return fine_grained and alignment < block_size and block_size % alignment == 0


def _stack(fn: Callable[..., FinderResult], fine_grained: bool) -> Finder:
    fn.fine_grained = fine_grained  # type: ignore[attr-defined]
    return fn  # type: ignore[return-value]


def _present_prefix(view: Sequence[Hashable], contains: Contains, limit: int) -> int:
    """How many blocks from the left are present, up to ``limit``. Chained
    hashes make the first miss the end of any hit."""
    probes = list(map(contains, view[:limit]))
    try:
        return probes.index(False)
    except ValueError:
        return len(probes)


def full_attention(
    spec: GroupSpec,
    hashes: Sequence[Hashable],
    contains: Contains,
    *,
    max_length: int,
    drop_eagle: bool,
    alignment: int,
    hash_block_size: int,
) -> FinderResult:
    bs = spec.block_size
    view = block_view(hashes, hash_block_size, bs)
    blocks = _present_prefix(view, contains, max_length // bs)
    hit = blocks * bs
    if _uses_fine_view(True, bs, alignment):
        # Extend into the first incomplete block: its interior hash-unit
        # boundaries, longest first.
        scale = bs // alignment
        first = blocks * scale
        last = min(first + scale - 1, max_length // alignment, len(hashes))
        for unit in range(last - 1, first - 1, -1):
            if contains(hashes[unit]):
                blocks += 1
                hit = (unit + 1) * alignment
                break
    matched = hit
    if drop_eagle and hit > 0:
        # EAGLE recomputes the tokens before the generation point: one hash
        # unit when fine-grained (the tail block stays valid), else one block.
        hit -= min(alignment, bs)
    hit -= hit % alignment
    return FinderResult(0, min(blocks, cdiv(hit, bs)), hit, matched)


def sliding_window(
    spec: GroupSpec,
    hashes: Sequence[Hashable],
    contains: Contains,
    *,
    max_length: int,
    drop_eagle: bool,
    alignment: int,
    hash_block_size: int,
) -> FinderResult:
    bs = spec.block_size
    window = spec.coverage_window or 0
    view = block_view(hashes, hash_block_size, bs)
    # The window needs this many contiguous blocks ending at the hit; with the
    # EAGLE drop one more, since the last matched block is popped afterwards.
    need = cdiv(window - 1, bs) + (1 if drop_eagle else 0)
    max_blocks = max_length // bs
    probes = list(map(contains, view[:max_blocks]))
    probes.extend([False] * (max_blocks - len(probes)))
    run = 0
    length = -1
    nulls = 0
    for i in range(max_blocks - 1, -1, -1):
        if probes[i]:
            # A run may only end where the length after the EAGLE pop is aligned.
            if run == 0 and bs != alignment:
                post_pop = i if drop_eagle else i + 1
                if (post_pop * bs) % alignment:
                    continue
            run += 1
            if run >= need:
                nulls, length = i, i + run
                break
        else:
            run = 0
    if length < 0:
        # No full window: the run that starts at block 0 is still a hit.
        nulls, length = 0, run
        if bs != alignment:
            while (length * bs) % alignment:
                length -= 1
    matched = length * bs
    if drop_eagle and length > 0:
        length -= 1
        if bs != alignment:
            while (length * bs) % alignment:
                length -= 1
    return FinderResult(min(nulls, length), max(0, length - nulls), length * bs, matched)


def chunked_local_attention(
    spec: GroupSpec,
    hashes: Sequence[Hashable],
    contains: Contains,
    *,
    max_length: int,
    drop_eagle: bool,
    alignment: int,
    hash_block_size: int,
) -> FinderResult:
    bs = spec.block_size
    chunk = spec.attention_chunk_size or bs
    view = block_view(hashes, hash_block_size, bs)
    max_blocks = max_length // bs
    # Blocks before the chunk that holds max_length are outside every window.
    start_tokens = max_length // chunk * chunk if max_length > 0 else 0
    start = start_tokens // bs
    loaded = _present_prefix(view[start:], contains, max(0, max_blocks - start))
    hit = (start + loaded) * bs
    return FinderResult(start, loaded, hit, hit)


def mamba(
    spec: GroupSpec,
    hashes: Sequence[Hashable],
    contains: Contains,
    *,
    max_length: int,
    drop_eagle: bool,
    alignment: int,
    hash_block_size: int,
) -> FinderResult:
    # drop_eagle is ignored on purpose: the state at block p is the state after
    # (p + 1) * block_size tokens, there is nothing to recompute (#43559).
    bs = spec.block_size
    if _uses_fine_view(True, bs, alignment):
        scale = bs // alignment
        units = min(max_length // alignment, len(hashes))
        probes = list(map(contains, hashes[:units]))
        try:
            unit = units - 1 - probes[::-1].index(True)
        except ValueError:
            return FinderResult(0, 0, 0, 0)
        hit = (unit + 1) * alignment
        return FinderResult(unit // scale, 1, hit, hit)
    view = block_view(hashes, hash_block_size, bs)
    max_blocks = min(max_length // bs, len(view))
    # Only blocks whose end is aligned can hold a resumable state.
    step = alignment // bs if alignment % bs == 0 else 0
    if step <= 1 or bs == alignment:
        candidates = range(max_blocks - 1, -1, -1)
    else:
        top = (max_blocks // step) * step - 1
        candidates = range(top, -1, -step)
    for i in candidates:
        if contains(view[i]):
            hit = (i + 1) * bs
            return FinderResult(i, 1, hit, hit)
    return FinderResult(0, 0, 0, 0)


FINDERS: dict[GroupKind, Finder] = {
    GroupKind.FULL_ATTENTION: _stack(full_attention, True),
    GroupKind.SLIDING_WINDOW: _stack(sliding_window, False),
    GroupKind.CHUNKED_LOCAL_ATTENTION: _stack(chunked_local_attention, False),
    GroupKind.MAMBA: _stack(mamba, True),
}


def eagle_margin(spec: GroupSpec, hash_block_size: int, fine_lookup: bool) -> int:
    """Tokens an EAGLE group may match past the candidate before dropping:
    one hash unit for fine-grained finders, else one block."""
    if fine_lookup and spec.block_size > hash_block_size:
        return hash_block_size
    return spec.block_size

"""Per-kind hit finders, one per KV-cache group kind (vLLM 0.33.0's
``single_type_kv_cache_manager``), behind a registry keyed by ``GroupKind``.

Every finder is a pure function of the spec group's *presence bytes* (byte
``u`` is 1 when every member group holds a key for the request's hash unit
``u``, 0 otherwise; units are ``hash_block_size`` tokens), the bound
(``max_length``), the EAGLE drop flag and the hit alignment. It returns the
shape of the group's load mask (skipped blocks, then loaded ones) and the hit
length. Bytes let the scans run as ``find`` / ``rfind`` at C speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from replay.base.spec import GroupKind, GroupSpec


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Query:
    """What a finder is asked: the bound, whether the group drops a block for
    EAGLE, the hit alignment and the hash unit, in tokens."""

    max_length: int
    drop_eagle: bool
    alignment: int
    hash_block_size: int
    #: The sliding window's run may end where the length *before* the EAGLE
    #: pop is aligned (vLLM before 0.20.0); from 0.20.0, after the pop.
    align_run_before_pop: bool = False


class Finder(Protocol):
    #: Whether the finder can land a hit on a hash unit inside a block
    #: (vLLM's ``supports_fine_grained_hash_lookup``).
    fine_grained: bool

    def __call__(self, spec: GroupSpec, present: bytes, q: Query) -> FinderResult: ...


def block_view(present: bytes, hash_block_size: int, block_size: int) -> bytes:
    """The group's per-block presence: the last hash unit inside each block
    names the block, since every unit is chained over its whole prefix."""
    k = block_size // hash_block_size
    return present if k == 1 else present[k - 1 :: k]


def _fine_view(fine_grained: bool, block_size: int, alignment: int) -> bool:
    return fine_grained and alignment < block_size and block_size % alignment == 0


def _prefix(view: bytes, limit: int) -> int:
    """Present blocks from the left, up to ``limit``: chained hashes make the
    first miss the end of any hit."""
    head = view[:limit]
    miss = head.find(0)
    return len(head) if miss < 0 else miss


def full_attention(spec: GroupSpec, present: bytes, q: Query) -> FinderResult:
    max_length, drop_eagle, alignment = q.max_length, q.drop_eagle, q.alignment
    bs = spec.block_size
    blocks = _prefix(block_view(present, q.hash_block_size, bs), max_length // bs)
    hit = blocks * bs
    if _fine_view(True, bs, alignment):
        # Extend into the first incomplete block: its interior hash-unit
        # boundaries, longest first.
        scale = bs // alignment
        first = blocks * scale
        last = min(first + scale - 1, max_length // alignment, len(present))
        unit = present.rfind(1, first, last) if last > first else -1
        if unit >= 0:
            blocks += 1
            hit = (unit + 1) * alignment
    matched = hit
    if drop_eagle and hit > 0:
        # EAGLE recomputes the tokens before the generation point: one hash
        # unit when fine-grained (the tail block stays valid), else one block.
        hit -= min(alignment, bs)
    hit -= hit % alignment
    return FinderResult(0, min(blocks, cdiv(hit, bs)), hit, matched)


def sliding_window(spec: GroupSpec, present: bytes, q: Query) -> FinderResult:
    max_length, drop_eagle, alignment = q.max_length, q.drop_eagle, q.alignment
    bs = spec.block_size
    # The bare window: the mirror's widening is already in the spec it passes
    # (``hybrid.lookup_spec``); the engine's finder has none.
    window = spec.sliding_window or 0
    view = block_view(present, q.hash_block_size, bs)
    # The window needs this many contiguous blocks ending at the hit; with the
    # EAGLE drop one more, since the last matched block is popped afterwards.
    need = cdiv(window - 1, bs) + (1 if drop_eagle else 0)
    max_blocks = max_length // bs
    probes = view[:max_blocks]
    run = 0
    length = -1
    nulls = 0
    for i in range(min(max_blocks, len(probes)) - 1, -1, -1):
        if probes[i]:
            # A run may only end where the length after the EAGLE pop is aligned.
            if run == 0 and bs != alignment:
                post_pop = i if drop_eagle and not q.align_run_before_pop else i + 1
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


def chunked_local_attention(spec: GroupSpec, present: bytes, q: Query) -> FinderResult:
    max_length = q.max_length
    bs = spec.block_size
    chunk = spec.attention_chunk_size or bs
    view = block_view(present, q.hash_block_size, bs)
    max_blocks = max_length // bs
    # Blocks before the chunk that holds max_length are outside every window.
    start = (max_length // chunk * chunk if max_length > 0 else 0) // bs
    loaded = _prefix(view[start:], max(0, max_blocks - start))
    hit = (start + loaded) * bs
    return FinderResult(start, loaded, hit, hit)


def mamba(spec: GroupSpec, present: bytes, q: Query) -> FinderResult:
    max_length, alignment = q.max_length, q.alignment
    # drop_eagle is ignored on purpose: the state at block p is the state after
    # (p + 1) * block_size tokens, there is nothing to recompute (#43559).
    bs = spec.block_size
    if _fine_view(True, bs, alignment):
        unit = present.rfind(1, 0, min(max_length // alignment, len(present)))
        if unit < 0:
            return FinderResult(0, 0, 0, 0)
        hit = (unit + 1) * alignment
        return FinderResult(unit // (bs // alignment), 1, hit, hit)
    view = block_view(present, q.hash_block_size, bs)
    max_blocks = min(max_length // bs, len(view))
    # Only blocks whose end is aligned can hold a resumable state: every
    # step-th block (alignment is a multiple of the block size here).
    step = max(1, alignment // bs)
    r = view[step - 1 : max_blocks : step].rfind(1)
    if r < 0:
        return FinderResult(0, 0, 0, 0)
    i = step - 1 + r * step
    hit = (i + 1) * bs
    return FinderResult(i, 1, hit, hit)


def _registered(fn: Callable[..., FinderResult], fine_grained: bool) -> Finder:
    fn.fine_grained = fine_grained  # type: ignore[attr-defined]
    return fn  # type: ignore[return-value]


FINDERS: dict[GroupKind, Finder] = {
    GroupKind.FULL_ATTENTION: _registered(full_attention, True),
    GroupKind.SLIDING_WINDOW: _registered(sliding_window, False),
    GroupKind.CHUNKED_LOCAL_ATTENTION: _registered(chunked_local_attention, False),
    GroupKind.MAMBA: _registered(mamba, True),
}


def eagle_margin(spec: GroupSpec, hash_block_size: int, fine_lookup: bool) -> int:
    """Tokens an EAGLE group may match past the candidate before dropping:
    one hash unit for fine-grained finders, else one block."""
    if fine_lookup and spec.block_size > hash_block_size:
        return hash_block_size
    return spec.block_size


def window_tail(window: int, block_size: int, eagle: bool) -> tuple[int, int]:
    """The contiguous blocks a sliding window's hit needs at a boundary and
    how far the run's right edge sits past it (``need``, ``shift``): the
    window's blocks, one more and one block on under EAGLE (its peek),
    as ``SlidingWindowManager.reachable_block_mask`` counts them."""
    need = cdiv(window - 1, block_size) + (1 if eagle else 0)
    return need, 1 if eagle else 0

"""vLLM 0.33.0's GPU block pool, one request at a time, for what-if sweeps.

The model follows ``vllm/v1/core/block_pool.py`` (``BlockPool``),
``kv_cache_utils.py`` (``FreeKVCacheBlockQueue``) and the per-kind managers
of ``single_type_kv_cache_manager.py`` as ``KVCacheManager.allocate_slots``
drives them chunk by chunk:

* One pool shared by every KV-cache group; block 0 is the null block, so a
  pool of ``capacity`` allocatable blocks is vLLM's ``num_gpu_blocks =
  capacity + 1``. A key is a group id and a hash; several blocks may hold one
  key (a recomputed block whose key is already cached), a hit takes the first
  copy, and the key goes only with its last copy.
* The free queue: a freed block without a hash goes to the front, never-used
  blocks come next, a freed cached block goes to the tail; allocation pops
  the front and strips a popped block's hash. So the queue is always the
  unhashed blocks followed by the cached ones, and a cached block is evicted
  only when no unhashed block is left. Under ``lru`` the cached part is in
  free order, exactly vLLM's; ``fifo``, ``lfu`` and ``belady`` reorder only
  that part (same blocks, same pool, another victim).
* Per chunk (``allocate_slots``): blocks below the sliding window and Mamba
  states below the computed position are freed first, the hit blocks are
  touched (first chunk), new blocks are allocated group by group, then the
  full blocks are hashed as the store rules say (``replay.rules.store_rules``,
  ``gpu`` cache: the ``BlockStored`` set); a finished request frees group by
  group in group-id order, each table in reverse.
* Admission as with one request running and ``scheduler_reserve_full_isl``
  (vLLM's default): the whole prompt must fit the free blocks, counted as
  ``get_num_blocks_to_allocate`` counts them; a request that never fits is
  never scheduled (``admitted`` False, no hit, no stores).

Assumptions (the what-if's, stated in ``replay whatif --help``): requests run
alone, prefill only (no decode blocks, no lookahead slots), vLLM's
``max_in_flight_tokens`` is one batch, ``num_speculative_blocks`` is 0, every
block one hash unit (so no partial hash hits and no sub-block tail entries),
no chunked-local groups. A request that runs out of blocks after admission
is preempted (freed) and not retried. Pure Python: no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from replay.base.errors import ConfigError, ReplayError
from replay.base.spec import GroupKind, TraceConfig
from replay.rules.coordinator import Coordinator, LookupOutcome, Policy
from replay.rules.coordinator.finders import block_view, cdiv
from replay.rules.eviction import NEVER, EvictionOrder
from replay.rules.store_rules import StoreRules, StoreSettings, junction_tokens

#: A key appears (first copy) or vanishes (last copy): (kind, group, hash).
KeyListener = Callable[[str, int, Hashable], None]


class BlockPool:
    """vLLM's ``BlockPool`` with prefix caching on (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        num_groups: int,
        order: EvictionOrder,
        on_key: KeyListener | None = None,
    ) -> None:
        if capacity < 1:
            raise ReplayError(f"capacity must be at least one block, got {capacity}")
        n = capacity + 1
        self.capacity = capacity
        self._key: list[Hashable | None] = [None] * n
        self._group = [0] * n
        self.ref = [0] * n
        self.copies: list[dict[Hashable, list[int]]] = [{} for _ in range(num_groups)]
        # Block 0 is the null block: never queued, never freed.
        self._unhashed: deque[int] = deque(range(1, n))
        self.cached = order
        self.on_key = on_key
        self.evicted_blocks = 0

    def num_free(self) -> int:
        return len(self._unhashed) + len(self.cached)

    def key(self, block: int) -> Hashable | None:
        return self._key[block]

    def first_copy(self, group_id: int, block_hash: Hashable) -> int:
        return self.copies[group_id][block_hash][0]

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free():
            raise ReplayError(f"cannot get {count} free blocks from the pool")
        out: list[int] = []
        for _ in range(count):
            block = self._unhashed.popleft() if self._unhashed else self.cached.pop()
            if self._key[block] is not None:
                self._strip(block)
            self.ref[block] = 1
            out.append(block)
        return out

    def _strip(self, block: int) -> None:
        h, g = self._key[block], self._group[block]
        assert h is not None
        self._key[block] = None
        self.evicted_blocks += 1
        holders = self.copies[g][h]
        holders.remove(block)
        if not holders:
            del self.copies[g][h]
            if self.on_key is not None:
                self.on_key("remove", g, h)

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if block == 0:
                continue
            if self.ref[block] == 0:
                self.cached.discard(block)
            self.ref[block] += 1
            self.cached.used(block)

    def free(self, ordered: Iterable[int]) -> None:
        """``BlockPool.free_blocks``: ``ordered`` first-to-evict first."""
        front: list[int] = []
        tail: list[int] = []
        for block in ordered:
            if block == 0:
                continue
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (front if self._key[block] is None else tail).append(block)
        self._unhashed.extendleft(reversed(front))
        for block in tail:
            self.cached.add(block)

    def cache(self, block: int, group_id: int, block_hash: Hashable) -> None:
        assert self._key[block] is None and block != 0
        self._key[block] = block_hash
        self._group[block] = group_id
        holders = self.copies[group_id].setdefault(block_hash, [])
        holders.append(block)
        self.cached.reset(block)
        if len(holders) == 1 and self.on_key is not None:
            self.on_key("store", group_id, block_hash)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    hit_tokens: int
    outcome: LookupOutcome
    #: what the lookup saw: per group, a byte per hash unit (1 = key held)
    present: list[bytes]
    #: False: the prompt never fits the pool, so vLLM never schedules it.
    admitted: bool
    #: False: admitted, but a later chunk found too few free blocks (vLLM
    #: undercounts a Mamba state copy at admission): vLLM preempts it, which
    #: frees it; the what-if does not retry it.
    completed: bool = True


@dataclass(slots=True)
class _Table:
    """One group's block table for the running request (0 = null block)."""

    blocks: list[int]
    cached: int = 0
    # Mamba align mode only
    last_state: int | None = None
    retired: int = 0


class GpuCache:
    """The engine's prefix cache over a ``BlockPool``: per request, the hit
    from the project's exact ``gpu`` coordinator over the pool's keys, then
    the prefill's allocations, hashes and frees as vLLM makes them."""

    def __init__(
        self,
        config: TraceConfig,
        capacity: int,
        *,
        policy: str | Policy = "vllm-0.33",
        eviction: str = "lru",
        store_settings: StoreSettings | None = None,
        next_use: Callable[[Hashable, int], int] | None = None,
        on_key: KeyListener | None = None,
        max_model_len: int = 1 << 20,
    ) -> None:
        for gid, g in enumerate(config.groups):
            if g.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
                raise ConfigError(
                    f"kv_cache_groups[{gid}]: the GPU block-pool model does not cover "
                    "chunked_local_attention groups"
                )
            if g.block_size != config.hash_block_size:
                # vLLM then also keys a prompt's sub-block tail, which changes
                # where the block goes when freed; not modelled.
                raise ConfigError(
                    f"kv_cache_groups[{gid}]: the GPU block-pool model needs block_size "
                    f"{g.block_size} equal to hash_block_size {config.hash_block_size}"
                )
        sp = store_settings or StoreSettings(cache="gpu")
        if sp.cache != "gpu":
            raise ReplayError("the GPU block pool caches by the gpu store rules")
        free_order = sp.stores.free_order
        if free_order != "unhashed-front":
            # The model keeps the unhashed blocks apart from the cached ones;
            # before 0.24 a freed unhashed block could sit among cached ones.
            raise ConfigError(
                f"the GPU block-pool model covers vLLM 0.24 and later (policy {sp.policy} "
                f"frees blocks {free_order.replace('-', ' ')}, not unhashed first): use "
                "`cache` mooncake or a newer release"
            )
        self.config = config
        self.rules = StoreRules(config, sp)
        self.coordinator = Coordinator(config, policy, "gpu")
        self.max_model_len = max_model_len
        self.in_flight = sp.max_num_batched_tokens
        keyed_next_use = None
        if next_use is not None:
            # Belady asks about a block; the future is the block's key's.
            def keyed_next_use(block: int, now: int) -> int:
                h = self.pool.key(block)
                return NEVER if h is None else next_use(h, now)

        self.pool = BlockPool(
            capacity, config.num_groups, EvictionOrder(eviction, keyed_next_use), on_key
        )
        self._hbs = config.hash_block_size

    # -- the per-kind rules

    def _skipped_tokens(self, gid: int, computed: int) -> int:
        g = self.config.groups[gid]
        if g.kind is GroupKind.SLIDING_WINDOW:
            assert g.sliding_window is not None
            return max(0, computed - g.sliding_window + 1 - g.extra_retained_tokens)
        if g.kind is GroupKind.MAMBA:
            return computed - 1
        return 0

    def _admission_blocks(self, num_tokens: int, hit: int, hit_blocks: Sequence[list[int]]) -> int:
        """``get_num_blocks_to_allocate`` for the whole prompt, admission cap on."""
        ref = self.pool.ref
        total = 0
        for gid, g in enumerate(self.config.groups):
            new_computed = hit_blocks[gid]
            required = cdiv(num_tokens, g.block_size)
            if g.kind is GroupKind.MAMBA:
                new = required - len(new_computed)
                total += min(new, 1) if new > 0 else 0
                total += sum(1 for b in new_computed if b and ref[b] == 0)
                continue
            if g.kind is GroupKind.SLIDING_WINDOW:
                assert g.sliding_window is not None
                window = g.sliding_window - 1 + g.extra_retained_tokens + self.in_flight
                cap = cdiv(min(window, self.max_model_len), g.block_size) + 1
                required = min(required, cap)
            skipped = self._skipped_tokens(gid, hit) // g.block_size
            total += max(required - max(skipped, len(new_computed)), 0)
            total += sum(1 for b in new_computed[skipped:] if b and ref[b] == 0)
        return total

    def _running_blocks(self, tables: Sequence[_Table], tokens: int) -> int:
        """``get_num_blocks_to_allocate`` for a running request's next chunk."""
        total = 0
        for g, table in zip(self.config.groups, tables, strict=True):
            new = cdiv(tokens, g.block_size) - len(table.blocks)
            if new > 0:
                total += 1 if g.kind is GroupKind.MAMBA else new
        return total

    def _remove_skipped(self, gid: int, table: _Table, computed: int) -> None:
        g = self.config.groups[gid]
        blocks, pool = table.blocks, self.pool
        skipped = self._skipped_tokens(gid, computed)
        if g.kind is GroupKind.MAMBA:
            if skipped > 0:
                last = min(skipped // g.block_size, len(blocks))
                first = max(0, table.retired)
                if first < last:
                    freed = []
                    for i in range(last - 1, first - 1, -1):
                        if blocks[i]:
                            freed.append(blocks[i])
                            blocks[i] = 0
                    pool.free(freed)
                    table.retired = last
            idx = table.last_state
            if idx is not None and idx < cdiv(computed, g.block_size) - 1 and blocks[idx]:
                pool.free([blocks[idx]])
                blocks[idx] = 0
            return
        if skipped <= 0:
            return
        last = min(skipped // g.block_size, len(blocks))
        freed = []
        for i in range(last - 1, -1, -1):
            if not blocks[i]:
                break
            freed.append(blocks[i])
            blocks[i] = 0
        if freed:
            pool.free(freed)

    def _add_hit(self, gid: int, table: _Table, hit: int, new_computed: list[int]) -> None:
        bs = self.config.groups[gid].block_size
        skipped = self._skipped_tokens(gid, hit) // bs
        if skipped > 0:
            new_computed = new_computed[skipped:]
        self.pool.touch(new_computed)
        table.blocks.extend([0] * skipped)
        table.blocks.extend(new_computed)
        table.cached = len(table.blocks)

    def _allocate(self, gid: int, table: _Table, tokens: int) -> None:
        g = self.config.groups[gid]
        blocks = table.blocks
        required = cdiv(tokens, g.block_size)
        if g.kind is not GroupKind.MAMBA:
            if required > len(blocks):
                blocks.extend(self.pool.allocate(required - len(blocks)))
            return
        if required <= len(blocks):
            return
        prev = len(blocks)
        if prev > 0:
            # The running state (or, on the first chunk, the hit's) is copied
            # into the new block and freed at the next chunk.
            table.last_state = prev - 1
        if prev < required - 1:
            blocks.extend([0] * (required - 1 - prev))
        blocks.extend(self.pool.allocate(required - len(blocks)))

    def _cache(
        self,
        gid: int,
        table: _Table,
        tokens: int,
        hashed: int,
        stored: frozenset[int],
        keys: Sequence[Hashable],
    ) -> None:
        bs = self.config.groups[gid].block_size
        full = min(self.rules.cacheable_tokens(self.rules.groups[gid], tokens), hashed) // bs
        if table.cached >= full:
            return
        for i in range(table.cached, full):
            block = table.blocks[i]
            if block and i in stored and self.pool.key(block) is None:
                self.pool.cache(block, gid, keys[i])
        table.cached = full

    # -- one request

    def present(self, unit_hashes: Sequence[Hashable]) -> list[bytes]:
        copies = self.pool.copies
        return [bytes(h in c for h in unit_hashes) for c in copies]

    def request(
        self, unit_hashes: Sequence[Hashable], num_tokens: int, max_length: int, now: int = 0
    ) -> RequestResult:
        """Look the prompt up, prefill it chunk by chunk, free it."""
        config, pool = self.config, self.pool
        pool.cached.now = now
        present = self.present(unit_hashes)
        outcome = self.coordinator.lookup_present(
            present, max_length, explain=self.rules.uses_junction
        )
        hit = outcome.hit_tokens
        views = [
            block_view(unit_hashes, self._hbs, g.block_size)  # type: ignore[arg-type]
            for g in config.groups
        ]
        if pool.cached.eviction == "belady":
            for gid, view in enumerate(views):
                copies = pool.copies[gid]
                for h in view:
                    for block in copies.get(h, ()):
                        pool.cached.refile(block)
        hit_blocks: list[list[int]] = []
        for gid, go in enumerate(outcome.groups):
            nulls = go.mask_blocks - go.loaded_blocks
            row = [0] * nulls
            row.extend(pool.first_copy(gid, views[gid][i]) for i in range(nulls, go.mask_blocks))
            hit_blocks.append(row)
        if self._admission_blocks(num_tokens, hit, hit_blocks) > pool.num_free():
            return RequestResult(hit_tokens=0, outcome=outcome, present=present, admitted=False)
        junction = junction_tokens(outcome) if self.rules.uses_junction else 0
        stores = self.rules.stores(num_tokens=num_tokens, hit_tokens=hit, junction_tokens=junction)
        stored = [frozenset(int(i) for i in s) for s in stores]
        hashed = len(unit_hashes) * self._hbs
        tables = [_Table([]) for _ in config.groups]
        start = hit
        for end in self.rules.chunk_ends(num_tokens, hit, junction):
            for gid, table in enumerate(tables):
                self._remove_skipped(gid, table, start)
            if start != hit and self._running_blocks(tables, end) > pool.num_free():
                for table in tables:
                    pool.free(reversed(table.blocks))
                return RequestResult(
                    hit_tokens=0, outcome=outcome, present=present, admitted=True, completed=False
                )
            if start == hit:
                for gid, table in enumerate(tables):
                    self._add_hit(gid, table, hit, hit_blocks[gid])
            for gid, table in enumerate(tables):
                self._allocate(gid, table, end)
            for gid, table in enumerate(tables):
                self._cache(gid, table, end, hashed, stored[gid], views[gid])
            start = end
        for table in tables:
            pool.free(reversed(table.blocks))
        return RequestResult(hit_tokens=hit, outcome=outcome, present=present, admitted=True)

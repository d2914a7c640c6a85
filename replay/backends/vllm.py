"""vLLM 0.33.0's own coordinator behind the reference ``Coordinator``'s interface.

``VllmCoordinator`` builds real vLLM spec objects for a trace's groups and a
``MooncakeStoreCoordinator`` over them, and answers each lookup with that
coordinator's ``find_longest_cache_hit`` against an ``ExternalCachedBlockPool``.
It is the oracle the reference is checked against (``make test-vllm``) and a
``replay run --coordinator vllm`` backend. vLLM is imported when one is built,
never when this module is imported.

Two things are observed rather than recomputed, so they are vLLM's answers:
the per-group load masks (checked to be skipped-then-loaded, the shape the
results format can hold) and each spec group's hit on its last finder call
(recorded by a pass-through wrapper around the group's manager class), which
gives ``GroupOutcome.hit_tokens`` and, for Mamba, ``state_tokens``.

Lookups run one at a time (a process-wide lock): policy ``pre-49502`` swaps
a module global of vLLM's coordinator during the call, and the recorded hits
live on the instance.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from replay.coordinator.hybrid import GroupOutcome, LookupOutcome
from replay.coordinator.policy import DEFAULT_POLICY, Policy, get_policy
from replay.errors import ReplayError
from replay.spec import GroupKind, GroupSpec, TraceConfig


def _missing_vllm(exc: ImportError) -> str:
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return (
        f"--coordinator vllm: vLLM does not import in this Python ({sys.executable}: {exc}); "
        "run the tool inside the Python that has vLLM 0.33, e.g. "
        f"`PYTHONPATH={root} /path/to/vllm-venv/bin/python -m replay ...` "
        "(or install vLLM here: `pip install vllm==0.33.0`)"
    )


_COORDINATOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator"

# Shapes and dtypes vLLM needs to build a spec; lookup never reads them, but
# equal trace specs must give equal vLLM specs so that groups merge as in vLLM.
_NUM_KV_HEADS = 8
_HEAD_SIZE = 128
_MAMBA_SHAPES = ((3, 4096), (32, 64, 128))

# Policy ``pre-49502`` patches a module global of vLLM's coordinator, so
# lookups (of either policy) run one at a time.
_GATE_LOCK = threading.Lock()


class _NotMamba:
    """Stands in for ``MambaSpec`` in vLLM's EAGLE-margin gate: nothing is an
    instance of it, so Mamba gets the peek margin as before #49502 (#43559)."""


class _KeyView:
    """The ``(group_id, hash)`` set an ``ExternalCachedBlockPool`` probes,
    answered by the caller's per-group membership tests instead of a copy
    of the store."""

    __slots__ = ("_contains",)

    def __init__(self, contains: Sequence[Callable[[Hashable], bool]]) -> None:
        self._contains = contains

    def __contains__(self, key: tuple[int, Hashable]) -> bool:
        group_id, block_hash = key
        return bool(self._contains[group_id](block_hash))


class _RecordingManager:
    """Pass-through to a vLLM manager class that records the hit length of
    each ``find_longest_cache_hit`` call for its spec group; the coordinator
    keeps these to itself (``_find_hit_blocks`` returns only the masks)."""

    def __init__(self, manager_cls: Any, index: int, sink: list[int]) -> None:
        self._manager_cls = manager_cls
        self._index = index
        self._sink = sink
        self.supports_fine_grained_hash_lookup = manager_cls.supports_fine_grained_hash_lookup

    def find_longest_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        blocks, hit_length = self._manager_cls.find_longest_cache_hit(*args, **kwargs)
        self._sink[self._index] = hit_length
        return blocks, hit_length


def _vllm_spec(group: GroupSpec, iface: Any, dtype: Any) -> Any:
    common: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": _NUM_KV_HEADS,
        "head_size": _HEAD_SIZE,
        "dtype": dtype,
    }
    if group.kind is GroupKind.FULL_ATTENTION:
        return iface.FullAttentionSpec(**common)
    if group.kind is GroupKind.SLIDING_WINDOW:
        return iface.SlidingWindowSpec(
            **common,
            sliding_window=group.sliding_window,
            extra_retained_tokens=group.extra_retained_tokens,
        )
    if group.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
        return iface.ChunkedLocalAttentionSpec(
            **common, attention_chunk_size=group.attention_chunk_size
        )
    return iface.MambaSpec(
        block_size=group.block_size,
        shapes=_MAMBA_SHAPES,
        dtypes=(dtype, dtype),
        mamba_cache_mode="align",
    )


class VllmCoordinator:
    """vLLM's ``MooncakeStoreCoordinator`` with the reference's ``lookup``."""

    name = "vllm"

    def __init__(self, config: TraceConfig, policy: str | Policy = DEFAULT_POLICY) -> None:
        self.config = config
        self.policy = get_policy(policy)
        try:
            # torch and vLLM warn about their own deprecations on import:
            # noise for someone replaying a trace.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                torch = importlib.import_module("torch")
                iface = importlib.import_module("vllm.v1.kv_cache_interface")
                module = importlib.import_module(_COORDINATOR_MODULE)
        except ImportError as exc:
            raise ReplayError(_missing_vllm(exc)) from None
        self._module: Any = module
        groups = [
            iface.KVCacheGroupSpec(
                layer_names=[g.name or f"model.layers.{gid}"],
                kv_cache_spec=_vllm_spec(g, iface, torch.bfloat16),
                is_eagle_group=g.is_eagle_group,
            )
            for gid, g in enumerate(config.groups)
        ]
        try:
            coordinator = module.MooncakeStoreCoordinator(
                groups,
                config.scheduler_block_size,
                config.hash_block_size,
                use_eagle=config.use_eagle,
                enable_partial_hash_hits=config.enable_partial_hash_hits,
            )
        except AssertionError as exc:
            raise ReplayError(f"vLLM rejects this KV-cache configuration: {exc}") from None
        # Record each spec group's last finder hit; the answers are unchanged.
        self._hits: list[int] = [0] * len(coordinator.attention_groups)
        coordinator.attention_groups = [
            group._replace(manager_cls=_RecordingManager(group.manager_cls, i, self._hits))
            for i, group in enumerate(coordinator.attention_groups)
        ]
        self._coordinator: Any = coordinator
        self._spec_group_of = [0] * config.num_groups
        for i, group in enumerate(coordinator.attention_groups):
            for gid in group.group_ids:
                self._spec_group_of[gid] = i

    def lookup(
        self,
        hashes: Sequence[Hashable],
        max_length: int,
        contains: Sequence[Callable[[Hashable], bool]],
        *,
        explain: bool = False,
    ) -> LookupOutcome:
        """``contains[g]`` tests whether group ``g`` holds a key for a hash.

        ``explain`` is accepted for interface parity; vLLM's fixed point
        exposes no steps, so the outcome has none.
        """
        hbs = self.config.hash_block_size
        if not 0 <= max_length < (len(hashes) + 1) * hbs:
            # Past this bound vLLM's finders index beyond the hash list.
            raise ReplayError(
                f"max_length {max_length} out of range for {len(hashes)} hashes of "
                f"{hbs} tokens: expected 0 <= max_length < {(len(hashes) + 1) * hbs}"
            )
        if not all(type(h) is bytes for h in hashes):
            # vLLM keys its pool by bytes(hash); fingerprints would all collide.
            raise ReplayError("the vllm coordinator needs the raw bytes block hashes (exact keys)")
        pool = self._module.ExternalCachedBlockPool(hbs, exists=_KeyView(contains))
        block_hashes = list(hashes)
        # Every lookup holds the lock: a default-policy lookup must never run
        # while another thread has the gate swapped out.
        with _GATE_LOCK:
            for i in range(len(self._hits)):
                self._hits[i] = 0
            if self.policy.mamba_peek_margin:
                saved = self._module.MambaSpec
                self._module.MambaSpec = _NotMamba
                try:
                    masks, hit = self._coordinator.find_longest_cache_hit(
                        block_hashes, max_length, pool
                    )
                finally:
                    self._module.MambaSpec = saved
            else:
                masks, hit = self._coordinator.find_longest_cache_hit(
                    block_hashes, max_length, pool
                )
            return LookupOutcome(hit_tokens=hit, groups=self._groups(masks))

    def _groups(self, masks: Sequence[list[bool]]) -> tuple[GroupOutcome, ...]:
        out = []
        for gid, mask in enumerate(masks):
            kind = self.config.groups[gid].kind
            loaded = sum(mask)
            skipped = len(mask) - loaded
            if mask != [False] * skipped + [True] * loaded:
                raise ReplayError(
                    f"vLLM returned a load mask for group {gid} ({kind.value}) that is "
                    f"not skipped-then-loaded: {''.join('1' if m else '0' for m in mask)}"
                )
            group_hit = self._hits[self._spec_group_of[gid]]
            out.append(
                GroupOutcome(
                    group_id=gid,
                    kind=kind,
                    mask_blocks=len(mask),
                    loaded_blocks=loaded,
                    hit_tokens=group_hit,
                    state_tokens=group_hit if kind is GroupKind.MAMBA else None,
                )
            )
        return tuple(out)

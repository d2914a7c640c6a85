"""The store side of each release policy: what a prefill leaves behind.

The lookup side of a release is a ``Cache`` per path (``policy.py``); the
store side is one ``Stores`` per release policy, read by
``replay.rules.store_rules.StoreRules``: the same code path for every
release, with these named rule fields deciding where releases differ. The
fields' defaults are vLLM 0.33.0's; a release range departs from the next
newer one by the fields that changed (read from the release wheels:
``single_type_kv_cache_manager.py``, ``kv_cache_coordinator.py``,
``sched/scheduler.py`` and the Mooncake store's ``coordinator.py``; see
docs/releases.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from replay.base.errors import ConfigError
from replay.rules.coordinator.policy import Policy, get_policy

#: Where ``prefix_cache_retention_interval`` comes from: ``none``: there is
#: no such setting (before vLLM 0.23.0: every sliding-window tail and Mamba
#: state is kept, i.e. dense); ``env``: the environment variable
#: ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` (0.23.0-0.28.0), unset meaning
#: dense and any value refused without a sliding-window (or, from 0.24, Mamba)
#: group; ``config``: the cache config's field (0.29.0 on), default 0.
RetentionSource = Literal["none", "env", "config"]

#: Where the block pool puts a freed block (``BlockPool.free_blocks``):
#: ``unhashed-front``: a block without a hash at the front (evicted first), a
#: cached one at the tail (0.24 on); ``sliding-window-front``: only the
#: sliding-window manager puts its uncached blocks at the front, every other
#: freed block goes to the tail (0.23.0); ``tail``: every freed block to the
#: tail in free order (before 0.23.0).
FreeOrder = Literal["unhashed-front", "sliding-window-front", "tail"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stores:
    #: Where the retention interval is set, and so its default (``RetentionSource``).
    retention: RetentionSource = "config"
    #: Mamba states honour the retention interval (``MambaManager.reachable_block_mask``,
    #: from 0.24); before, Mamba groups cache every state and only sliding
    #: windows are sparse.
    mamba_retention: bool = True
    #: With EAGLE the replay boundaries are one block below the resend's and
    #: the longer sibling's aligned hits (``replay_boundaries``, 0.30.0 on);
    #: before, the one boundary is ``num_prompt_tokens - 1``.
    eagle_replay_boundaries: bool = True
    #: The engine's replay boundaries are EAGLE's when any group is flagged,
    #: even with ``use_eagle`` off (``bool(eagle_group_ids)``, 0.30-0.32);
    #: 0.33.0 asks whether any group drops (``drop_eagle_group_ids``).
    boundaries_from_flags: bool = False
    #: Mamba states follow the flagged boundaries too (0.30-0.32).
    mamba_boundaries_from_flags: bool = False
    #: The Mooncake store's mask keeps EAGLE's replay boundaries (0.32.0 on);
    #: before, the one boundary ``N - 1``.
    mirror_eagle_replay_boundaries: bool = True
    #: The shared-prefix junction (``shared_prefix_boundary``, 0.26.0 on)
    #: ends a Mamba prefill chunk and pins an engine sliding-window tail.
    junction: bool = True
    #: An EAGLE group also keeps the tail one block below the junction (0.33.0).
    junction_eagle_block: bool = True
    #: The last Mamba state a prefill stops at is the reusable checkpoint
    #: below ``N - 1`` (``get_mamba_prefill_checkpoint_position``, 0.32.0 on),
    #: and the state at the same checkpoint in hash units is always kept
    #: (``_cache_partial_tail_block``; the stop's own when the hash unit is the
    #: block, in 0.33.0 a replay boundary anyway); before, the scheduler
    #: stopped at ``N`` floored to the block (one block lower with EAGLE).
    mamba_checkpoint: bool = True
    #: The engine's EAGLE groups cache one block past the aligned end (0.23.0
    #: on); before, every group cached up to the aligned end.
    eagle_cache_block: bool = True
    #: The Mooncake store gets Mamba states only through the boundary-state
    #: hand-offs (``take_boundary_state_offloads``, 0.29.0 on); before, Mamba
    #: groups were saved like attention groups, per the store mask (the
    #: Mamba manager's reachable mask past the hit, replay boundary only).
    mirror_mamba_handoffs: bool = True
    #: The Mooncake store's mask honours the retention interval (0.24 on);
    #: before, it kept every block a hit at any aligned length could read.
    mirror_retention: bool = True
    #: The engine's hybrid coordinator caches up to the hit alignment, and a
    #: sliding window only the tails a hit can read (0.22.0 on); before, every
    #: manager cached every full block of what was computed.
    aligned_cache: bool = True
    #: The GPU block pool's free order (``FreeOrder``).
    free_order: FreeOrder = "unhashed-front"

    def but(self, **changes: Any) -> Stores:
        return replace(self, **changes)

    @property
    def default_retention(self) -> int | None:
        """The retention interval a deployment of this release runs with
        unless told otherwise: 0 from 0.29.0, dense before."""
        return 0 if self.retention == "config" else None

    def check_retention(self, retention: int | None, sparse: bool, releases: str) -> None:
        """Refuse a retention interval this release could not be given."""
        if self.retention == "none" and retention is not None:
            raise ConfigError(
                f"vLLM {releases} has no prefix_cache_retention_interval (it came in "
                "0.23.0): every sliding-window tail and Mamba state is kept; use "
                "`retention_interval` none"
            )
        if self.retention == "env" and retention is not None and not sparse:
            raise ConfigError(
                f"vLLM {releases} refuses VLLM_PREFIX_CACHE_RETENTION_INTERVAL without a "
                "sliding-window or Mamba group: use `retention_interval` none (unset)"
            )


STORES_033 = Stores()
_S32 = STORES_033.but(
    junction_eagle_block=False, boundaries_from_flags=True, mamba_boundaries_from_flags=True
)
_S30 = _S32.but(mamba_checkpoint=False, mirror_eagle_replay_boundaries=False)
_S29 = _S30.but(eagle_replay_boundaries=False)
_S26 = _S29.but(retention="env", mirror_mamba_handoffs=False)
_S24 = _S26.but(junction=False)
# 0.23.0 looks up as 0.24-0.25 but kept every Mamba state whatever the
# interval, its store ignored the interval (the 0.22 mask), and only its
# sliding-window manager freed uncached blocks to the front, so the GPU pool
# model refuses it.
_S23 = _S24.but(mamba_retention=False, mirror_retention=False, free_order="sliding-window-front")
_S22 = _S23.but(retention="none", eagle_cache_block=False, free_order="tail")
_S16 = _S22.but(aligned_cache=False)

#: Each release policy's stores; an emulation (``pre-49502``, ``pre-32802``)
#: is 0.33.0's code and stores as 0.33.0 does.
RELEASE_STORES: dict[str, Stores] = {
    "vllm-0.16": _S16,
    "vllm-0.20": _S16,
    "vllm-0.22": _S22,
    "vllm-0.23": _S23,
    "vllm-0.24": _S24,
    "vllm-0.26": _S26,
    "vllm-0.27": _S26,
    "vllm-0.28": _S26,
    "vllm-0.29": _S29,
    "vllm-0.30": _S30,
    "vllm-0.32": _S32,
    "vllm-0.33": STORES_033,
    # 0.34.0 stores as 0.33.0 wherever the project models the stores (the
    # Mooncake store's decode saves, which 0.34.0 makes reusable for Mamba,
    # are not modelled).
    "vllm-0.34": STORES_033,
}


def policy_stores(policy: str | Policy, cache: str = "gpu") -> Stores:
    """The store rules of a policy's releases; an alias (``pre-49502``) takes
    those of the release it stands for in ``cache``, an emulation of 0.33.0
    with one lookup rule turned back (``vllm-0.33-no-mamba-gate``) 0.33.0's."""
    return RELEASE_STORES.get(get_policy(policy).release(cache).name, STORES_033)

"""vLLM 0.33.0's own coordinators behind the reference ``Coordinator``'s interface.

``VllmCoordinator`` builds real vLLM spec objects for a trace's groups and,
per cache, vLLM's own coordinator over them:

- ``mooncake``: a ``MooncakeStoreCoordinator``, answering each lookup with its
  ``find_longest_cache_hit`` against an ``ExternalCachedBlockPool``;
- ``gpu``: the engine's coordinator as ``get_kv_cache_coordinator`` builds it
  (``UnitaryKVCacheCoordinator`` for one group, ``HybridKVCacheCoordinator``
  otherwise) over a real ``BlockPool`` whose hash-to-block map holds, for
  the lookup, exactly the trace's present ``(hash, group)`` keys among the
  request's hashes (``BlockHashWithGroupId``; the finders probe no others).

It is the oracle the reference is checked against (``make test-vllm``) and a
``replay run --coordinator vllm`` backend. vLLM is imported when one is built,
never when this module is imported.

Two things are observed rather than recomputed, so they are vLLM's answers:
the per-group load masks (checked to be skipped-then-loaded, the shape the
results format can hold) and each spec group's hit on its last finder call
(recorded by a pass-through wrapper around the group's manager class), which
gives ``GroupOutcome.hit_tokens`` and, for Mamba, ``state_tokens``.

Lookups run one at a time (a process-wide lock): the older policies swap
module globals of vLLM's coordinator during the call, and the recorded hits
live on the instance. ``pre-49502`` hides ``MambaSpec`` from the margin gate;
``pre-32802`` makes ``eagle_proof_margin`` zero and forces the drop on every
finder call of an EAGLE spec group, as the loop did before #32802.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator.hybrid import (
    Contains,
    GroupOutcome,
    Hashes,
    LookupCoordinator,
    LookupOutcome,
)


class VllmUnavailable(ReplayError):
    """The installed vLLM cannot answer: it does not import, or its internal
    API moved (a module, class, function or parameter this backend needs is
    gone). One line naming what is missing; exit status 2."""


def _missing_vllm(exc: ImportError) -> str:
    import os
    import sys

    # The checkout that holds this package: replay/format/backends/vllm.py.
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    return (
        f"--coordinator vllm: vLLM does not import in this Python ({sys.executable}: {exc}); "
        "run the tool inside the Python that has vLLM, e.g. "
        f"`PYTHONPATH={root} /path/to/vllm-venv/bin/python -m replay ...` "
        "(or install vLLM here: `pip install 'cache-trace-replay[vllm]'`)"
    )


def installed_vllm_version() -> str:
    """The version of the vLLM distribution in this Python (a release, or a
    development build of vLLM's main branch installed editable), read from
    its metadata without importing vLLM."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        try:
            module = importlib.import_module("vllm")
        except ImportError as exc:
            raise VllmUnavailable(_missing_vllm(exc)) from None
        return str(getattr(module, "__version__", "unknown"))


def policy_for_vllm(version: str) -> str | None:
    """The project's policy that models vLLM ``version``; ``None`` when none
    does. The one place an installed version becomes a policy: 0.33.0 and
    anything later (a development build of main included) answer as
    ``vllm-0.33`` until a release changes the lookup and gets its policy.
    Releases 0.26 to 0.32 differ from every policy here in a few rules
    (``docs`` of the release map); older ones differ in the Mooncake mirror."""
    import re

    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return None
    major, minor = int(found.group(1)), int(found.group(2))
    if (major, minor) >= (0, 33):
        return "vllm-0.33"
    return None


def installed_policy() -> tuple[str | None, str]:
    """The policy that models the installed vLLM, and the reason (a template
    with ``{policy}``) to give for skipping an expectation of another one."""
    version = installed_vllm_version()
    policy = policy_for_vllm(version)
    if policy is None:
        return None, (
            f"policy {{policy}} is not checked: no policy of this project models "
            f"the installed vLLM {version}"
        )
    return policy, (
        f"policy {{policy}} is not checked: the installed vLLM {version} is modelled by "
        f"policy {policy}"
    )


def _require(owner: Any, name: str, where: str) -> Any:
    """``owner.name``, or the one-line error naming what the installed vLLM lacks."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise VllmUnavailable(
            f"--coordinator vllm: the installed vLLM {installed_vllm_version()} has no "
            f"`{where}.{name}` (its internal API moved; this backend needs it)"
        ) from None


def _call_known(function: Any, where: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call ``function`` with the keyword arguments its signature takes;
    a required parameter this backend does not know is the API having moved."""
    import inspect

    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return function(*args, **kwargs)
    positional = list(params.values())[: len(args)]
    rest = [p for p in params.values() if p not in positional]
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)
    for p in rest:
        required = p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and p.name not in kwargs:
            raise VllmUnavailable(
                f"--coordinator vllm: the installed vLLM {installed_vllm_version()}'s "
                f"`{where}` requires a parameter `{p.name}` this backend does not know "
                "(its internal API moved)"
            )
    if not accepts_any:
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return function(*args, **kwargs)


_COORDINATOR_MODULES = {
    "mooncake": "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator",
    "gpu": "vllm.v1.core.kv_cache_coordinator",
}
# The engine coordinator needs these to build its managers; lookups read none.
_MAX_MODEL_LEN = 1 << 22
_MAX_IN_FLIGHT_TOKENS = 8192
_POOL_BLOCKS = 16

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

    def __init__(
        self, manager_cls: Any, index: int, sink: list[int], eagle: bool, force: list[bool]
    ) -> None:
        self._manager_cls = manager_cls
        self._index = index
        self._sink = sink
        self._eagle = eagle
        self._force = force
        self.supports_fine_grained_hash_lookup = manager_cls.supports_fine_grained_hash_lookup

    def find_longest_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        if self._force[0] and self._eagle:
            # pre-32802: the drop on every call, not once per candidate.
            kwargs["drop_eagle_block"] = True
        blocks, hit_length = self._manager_cls.find_longest_cache_hit(*args, **kwargs)
        self._sink[self._index] = hit_length
        return blocks, hit_length


def _no_margin(block_size: int, hash_block_size: int, fine_grained_lookup: bool) -> int:
    """``eagle_proof_margin`` before #32802: the bound was the candidate."""
    return 0


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


def vllm_groups(config: TraceConfig, iface: Any, torch: Any) -> list[Any]:
    """vLLM ``KVCacheGroupSpec`` objects for a trace's groups, in group order
    (equal trace specs give equal vLLM specs, so groups merge as in vLLM)."""
    return [
        iface.KVCacheGroupSpec(
            layer_names=[g.name or f"model.layers.{gid}"],
            kv_cache_spec=_vllm_spec(g, iface, torch.bfloat16),
            is_eagle_group=g.is_eagle_group,
        )
        for gid, g in enumerate(config.groups)
    ]


def _vllm_module(name: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise VllmUnavailable(
                f"--coordinator vllm: the installed vLLM {installed_vllm_version()} has no "
                f"module `{exc.name}` (its internal API moved; this backend needs `{name}`)"
            ) from None
        raise VllmUnavailable(_missing_vllm(exc)) from None
    except ImportError as exc:
        raise VllmUnavailable(_missing_vllm(exc)) from None


def _probe(iface: Any, module: Any, utils: Any, cache: str) -> None:
    """Every name of vLLM's internal API this backend uses, checked before
    the first lookup: a moved one is one line naming it, not a traceback."""
    for name in (
        "KVCacheGroupSpec",
        "FullAttentionSpec",
        "SlidingWindowSpec",
        "ChunkedLocalAttentionSpec",
        "MambaSpec",
        "KVCacheConfig",
    ):
        _require(iface, name, "vllm.v1.kv_cache_interface")
    where = _COORDINATOR_MODULES[cache]
    if cache == "gpu":
        _require(module, "get_kv_cache_coordinator", where)
        _require(utils, "KVCacheBlock", "vllm.v1.core.kv_cache_utils")
        _require(utils, "make_block_hash_with_group_id", "vllm.v1.core.kv_cache_utils")
    else:
        _require(module, "MooncakeStoreCoordinator", where)
        _require(module, "ExternalCachedBlockPool", where)


class VllmCoordinator(LookupCoordinator):
    """vLLM's own coordinator for a cache, with the reference's ``lookup``."""

    name = "vllm"

    def _prepare(self) -> None:
        config = self.config
        try:
            # torch and vLLM warn about their own deprecations on import:
            # noise for someone replaying a trace.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                torch = importlib.import_module("torch")
                importlib.import_module("vllm")
        except ImportError as exc:
            raise VllmUnavailable(_missing_vllm(exc)) from None
        iface, module, utils = (
            _vllm_module(name)
            for name in (
                "vllm.v1.kv_cache_interface",
                _COORDINATOR_MODULES[self.cache.name],
                "vllm.v1.core.kv_cache_utils",
            )
        )
        _probe(iface, module, utils, self.cache.name)
        self._module: Any = module
        self._utils: Any = utils
        groups = vllm_groups(config, iface, torch)
        self._force = [False]
        try:
            if self.cache.name == "gpu":
                coordinator = _call_known(
                    module.get_kv_cache_coordinator,
                    f"{_COORDINATOR_MODULES['gpu']}.get_kv_cache_coordinator",
                    iface.KVCacheConfig(
                        num_blocks=_POOL_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
                    ),
                    max_model_len=_MAX_MODEL_LEN,
                    max_in_flight_tokens=_MAX_IN_FLIGHT_TOKENS,
                    use_eagle=config.use_eagle,
                    enable_caching=True,
                    enable_kv_cache_events=False,
                    dcp_world_size=1,
                    pcp_world_size=1,
                    scheduler_block_size=config.scheduler_block_size,
                    hash_block_size=config.hash_block_size,
                    # The trace's flag can only turn partial hits off.
                    allow_partial_hash_hits=config.enable_partial_hash_hits,
                )
            else:
                coordinator = _call_known(
                    module.MooncakeStoreCoordinator,
                    f"{_COORDINATOR_MODULES['mooncake']}.MooncakeStoreCoordinator",
                    groups,
                    config.scheduler_block_size,
                    config.hash_block_size,
                    use_eagle=config.use_eagle,
                    enable_partial_hash_hits=config.enable_partial_hash_hits,
                )
        except AssertionError as exc:
            raise ReplayError(f"vLLM rejects this KV-cache configuration: {exc}") from None
        if self.cache.name == "gpu":
            pool = _require(coordinator, "block_pool", "the engine coordinator")
            _require(pool, "null_block", "BlockPool")
            cached = _require(pool, "cached_block_hash_to_block", "BlockPool")
            _require(cached, "insert", "BlockPool.cached_block_hash_to_block")
            _require(cached, "_cache", "BlockPool.cached_block_hash_to_block")
        self._unitary = not hasattr(coordinator, "attention_groups")
        if not self._unitary:
            for group in coordinator.attention_groups:
                for field in ("_replace", "manager_cls", "group_ids", "use_eagle"):
                    _require(group, field, f"{type(coordinator).__name__}.attention_groups[i]")
        self._spec_group_of = [0] * config.num_groups
        self._hits: list[int] = [0]
        if not self._unitary:
            # Record each spec group's last finder hit; the answers are unchanged.
            self._hits = [0] * len(coordinator.attention_groups)
            coordinator.attention_groups = [
                group._replace(
                    manager_cls=_RecordingManager(
                        group.manager_cls, i, self._hits, bool(group.use_eagle), self._force
                    )
                )
                for i, group in enumerate(coordinator.attention_groups)
            ]
            for i, group in enumerate(coordinator.attention_groups):
                for gid in group.group_ids:
                    self._spec_group_of[gid] = i
        self._coordinator: Any = coordinator

    def lookup(
        self, hashes: Hashes, max_length: int, contains: Contains, *, explain: bool = False
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
        block_hashes = list(hashes)
        # Every lookup holds the lock: a default-policy lookup must never run
        # while another thread has a gate swapped out.
        with _GATE_LOCK:
            for i in range(len(self._hits)):
                self._hits[i] = 0
            with self._policy_patches():
                if self.cache.name == "gpu":
                    blocks, hit = self._engine_lookup(block_hashes, max_length, contains)
                    null = self._coordinator.block_pool.null_block
                    masks = [[b is not null for b in blks] for blks in blocks]
                else:
                    pool = self._module.ExternalCachedBlockPool(hbs, exists=_KeyView(contains))
                    masks, hit = self._coordinator.find_longest_cache_hit(
                        block_hashes, max_length, pool
                    )
            if self._unitary:
                self._hits[0] = hit
            return LookupOutcome(hit_tokens=hit, groups=self._groups(masks))

    def _engine_lookup(
        self,
        block_hashes: list[Hashable],
        max_length: int,
        contains: Sequence[Callable[[Hashable], bool]],
    ) -> tuple[Any, int]:
        """The engine's lookup over a block pool that caches exactly the
        present keys among the request's hashes, emptied afterwards."""
        pool = self._coordinator.block_pool
        cached = pool.cached_block_hash_to_block
        block_cls = self._utils.KVCacheBlock
        key_of = self._utils.make_block_hash_with_group_id
        next_id = _POOL_BLOCKS
        try:
            for gid, has in enumerate(contains):
                for h in dict.fromkeys(block_hashes):
                    if has(h):
                        cached.insert(key_of(h, gid), block_cls(block_id=next_id))
                        next_id += 1
            # 0.33 also returns the uncached common prefix; earlier ones did not.
            blocks, hit = self._coordinator.find_longest_cache_hit(block_hashes, max_length)[:2]
        finally:
            cached._cache.clear()
        return blocks, hit

    @contextlib.contextmanager
    def _policy_patches(self) -> Iterator[None]:
        saved: dict[str, Any] = {}
        where = _COORDINATOR_MODULES[self.cache.name]
        if self.policy.mamba_peek_margin:
            saved["MambaSpec"] = _require(self._module, "MambaSpec", where)
            self._module.MambaSpec = _NotMamba
        if not self.policy.verify_eagle_once:
            saved["eagle_proof_margin"] = _require(self._module, "eagle_proof_margin", where)
            self._module.eagle_proof_margin = _no_margin
            self._force[0] = True
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self._module, name, value)
            self._force[0] = False

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

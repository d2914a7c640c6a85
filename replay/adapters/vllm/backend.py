"""The installed vLLM's own coordinators behind the reference ``Coordinator``'s interface.

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

Nothing of vLLM's is patched: the installed release answers as itself, so
the backend answers only for the policy that models that release
(``policy_for_version``), or an alias with the same rules for the cache. The
API differences between releases (argument names, tuple shapes of the spec
groups, spec fields, finder return values) are found by feature detection.
Lookups run one at a time (a process-wide lock): the recorded hits live on
the instance.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
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
from replay.rules.coordinator.policy import POLICY_ENV, VersionPolicy, version_policy


class VllmUnavailable(ReplayError):
    """The installed vLLM cannot answer: it does not import, or its internal
    API moved (a module, class, function or parameter this backend needs is
    gone). One line naming what is missing; exit status 2."""


def _missing_vllm(exc: ImportError) -> str:
    import os
    import sys

    # The checkout that holds this package: replay/adapters/vllm/backend.py.
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


def installed_version_policy() -> VersionPolicy:
    """The policy the installed vLLM is answered and checked under, by the
    project's one rule (``version_policy``): ``$REPLAY_POLICY`` when set
    (``replay test --policy`` sets it), else the version's policy, with the
    line that says what was assumed for a version no policy models
    (a newer release, a development build)."""
    version = installed_vllm_version()
    chosen = os.environ.get(POLICY_ENV, "").strip() or None
    try:
        return version_policy(version, chosen)
    except ReplayError as exc:
        where = f"{POLICY_ENV}={chosen}: " if chosen else ""
        raise VllmUnavailable(f"--coordinator vllm: {where}{exc}") from None


def policy_for_vllm(version: str) -> str | None:
    """The project's policy that models vLLM ``version`` (the release
    policies' own mapping, ``version_policy``); ``None`` when none does
    (a release before 0.16)."""
    try:
        return version_policy(version).policy.name
    except ReplayError:
        return None


def installed_policy() -> tuple[str | None, str]:
    """The policy the installed vLLM is checked under
    (``installed_version_policy``), and the reason (a template with
    ``{policy}``) to give for skipping an expectation of another one."""
    version = installed_vllm_version()
    try:
        policy = installed_version_policy().policy.name
    except VllmUnavailable:
        if os.environ.get(POLICY_ENV, "").strip():
            raise
        return None, (
            f"policy {{policy}} is not checked: no policy of this project models "
            f"the installed vLLM {version}"
        )
    return policy, (
        f"policy {{policy}} is not checked: the installed vLLM {version} is checked as "
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

# The recorded finder hits live on the coordinator: lookups run one at a time.
_LOOKUP_LOCK = threading.Lock()


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes, of ``kwargs`` (releases add and
    rename them; what a release does not take it does not model)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _fields(cls: Any) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {}))


class _KeyView:
    """The ``(group_id, hash)`` set an ``ExternalCachedBlockPool`` probes,
    answered by the caller's per-group membership tests instead of a copy
    of the store."""

    __slots__ = ("_contains", "_joined")

    def __init__(
        self,
        contains: Sequence[Callable[[Hashable], bool]],
        joined: dict[Hashable, Hashable] | None = None,
    ) -> None:
        self._contains = contains
        # A mirror before 0.24 keys a block by its hash units joined: the
        # block is present when its last unit is.
        self._joined = joined or {}

    def __contains__(self, key: tuple[int, Hashable]) -> bool:
        group_id, block_hash = key
        return bool(self._contains[group_id](self._joined.get(block_hash, block_hash)))


class _RecordingManager:
    """Pass-through to a vLLM manager class that records the hit length of
    each ``find_longest_cache_hit`` call for its spec group; the coordinator
    keeps these to itself (``_find_hit_blocks`` returns only the masks).
    Releases before 0.26 return the blocks alone: the hit is then the
    blocks' length in tokens."""

    def __init__(self, manager_cls: Any, index: int, sink: list[int]) -> None:
        self._manager_cls = manager_cls
        self._index = index
        self._sink = sink
        self.supports_fine_grained_hash_lookup = getattr(
            manager_cls, "supports_fine_grained_hash_lookup", False
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager_cls, name)

    def find_longest_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        result = self._manager_cls.find_longest_cache_hit(*args, **kwargs)
        if len(result) == 2 and isinstance(result[1], int):
            self._sink[self._index] = result[1]
        else:
            spec = kwargs["kv_cache_spec"]
            self._sink[self._index] = len(result[0]) * spec.block_size
        return result


def _with_manager(group: Any, manager: Any) -> Any:
    """A spec group (a named tuple from 0.27, a plain tuple before) with its
    manager class replaced."""
    if hasattr(group, "_replace"):
        return group._replace(manager_cls=manager)
    return (group[0], group[1], manager, *group[3:])


def _vllm_spec(group: GroupSpec, iface: Any, dtype: Any) -> Any:
    """A vLLM spec for a trace group; a field the release lacks is refused
    when the trace uses it."""
    common: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": _NUM_KV_HEADS,
        "head_size": _HEAD_SIZE,
        "dtype": dtype,
    }
    if group.kind is GroupKind.FULL_ATTENTION:
        return iface.FullAttentionSpec(**common)
    if group.kind is GroupKind.SLIDING_WINDOW:
        window: dict[str, Any] = {"sliding_window": group.sliding_window}
        if "extra_retained_tokens" in _fields(iface.SlidingWindowSpec):
            window["extra_retained_tokens"] = group.extra_retained_tokens
        elif group.extra_retained_tokens:
            raise ReplayError(
                "this vLLM's SlidingWindowSpec has no extra_retained_tokens (from 0.28.0): "
                "it cannot express this trace's sliding window"
            )
        return iface.SlidingWindowSpec(**common, **window)
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
    # Per-group EAGLE flags exist from 0.20.0; before, use_eagle drops for all.
    flags = "is_eagle_group" in _fields(iface.KVCacheGroupSpec)
    return [
        iface.KVCacheGroupSpec(
            layer_names=[g.name or f"model.layers.{gid}"],
            kv_cache_spec=_vllm_spec(g, iface, torch.bfloat16),
            **({"is_eagle_group": g.is_eagle_group} if flags else {}),
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
        version = installed_vllm_version()
        installed = installed_version_policy().policy
        if self.cache.name == "mooncake" and installed.mooncake is None:
            raise VllmUnavailable(
                f"--coordinator vllm: the installed vLLM {version} has no Mooncake store "
                "mirror (it came with #42828 in vLLM 0.22.0); use --cache gpu"
            )
        iface, module, utils = (
            _vllm_module(name)
            for name in (
                "vllm.v1.kv_cache_interface",
                _COORDINATOR_MODULES[self.cache.name],
                "vllm.v1.core.kv_cache_utils",
            )
        )
        _probe(iface, module, utils, self.cache.name)
        if installed.rules(self.cache.name) != self.cache:
            modelled = self.policy.release(self.cache.name)
            raise ReplayError(
                f"--coordinator vllm answers as the installed vLLM {version} (policy "
                f"{installed.name}); policy {self.policy.name} models vLLM "
                f"{modelled.releases} in the {self.cache.name} cache: run it in that "
                f"release's environment (make test-vllm VLLM={modelled.last}), or set "
                f"{POLICY_ENV}={self.policy.name} if this vLLM answers as that release"
            )
        self._module: Any = module
        self._utils: Any = utils
        self.version = version
        # Feature detection: how this release keys a block larger than the
        # hash unit (its last unit from 0.24; its units joined before).
        convert = getattr(utils, "BlockHashListWithBlockSize", None)
        self._joins_units = convert is not None and convert([b"a", b"b"], 1, 2)[0] == b"ab"
        if (
            self.cache.name == "gpu"
            and "scheduler_block_size"
            not in inspect.signature(module.get_kv_cache_coordinator).parameters
            and config.num_groups > 1
            and config.scheduler_block_size != math.lcm(*(g.block_size for g in config.groups))
        ):
            raise ReplayError(
                f"vLLM {version} aligns hybrid hits to the lcm of the block sizes: it cannot "
                f"express the trace's scheduler_block_size {config.scheduler_block_size}"
            )
        groups = vllm_groups(config, iface, torch)
        try:
            if self.cache.name == "gpu":
                build = module.get_kv_cache_coordinator
                coordinator = _call_known(
                    build,
                    f"{_COORDINATOR_MODULES['gpu']}.get_kv_cache_coordinator",
                    iface.KVCacheConfig(
                        num_blocks=_POOL_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
                    ),
                    **_accepted(
                        build,
                        {
                            "max_model_len": _MAX_MODEL_LEN,
                            "max_in_flight_tokens": _MAX_IN_FLIGHT_TOKENS,
                            "max_num_batched_tokens": _MAX_IN_FLIGHT_TOKENS,
                            # The scheduler's input: lookahead hashes (0.33.0
                            # on, the releases that take them) turn the drop off.
                            "use_eagle": config.use_eagle
                            and not (
                                config.num_hash_lookahead_tokens
                                and "num_hash_lookahead_tokens"
                                in inspect.signature(build).parameters
                            ),
                            "num_hash_lookahead_tokens": config.num_hash_lookahead_tokens,
                            "enable_caching": True,
                            "enable_kv_cache_events": False,
                            "dcp_world_size": 1,
                            "pcp_world_size": 1,
                            "scheduler_block_size": config.scheduler_block_size,
                            "hash_block_size": config.hash_block_size,
                            # The trace's flag can only turn partial hits off
                            # (from 0.30.0; before, the release ignores it).
                            "allow_partial_hash_hits": config.enable_partial_hash_hits,
                        },
                    ),
                )
            else:
                cls = module.MooncakeStoreCoordinator
                coordinator = _call_known(
                    cls,
                    f"{_COORDINATOR_MODULES['mooncake']}.MooncakeStoreCoordinator",
                    groups,
                    config.scheduler_block_size,
                    config.hash_block_size,
                    **_accepted(
                        cls.__init__,
                        {
                            "use_eagle": config.use_eagle,
                            # From 0.34.0 the mirror takes the lookahead.
                            "num_hash_lookahead_tokens": config.num_hash_lookahead_tokens,
                            # From 0.32.0 the mirror takes the flag as given.
                            "enable_partial_hash_hits": config.enable_partial_hash_hits,
                        },
                    ),
                )
        except (AssertionError, ValueError) as exc:
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
                # A named tuple from 0.29 on; a plain (spec, group ids, manager) before.
                fields = (
                    ("_replace", "manager_cls", "group_ids") if hasattr(group, "_fields") else ()
                )
                for field in fields:
                    _require(group, field, f"{type(coordinator).__name__}.attention_groups[i]")
        self._spec_group_of = [0] * config.num_groups
        self._hits: list[int] = [0]
        if not self._unitary:
            # Record each spec group's last finder hit; the answers are unchanged.
            self._hits = [0] * len(coordinator.attention_groups)
            coordinator.attention_groups = [
                _with_manager(group, _RecordingManager(group[2], i, self._hits))
                for i, group in enumerate(coordinator.attention_groups)
            ]
            for i, group in enumerate(coordinator.attention_groups):
                for gid in group[1]:
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
        with _LOOKUP_LOCK:
            for i in range(len(self._hits)):
                self._hits[i] = 0
            if self.cache.name == "gpu":
                blocks, hit = self._engine_lookup(block_hashes, max_length, contains)
                null = self._coordinator.block_pool.null_block
                masks = [[b is not null for b in blks] for blks in blocks]
            else:
                pool_cls = self._module.ExternalCachedBlockPool
                pool = pool_cls(
                    **_accepted(
                        pool_cls.__init__,
                        {
                            "hash_block_size": hbs,
                            "exists": _KeyView(contains, self._joined_units(block_hashes)),
                        },
                    )
                )
                masks, hit = self._coordinator.find_longest_cache_hit(
                    block_hashes, max_length, pool
                )
            if self._unitary:
                self._hits[0] = hit
            return LookupOutcome(hit_tokens=hit, groups=self._groups(masks))

    def _joined_units(self, block_hashes: list[Hashable]) -> dict[Hashable, Hashable]:
        """Each joined block key of every group's block size, to its last unit."""
        out: dict[Hashable, Hashable] = {}
        for gid in range(self.config.num_groups):
            for i, key in self._joined_keys(block_hashes, gid):
                out[key] = block_hashes[i]
        return out

    def _joined_keys(self, block_hashes: list[Hashable], gid: int) -> list[tuple[int, Hashable]]:
        """``(last unit index, key)`` of each whole block of group ``gid`` when
        this release keys blocks by their joined hash units, else nothing."""
        if not self._joins_units:
            return []
        k = self.config.groups[gid].block_size // self.config.hash_block_size
        if k == 1:
            return []
        return [
            (i * k + k - 1, b"".join(block_hashes[i * k : i * k + k]))  # type: ignore[arg-type]
            for i in range(len(block_hashes) // k)
        ]

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
                # Before 0.24 a block larger than the hash unit is keyed by its
                # units joined: present when its last unit is (the trace's key).
                for i, key in self._joined_keys(block_hashes, gid):
                    if has(block_hashes[i]):
                        cached.insert(key_of(key, gid), block_cls(block_id=next_id))
                        next_id += 1
            # (blocks, hit) before 0.26.0, (blocks, hit, uncached prefix) after.
            found = self._coordinator.find_longest_cache_hit(block_hashes, max_length)
        finally:
            cached._cache.clear()
        return found[0], found[1]

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

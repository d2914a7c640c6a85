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
import logging
import math
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator.hybrid import (
    Contains,
    GroupOutcome,
    Hashes,
    LookupCoordinator,
    LookupOutcome,
    Step,
)
from replay.rules.coordinator.kinds import VLLM
from replay.rules.coordinator.policy import POLICY_ENV, VersionPolicy, version_key, version_policy

#: Every name of vLLM's starting with an underscore that this package
#: touches, because vLLM offers no public way in: why, and the releases it
#: was checked on. ``tests/adapters/test_private_names_table.py`` scans the package
#: and fails on any other (and on an entry no longer used).
PRIVATE_NAMES: dict[str, tuple[str, str]] = {
    # The hybrid engine coordinator's spec groups (``attention_groups``) keep
    # the per-group finder hits to themselves; a pass-through manager class
    # records them. ``SpecGroup`` is a named tuple from 0.29: its own copy
    # with one field changed, and the test that it is one.
    "_replace": ("namedtuple copy of a SpecGroup with manager_cls replaced", "0.32.0-0.34.0"),
    "_fields": ("namedtuple test: a SpecGroup (0.29+) or a plain tuple", "0.32.0-0.34.0"),
    # ``MooncakeStoreWorker.__init__`` mounts a Mooncake store and joins the
    # distributed groups: ``VllmCoordinator._store_worker`` makes the worker with
    # ``__new__`` and sets the state its ``lookup`` reads.
    "_capacity_only": ("worker state read first by lookup (False)", "0.29.0-0.34.0"),
    "_kv_cache_groups": ("worker state: the coordinator's kv_cache_groups", "0.29.0-0.34.0"),
    "_lookup_key_prefixes": ("worker state: one key prefix per group", "0.29.0-0.34.0"),
    "_selective_lease": ("worker state read by 0.34's lookup (None: no lease)", "0.34.0"),
    "_record_kv_connector_operation": ("worker's statistics hook (ignored)", "0.29.0-0.34.0"),
}


class VllmUnavailable(ReplayError):
    """The installed vLLM cannot answer: it does not import, or its internal
    API moved (a module, class, function or parameter this backend needs is
    gone). One line naming what is missing; exit status 2."""


class VllmCannotExpress(ReplayError):
    """The installed vLLM's API has no way to say a trace's configuration
    (a spec field or builder argument that came in a later release): not an
    answer of its lookup path. Exit status 2."""


def _missing_vllm(exc: ImportError) -> str:
    import os
    import sys

    # The checkout that holds this package: replay/adapters/vllm/backend.py.
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    return (
        f"`coordinator` vllm: vLLM does not import in this Python ({sys.executable}: {exc}); "
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
        raise VllmUnavailable(f"`coordinator` vllm: {where}{exc}") from None


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
    ``{policy}`` and ``{cache}``) to give for skipping an expectation whose
    policy's rules in its cache are not the installed release's."""
    version = installed_vllm_version()
    try:
        policy = installed_version_policy().policy.name
    except VllmUnavailable:
        if os.environ.get(POLICY_ENV, "").strip():
            raise
        return None, (
            f"policy {{policy}} is not checked in the {{cache}} cache: no policy of this project models "
            f"the installed vLLM {version}"
        )
    return policy, (
        f"policy {{policy}} is not checked in the {{cache}} cache: the installed vLLM "
        f"{version} is checked as policy {policy}"
    )


def _require(owner: Any, name: str, where: str) -> Any:
    """``owner.name``, or the one-line error naming what the installed vLLM lacks."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise VllmUnavailable(
            f"`coordinator` vllm: the installed vLLM {installed_vllm_version()} has no "
            f"`{where}.{name}` (its internal API moved; this backend needs it)"
        ) from None


def _check_known(function: Any, where: str, n_args: int, kwargs: dict[str, Any]) -> bool:
    """Whether ``function`` takes any keyword (``**kwargs``); a required
    parameter this backend does not know is the API having moved."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    positional = list(params.values())[:n_args]
    rest = [p for p in params.values() if p not in positional]
    for p in rest:
        required = p.default is inspect.Parameter.empty and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and p.name not in kwargs:
            raise VllmUnavailable(
                f"`coordinator` vllm: the installed vLLM {installed_vllm_version()}'s "
                f"`{where}` requires a parameter `{p.name}` this backend does not know "
                "(its internal API moved)"
            )
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)


#: ``_call_known``'s keyword filter per function and call shape: the
#: per-lookup calls would otherwise read a signature each time.
_KNOWN: dict[tuple[Any, int, frozenset[str]], frozenset[str] | None] = {}


def _call_known(function: Any, where: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call ``function`` with the keyword arguments its signature takes;
    a required parameter this backend does not know is the API having moved."""
    key = (getattr(function, "__func__", function), len(args), frozenset(kwargs))
    if key not in _KNOWN:
        accepts_any = _check_known(function, where, len(args), kwargs)
        _KNOWN[key] = (
            None
            if accepts_any
            else frozenset(k for k in kwargs if k in inspect.signature(function).parameters)
        )
    allowed = _KNOWN[key]
    if allowed is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in allowed}
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
_TAIL_KEY_SAID: set[str] = set()


def _say_tail_key_failure(version: str) -> None:
    """One line, once per process: the worker's answers past its tail-key
    assertion are compared by the hit it found before raising."""
    if version in _TAIL_KEY_SAID:
        return
    _TAIL_KEY_SAID.add(version)
    logging.getLogger("replay").warning(
        "note: vLLM %s's MooncakeStoreWorker.lookup found a hit, then failed its "
        "tail-key assertion (it asks the store for a larger block's joined key and "
        "asserts on the raw hash): such lookups are compared by the hit it found",
        version,
    )


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes, of ``kwargs`` (releases add and
    rename them; what a release does not take it does not model)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _dataclass_fields(cls: Any) -> set[str]:
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

    def __init__(
        self, manager_cls: Any, index: int, sink: list[int], calls: list[FinderCall]
    ) -> None:
        self._manager_cls = manager_cls
        self._index = index
        self._sink = sink
        self._calls = calls
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
        # The call as vLLM made it (its coordinators pass keywords): what
        # ``replay explain`` shows of vLLM's side and a failure names.
        flag = next((k for k in _EAGLE_ARGUMENTS if k in kwargs), None)
        self._calls.append(
            FinderCall(
                spec_group=self._index,
                function=f"{self._manager_cls.__name__}.find_longest_cache_hit",
                max_length=int(kwargs.get("max_length", -1)),
                eagle_argument=flag,
                drop=bool(kwargs[flag]) if flag is not None else False,
                hit=self._sink[self._index],
            )
        )
        return result


#: What a release calls the manager's EAGLE-drop argument.
_EAGLE_ARGUMENTS = ("drop_eagle_block", "use_eagle")


@dataclass(frozen=True, slots=True)
class FinderCall:
    """One per-kind finder call vLLM's fixed point made in a lookup."""

    spec_group: int
    function: str
    max_length: int
    eagle_argument: str | None
    drop: bool
    hit: int

    def text(self) -> str:
        flag = f", {self.eagle_argument}={self.drop}" if self.eagle_argument else ""
        return f"{self.function}(max_length={self.max_length:,}{flag})"


_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker"


def worker_entry_missing() -> str | None:
    """Why a Mooncake lookup cannot enter the installed vLLM where its
    connector's does (``MooncakeStoreWorker.lookup(num_tokens,
    block_hashes)``, from 0.27.0), else ``None``. One line."""
    reason, _ = _worker_entry()
    return reason


def _worker_entry() -> tuple[str | None, bool]:
    """``worker_entry_missing``'s line, and whether the release has a worker
    entry of its own that this backend could not load (a module that does
    not import) rather than none (before 0.27.0 the worker took a length
    its connector's scheduler had already aligned: the policies of those
    releases model the mirror at ``max_length``)."""
    where = f"{_WORKER_MODULE}.MooncakeStoreWorker.lookup"
    unloadable = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(_WORKER_MODULE)
        params = list(inspect.signature(module.MooncakeStoreWorker.lookup).parameters)
    except ImportError as exc:
        # 0.27 and 0.28's worker module imports the serving stack (uvicorn).
        missing = f"cannot import `{_WORKER_MODULE}` ({exc})"
        unloadable = version_key(installed_vllm_version()) >= (0, 27, 0)
    except (AttributeError, TypeError, ValueError) as exc:
        missing = f"has no `{where}` ({type(exc).__name__}: {exc})"
    else:
        if params[1:3] == ["num_tokens", "block_hashes"]:
            return None, False
        missing = f"has no `{where}(num_tokens, block_hashes)` (it takes {', '.join(params[1:])})"
    return (
        f"--coordinator vllm: the installed vLLM {installed_vllm_version()} {missing}: "
        "its Mooncake lookups are answered by the store's mirror "
        "(MooncakeStoreCoordinator.find_longest_cache_hit) at each lookup's max_length, "
        "not through the worker's length alignment, lookup masks and retry",
        unloadable,
    )


def _ignore(*_args: Any, **_kwargs: Any) -> None:
    """The worker's operation statistics: nobody reads them here."""


def _absent(_block_hash: Hashable) -> bool:
    return False


class _TokenDb:
    """What the worker's lookup reads of a group's token database."""

    def __init__(self, block_size: int, hash_block_size: int) -> None:
        self.block_size = block_size
        self.chunk_size = block_size
        self.hash_block_size = hash_block_size


class _TraceStore:
    """The Mooncake store as the worker's lookup asks it: ``batch_is_exist``
    of key strings (``{prefix}@{hash hex}``), answered from the trace's keys
    (``contains[g]``) for the lookup in hand."""

    def __init__(self, prefixes: dict[str, int]) -> None:
        self.prefixes = prefixes
        self.contains: Sequence[Callable[[Hashable], bool]] = ()
        self.by_hex: dict[str, Hashable] = {}

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        out = []
        for key in keys:
            prefix, _, hex_hash = key.rpartition("@")
            unit = self.by_hex.get(hex_hash)
            gid = self.prefixes[prefix]
            out.append(1 if unit is not None and self.contains[gid](unit) else 0)
        return out


class _RecordingMirror:
    """Pass-through to the ``MooncakeStoreCoordinator`` that keeps the load
    masks and hit of its last ``find_longest_cache_hit`` (the worker drops
    the masks)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.masks: Any = None
        self.hit: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def find_longest_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        masks, hit = self.inner.find_longest_cache_hit(*args, **kwargs)
        self.masks, self.hit = masks, int(hit)
        return masks, hit


class _LookupLength:
    """Pass-through to the engine coordinator that keeps the lookup length
    ``get_computed_blocks`` asked it for."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.max_length: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def find_longest_cache_hit(self, *args: Any, **kwargs: Any) -> Any:
        # (block_hashes, max length), by position or by a release's names.
        lengths = [*args[1:2], *(v for k, v in kwargs.items() if k != "block_hashes")]
        self.max_length = int(lengths[0]) if lengths else None
        return self.inner.find_longest_cache_hit(*args, **kwargs)


def _is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _with_manager(group: Any, manager: Any) -> Any:
    """A spec group (a named tuple from 0.27, a plain tuple before) with its
    manager class replaced."""
    if _is_named_tuple(group):
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
        if "extra_retained_tokens" in _dataclass_fields(iface.SlidingWindowSpec):
            window["extra_retained_tokens"] = group.extra_retained_tokens
        elif group.extra_retained_tokens:
            raise VllmCannotExpress(
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
    flags = "is_eagle_group" in _dataclass_fields(iface.KVCacheGroupSpec)
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
                f"`coordinator` vllm: the installed vLLM {installed_vllm_version()} has no "
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
    else:
        _require(module, "MooncakeStoreCoordinator", where)
        _require(module, "ExternalCachedBlockPool", where)


class VllmCoordinator(LookupCoordinator):
    """vLLM's own coordinator for a cache, with the reference's ``lookup``."""

    name = VLLM.name
    #: Where a Mooncake lookup enters vLLM: the store worker's own
    #: ``lookup`` for a prompt of ``max_length + 1`` tokens, as the
    #: connector's do (from 0.27.0; before, and ``VllmStoreMirror``, the
    #: mirror's ``find_longest_cache_hit`` at the trace's ``max_length``:
    #: ``worker_entry_missing`` says why).
    mooncake_entry = "worker"

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
                f"`coordinator` vllm: the installed vLLM {version} has no Mooncake store "
                "mirror (it came with #42828 in vLLM 0.22.0); use `cache` gpu"
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
        if self.cache.name == "gpu":
            # Imported after the probe: it imports the coordinator's names.
            self._manager_module: Any = _vllm_module("vllm.v1.core.kv_cache_manager")
            _require(self._manager_module, "KVCacheManager", "vllm.v1.core.kv_cache_manager")
        if installed.rules(self.cache.name) != self.cache:
            modelled = self.policy.release(self.cache.name)
            raise ReplayError(
                f"`coordinator` vllm answers as the installed vLLM {version} (policy "
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
            raise VllmCannotExpress(
                f"vLLM {version} aligns hybrid hits to the lcm of the block sizes: it cannot "
                f"express the trace's scheduler_block_size {config.scheduler_block_size}"
            )
        groups = vllm_groups(config, iface, torch)
        self._iface: Any = iface
        self._groups_vllm = groups
        if self.cache.name == "gpu":
            self._engine_kwargs: dict[str, Any] = {
                "max_model_len": _MAX_MODEL_LEN,
                "max_in_flight_tokens": _MAX_IN_FLIGHT_TOKENS,
                "max_num_batched_tokens": _MAX_IN_FLIGHT_TOKENS,
                # The scheduler's input: lookahead hashes (from 0.33.0, the
                # releases that take them) turn the EAGLE drop off.
                "use_eagle": config.use_eagle
                and not (
                    config.num_hash_lookahead_tokens
                    and "num_hash_lookahead_tokens"
                    in inspect.signature(module.get_kv_cache_coordinator).parameters
                ),
                "enable_caching": True,
                "log_stats": False,
                "enable_kv_cache_events": False,
                "dcp_world_size": 1,
                "pcp_world_size": 1,
                "scheduler_block_size": config.scheduler_block_size,
                "hash_block_size": config.hash_block_size,
                # The trace's flag can only turn partial hits off
                # (from 0.30.0; before, the release ignores it).
                "allow_partial_hash_hits": config.enable_partial_hash_hits,
            }
            self._request_modules = (
                _vllm_module("vllm.v1.request"),
                _vllm_module("vllm.sampling_params"),
            )
            _require(self._request_modules[0], "Request", "vllm.v1.request")
            _require(self._request_modules[1], "SamplingParams", "vllm.sampling_params")
            self._sampling: Any = None
            self._build_engine(_POOL_BLOCKS)
            return
        try:
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
        self._install(coordinator)
        self._worker: Any = None
        #: Why the mirror answers where the worker was asked for (a release
        #: without the worker's lookup), else None.
        self.entry_note: str | None = None
        if self.mooncake_entry == "worker":
            self._worker = self._store_worker()

    def _store_worker(self) -> Any:
        """The Mooncake store worker's own ``lookup`` over this coordinator, or
        ``None`` where the release has no worker this backend can drive (then
        the mirror's ``find_longest_cache_hit`` answers at the trace's
        ``max_length``, and ``self.entry_note`` says so).

        ``MooncakeStoreWorker.__init__`` mounts a Mooncake store and joins
        vLLM's distributed groups, so the worker is made without it
        (``__new__``) and given the state its ``lookup`` reads: the public
        ``coord``, ``hash_block_size``, ``token_dbs`` (each group's block
        size) and ``store`` (``_TraceStore``, answering ``batch_is_exist``
        from the trace's keys), and the private names of ``PRIVATE_NAMES``."""
        reason, unloadable = _worker_entry()
        if unloadable:
            # The release's lookups enter through its worker, which the
            # policies model: the mirror one level below would not be it.
            raise VllmUnavailable(
                f"{reason}; this release's Mooncake lookups enter through that "
                "worker (install uvicorn, which 0.27-0.28's worker module imports)"
            )
        if reason is not None:
            self.entry_note = reason
            return None
        worker_cls = importlib.import_module(_WORKER_MODULE).MooncakeStoreWorker
        groups = self._coordinator.kv_cache_groups
        prefixes = {f"replay-group-{gid}": gid for gid in range(len(groups))}
        self._store = _TraceStore(prefixes)
        self._mirror = _RecordingMirror(self._coordinator)
        worker = worker_cls.__new__(worker_cls)
        state: dict[str, Any] = {
            "coord": self._mirror,
            "hash_block_size": self.config.hash_block_size,
            "token_dbs": [
                _TokenDb(g.kv_cache_spec.block_size, self.config.hash_block_size) for g in groups
            ],
            "store": self._store,
            "_capacity_only": False,
            "_kv_cache_groups": groups,
            "_lookup_key_prefixes": tuple((prefix,) for prefix in prefixes),
            "_selective_lease": None,
            "_record_kv_connector_operation": _ignore,
        }
        for name, value in state.items():
            setattr(worker, name, value)
        try:
            # One lookup of a scheduler block no group holds (a request's
            # own hashes: fewer would index past them): a release whose
            # lookup reads state this backend does not give is an API that moved.
            self._store.contains = [_absent] * len(groups)
            self._store.by_hex = {}
            units = self.config.scheduler_block_size // self.config.hash_block_size
            worker.lookup(
                self.config.scheduler_block_size + 1,
                [b"replay-probe-%d" % i for i in range(units)],
            )
        except (AttributeError, TypeError) as exc:
            raise VllmUnavailable(
                f"`coordinator` vllm: the installed vLLM {self.version}'s "
                f"MooncakeStoreWorker.lookup reads state this backend does not give "
                f"({type(exc).__name__}: {exc}; its internal API moved)"
            ) from None
        except Exception:
            # vLLM's own logic refused the probe (0.33.0 asserts a tail key
            # for a hit no key backs, e.g. a chunked local group's skipped
            # blocks): the state was enough; a lookup answers as vLLM does.
            pass
        return worker

    def _worker_lookup(
        self,
        block_hashes: list[Hashable],
        max_length: int,
        contains: Sequence[Callable[[Hashable], bool]],
    ) -> tuple[list[list[bool]], int]:
        """``MooncakeStoreWorker.lookup(num_tokens, block_hashes)`` for a prompt
        of ``max_length + 1`` tokens: vLLM's own length alignment
        (``align_lookup_length``), lookup masks, store queries and retry below
        the prompt's end. The masks are those of its last coordinator call."""
        by_hex: dict[str, Hashable] = {cast(bytes, h).hex(): h for h in block_hashes}
        for key, unit in self._joined_units(block_hashes).items():
            by_hex[cast(bytes, key).hex()] = unit
        self._store.contains = contains
        self._store.by_hex = by_hex
        self._mirror.masks, self._mirror.hit = None, None
        try:
            result = self._worker.lookup(max_length + 1, block_hashes)
        except AssertionError:
            if self._mirror.hit is None:
                raise
            # The worker found its hit, then failed its tail-key bookkeeping
            # (``_tail_key_boundaries``, 0.29-0.33: it asks the store for a
            # group's joined block key and asserts on the raw hash at the hit
            # boundary, so groups with blocks larger than the hash unit
            # fail): the hit is the one its coordinator found; said once.
            _say_tail_key_failure(self.version)
            result = self._mirror.hit
        # A MooncakeLookupResult from 0.29; the hit alone before.
        hit = int(getattr(result, "hit_length", result))
        masks = self._mirror.masks
        if masks is None or hit != self._mirror.hit:
            # The worker answered without its coordinator's last answer:
            # before asking it, or giving up after a whole-prompt hit with
            # nothing usable below the prompt's end (the retry's aligned
            # length is 0): nothing loaded, no group hit.
            masks = [[] for _ in self.config.groups]
            for i in range(len(self._hits)):
                self._hits[i] = 0
        return [list(m) for m in masks], hit

    def _build_engine(self, num_blocks: int) -> None:
        """vLLM's ``KVCacheManager`` over a pool of ``num_blocks`` blocks, with
        the engine coordinator as ``get_kv_cache_coordinator`` builds it for
        the trace's configuration installed as the manager's ``coordinator``
        (and its pool as the manager's ``block_pool``): the manager's
        constructor does not take every flag a trace sets (the scheduler never
        passes ``allow_partial_hash_hits``; releases before 0.24 take no block
        sizes). The manager's own ``get_computed_blocks`` then runs each lookup."""
        where = f"{_COORDINATOR_MODULES['gpu']}.get_kv_cache_coordinator"
        build = self._module.get_kv_cache_coordinator
        kv_config = self._iface.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=self._groups_vllm
        )
        kwargs = _accepted(build, self._engine_kwargs)
        try:
            coordinator = _call_known(build, where, kv_config, **kwargs)
            manager_cls = self._manager_module.KVCacheManager
            # The manager builds a coordinator of its own, replaced below: its
            # warnings (vLLM logs them once per message) are about nothing
            # that answers, so they are held back while it is built.
            vllm_logger = logging.getLogger("vllm")
            level = vllm_logger.level
            vllm_logger.setLevel(logging.ERROR)
            try:
                manager = _call_known(
                    manager_cls,
                    "vllm.v1.core.kv_cache_manager.KVCacheManager",
                    kv_config,
                    **_accepted(manager_cls.__init__, self._engine_kwargs),
                )
            finally:
                vllm_logger.setLevel(level)
        except (AssertionError, ValueError) as exc:
            raise ReplayError(f"vLLM rejects this KV-cache configuration: {exc}") from None
        for name in ("coordinator", "block_pool", "get_computed_blocks"):
            _require(manager, name, "KVCacheManager")
        pool = _require(coordinator, "block_pool", "the engine coordinator")
        for name in (
            "null_block",
            "get_new_blocks",
            "cache_full_blocks",
            "free_blocks",
            "get_num_free_blocks",
        ):
            _require(pool, name, "BlockPool")
        manager.coordinator = coordinator
        manager.block_pool = pool
        self._manager: Any = manager
        self._pool_blocks = num_blocks
        self._install(coordinator)

    def _install(self, coordinator: Any) -> None:
        """Keep ``coordinator``, recording each spec group's finder hits."""
        config = self.config
        self._unitary = not hasattr(coordinator, "attention_groups")
        if not self._unitary:
            for group in coordinator.attention_groups:
                # A named tuple from 0.29 on; a plain (spec, group ids, manager) before.
                fields = ("_replace", "manager_cls", "group_ids") if _is_named_tuple(group) else ()
                for field in fields:
                    _require(group, field, f"{type(coordinator).__name__}.attention_groups[i]")
        self._spec_group_of = [0] * config.num_groups
        self._hits: list[int] = [0]
        self._calls: list[FinderCall] = []
        if not self._unitary:
            # Record each spec group's last finder hit; the answers are unchanged.
            self._hits = [0] * len(coordinator.attention_groups)
            coordinator.attention_groups = [
                _with_manager(group, _RecordingManager(group[2], i, self._hits, self._calls))
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

        With ``explain``, the outcome's steps are the per-kind finder calls
        vLLM's fixed point made, in order, as recorded (a coordinator of one
        group calls its manager directly: no steps); the bound, drop and hit
        of each are vLLM's, the candidate before a call is the hit of the
        call before it.
        """
        hbs = self.config.hash_block_size
        bound = self.config.max_length_bound(len(hashes))
        if not 0 <= max_length < bound:
            # Past this bound vLLM's finders index beyond the hash list (within
            # it too under lookahead hashes, which no full attention caps: vLLM's
            # IndexError, reported as vLLM's).
            raise ReplayError(
                f"max_length {max_length} out of range for {len(hashes)} hashes of "
                f"{hbs} tokens: expected 0 <= max_length < {bound}"
            )
        if not all(type(h) is bytes for h in hashes):
            # vLLM keys its pool by bytes(hash); fingerprints would all collide.
            raise ReplayError("the vllm coordinator needs the raw bytes block hashes (exact keys)")
        block_hashes = list(hashes)
        with _LOOKUP_LOCK:
            for i in range(len(self._hits)):
                self._hits[i] = 0
            self._calls.clear()
            if self.cache.name == "gpu":
                masks, hit = self._engine_lookup(block_hashes, max_length, contains)
            elif self._worker is not None:
                masks, hit = self._worker_lookup(block_hashes, max_length, contains)
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
            steps = self._steps(max_length) if explain else ()
            return LookupOutcome(hit_tokens=hit, groups=self._groups(masks), steps=steps)

    @property
    def last_calls(self) -> tuple[FinderCall, ...]:
        """The finder calls of the last lookup, in the order vLLM made them."""
        return tuple(self._calls)

    def _steps(self, max_length: int) -> tuple[Step, ...]:
        """The recorded calls as the reference's explain steps: a new pass
        where a call's spec group is not after the one before it."""
        steps: list[Step] = []
        cand, pass_no, previous = max_length, 1, -1
        kinds = {self._spec_group_of[g]: grp.kind for g, grp in enumerate(self.config.groups)}
        for call in self._calls:
            if call.spec_group <= previous:
                pass_no += 1
            previous = call.spec_group
            steps.append(
                Step(
                    pass_no=pass_no,
                    spec_group=call.spec_group,
                    kind=kinds[call.spec_group],
                    group_ids=tuple(
                        g for g, s in enumerate(self._spec_group_of) if s == call.spec_group
                    ),
                    candidate_before=cand,
                    bound=call.max_length,
                    margin=max(call.max_length - cand, 0),
                    drop=call.drop,
                    matched_tokens=call.hit,
                    hit_tokens=call.hit,
                    candidate_after=call.hit,
                    call=call.text(),
                )
            )
            cand = call.hit
        return tuple(steps)

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
    ) -> tuple[list[list[bool]], int]:
        """The engine's own entry: ``KVCacheManager.get_computed_blocks`` for a
        request of ``max_length + 1`` tokens whose block hashes are the
        lookup's, over a pool that caches exactly the trace's present keys
        among them. The keys are written as vLLM writes them: blocks taken
        with ``get_new_blocks``, hashed and cached by ``cache_full_blocks``
        (a null block where a group holds no key: vLLM skips it, as for a
        sliding window's or Mamba's skipped blocks) and, for a key inside a
        block, ``cache_partial_block``; then freed with
        ``free_blocks`` so they sit cached and evictable; afterwards evicted
        with ``evict_blocks``. The manager picks the lookup length itself
        (``num_tokens - 1``); a length other than the trace's is an error."""
        config = self.config
        hbs = config.hash_block_size
        partial = getattr(self._manager.block_pool, "cache_partial_block", None) is not None
        need = 1 + sum(
            len(block_hashes) if partial else len(block_hashes) * hbs // g.block_size
            for g in config.groups
        )
        if need > self._pool_blocks:
            self._build_engine(max(need, 2 * self._pool_blocks))
        request = self._request(block_hashes, max_length)
        manager = self._manager
        pool = manager.block_pool
        taken: list[Any] = []
        try:
            for gid, (group, has) in enumerate(zip(config.groups, contains, strict=True)):
                k = group.block_size // hbs
                # A block's key is its last hash unit's (joined units before
                # 0.24: vLLM derives it; present when the last unit is).
                present = [has(block_hashes[i * k + k - 1]) for i in range(len(block_hashes) // k)]
                new = pool.get_new_blocks(sum(present))
                taken.extend(new)
                fresh = iter(new)
                blocks = [next(fresh) if p else pool.null_block for p in present]
                _call_known(
                    pool.cache_full_blocks,
                    "BlockPool.cache_full_blocks",
                    request=request,
                    blocks=blocks,
                    num_cached_blocks=0,
                    num_full_blocks=len(blocks),
                    block_size=group.block_size,
                    kv_cache_group_id=gid,
                )
                if partial and k > 1:
                    # A key inside a block (partial hash hits, from 0.30):
                    # vLLM registers it on a block with cache_partial_block.
                    units = [
                        u for u in range(len(block_hashes)) if (u + 1) % k and has(block_hashes[u])
                    ]
                    inner = pool.get_new_blocks(len(units))
                    taken.extend(inner)
                    for u, block in zip(units, inner, strict=True):
                        _call_known(
                            pool.cache_partial_block,
                            "BlockPool.cache_partial_block",
                            request=request,
                            block=block,
                            num_tokens=(u + 1) * hbs,
                            kv_cache_group_id=gid,
                            block_size=group.block_size,
                        )
            pool.free_blocks(taken)
            seen = _LookupLength(manager.coordinator)
            manager.coordinator = seen
            try:
                found = manager.get_computed_blocks(request)
            finally:
                manager.coordinator = seen.inner
        finally:
            self._evict(pool, taken)
        if seen.max_length != max_length:
            raise ReplayError(
                f"vLLM's KVCacheManager.get_computed_blocks looked up {seen.max_length} "
                f"tokens of a {max_length + 1}-token prompt; the lookup asks for {max_length} "
                "(num_tokens - 1)"
            )
        null = pool.null_block
        masks = [[b is not null for b in blks] for blks in found[0].blocks]
        return masks, int(found[1])

    def _evict(self, pool: Any, taken: list[Any]) -> None:
        """Leave the pool empty: every block the lookup cached evicted
        (``evict_blocks``; ``reset_prefix_cache`` where a release lacks it)."""
        if not taken:
            return
        if pool.get_num_free_blocks() != self._pool_blocks - 1:
            # A lookup failed half-way: start over from a fresh pool.
            self._build_engine(self._pool_blocks)
            return
        evict = getattr(pool, "evict_blocks", None)
        if evict is not None:
            evict({b.block_id for b in taken})
        else:
            pool.reset_prefix_cache()

    def _request(self, block_hashes: list[Hashable], max_length: int) -> Any:
        """A vLLM ``Request`` of ``max_length + 1`` tokens whose block hashes
        are ``block_hashes`` (its ``block_hasher`` gives them)."""
        request_mod, sampling = self._request_modules
        if self._sampling is None:
            self._sampling = sampling.SamplingParams(max_tokens=1)
        return _call_known(
            request_mod.Request,
            "vllm.v1.request.Request",
            request_id="replay-lookup",
            prompt_token_ids=[0] * (max_length + 1),
            sampling_params=self._sampling,
            pooling_params=None,
            eos_token_id=None,
            block_hasher=lambda _request: list(block_hashes),
        )

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


class VllmStoreMirror(VllmCoordinator):
    """``VllmCoordinator`` whose Mooncake lookups enter one level below the
    connector's: the mirror's ``find_longest_cache_hit`` at the trace's
    ``max_length`` over every key the store holds, without the store
    worker's length alignment, lookup masks and retry (what the tests set
    beside the worker's answer)."""

    name = "vllm-mirror"
    mooncake_entry = "coordinator"

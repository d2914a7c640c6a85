"""KV-cache group specs and the trace configuration, validated on construction.

The rules are the ones vLLM 0.33.0 asserts when it builds its coordinator
(``MooncakeStoreCoordinator.__init__`` and the per-kind managers); here they
raise ``ConfigError`` with a message a user can act on instead of asserting.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from replay.base.errors import ConfigError
from replay.base.text import readable


class GroupKind(StrEnum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    MAMBA = "mamba"


GROUP_KINDS = tuple(k.value for k in GroupKind)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpec:
    """One KV-cache group. Its index in ``TraceConfig.groups`` is its ``group_id``."""

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None
    mamba_cache_mode: str | None = None
    is_eagle_group: bool = False
    name: str | None = None

    def __post_init__(self) -> None:
        where = f"group {self.name!r}" if self.name else "group"
        if not isinstance(self.kind, GroupKind):
            raise ConfigError(
                f"{where}: unknown kind {self.kind!r}, expected one of {', '.join(GROUP_KINDS)}"
            )
        if not _is_int(self.block_size) or self.block_size <= 0:
            raise ConfigError(
                f"{where}: block_size must be a positive integer, got {self.block_size!r}"
            )
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not _is_int(self.sliding_window) or (self.sliding_window or 0) <= 0:
                raise ConfigError(
                    f"{where}: sliding_window group needs a positive integer "
                    f"sliding_window, got {self.sliding_window!r}"
                )
            if not _is_int(self.extra_retained_tokens) or self.extra_retained_tokens < 0:
                raise ConfigError(
                    f"{where}: extra_retained_tokens must be an integer >= 0, "
                    f"got {self.extra_retained_tokens!r}"
                )
        if self.kind is GroupKind.CHUNKED_LOCAL_ATTENTION and (
            not _is_int(self.attention_chunk_size) or (self.attention_chunk_size or 0) <= 0
        ):
            raise ConfigError(
                f"{where}: chunked_local_attention group needs a positive integer "
                f"attention_chunk_size, got {self.attention_chunk_size!r}"
            )
        if self.kind is GroupKind.MAMBA and self.mamba_cache_mode not in (None, "align"):
            raise ConfigError(
                f"{where}: mamba_cache_mode must be 'align' (the only mode with prefix "
                f"caching), got {self.mamba_cache_mode!r}"
            )

    @property
    def coverage_window(self) -> int | None:
        """Sliding window widened by the MTP re-prefill tail (vLLM's ``_coverage_spec``)."""
        if self.sliding_window is None:
            return None
        return self.sliding_window + self.extra_retained_tokens

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "block_size": self.block_size}
        if self.kind is GroupKind.SLIDING_WINDOW:
            out["sliding_window"] = self.sliding_window
            out["extra_retained_tokens"] = self.extra_retained_tokens
        if self.kind is GroupKind.CHUNKED_LOCAL_ATTENTION:
            out["attention_chunk_size"] = self.attention_chunk_size
        if self.kind is GroupKind.MAMBA:
            out["mamba_cache_mode"] = self.mamba_cache_mode or "align"
        out["is_eagle_group"] = self.is_eagle_group
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_json(cls, obj: object, index: int) -> GroupSpec:
        where = f"kv_cache_groups[{index}]"
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        kind = obj.get("kind")
        if kind is None:
            raise ConfigError(f"{where}: missing field 'kind'")
        if kind not in GROUP_KINDS:
            raise ConfigError(
                f"{where}: unknown kind {kind!r}, expected one of {', '.join(GROUP_KINDS)}"
            )
        if "block_size" not in obj:
            raise ConfigError(f"{where}: missing field 'block_size'")
        eagle = obj.get("is_eagle_group", False)
        if not isinstance(eagle, bool):
            raise ConfigError(f"{where}: is_eagle_group must be a boolean, got {eagle!r}")
        name = obj.get("name")
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"{where}: name must be a string, got {name!r}")
        try:
            return cls(
                kind=GroupKind(kind),
                block_size=obj["block_size"],
                sliding_window=obj.get("sliding_window"),
                extra_retained_tokens=obj.get("extra_retained_tokens", 0),
                attention_chunk_size=obj.get("attention_chunk_size"),
                mamba_cache_mode=obj.get("mamba_cache_mode"),
                is_eagle_group=eagle,
                name=name,
            )
        except ConfigError as exc:
            raise ConfigError(f"{where}: {str(exc).removeprefix('group: ')}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceConfig:
    """The KV-cache configuration a trace was recorded under."""

    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    scheduler_block_size: int
    use_eagle: bool = False
    enable_partial_hash_hits: bool = False
    #: Tokens past each block that its hash also covers (vLLM's
    #: ``num_hash_lookahead_tokens``, 0.33.0 on: lookahead block hashes for
    #: EAGLE's drafter; 0 keeps the plain hashes). A policy reads it where its
    #: release did: with lookahead hashes the engine drops no EAGLE block
    #: (0.33.0 on, the scheduler clears ``use_eagle``), nor does the Mooncake
    #: store's mirror (0.34.0 on).
    num_hash_lookahead_tokens: int = 0
    source: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("kv_cache_groups: at least one KV-cache group is required")
        for name in ("hash_block_size", "scheduler_block_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("use_eagle", "enable_partial_hash_hits"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        lookahead = self.num_hash_lookahead_tokens
        if not _is_int(lookahead) or lookahead < 0:
            raise ConfigError(
                f"num_hash_lookahead_tokens must be a non-negative integer, got {lookahead!r}"
            )
        hbs, sbs = self.hash_block_size, self.scheduler_block_size
        if sbs % hbs:
            raise ConfigError(
                f"scheduler_block_size {sbs} must be a multiple of hash_block_size {hbs}"
            )
        for gid, g in enumerate(self.groups):
            if g.block_size % hbs:
                raise ConfigError(
                    f"kv_cache_groups[{gid}]: block_size {g.block_size} must be a multiple "
                    f"of hash_block_size {hbs}"
                )
            if sbs % g.block_size:
                raise ConfigError(
                    f"kv_cache_groups[{gid}]: scheduler_block_size {sbs} must be a multiple "
                    f"of block_size {g.block_size}"
                )
        # The chunked-local rules (no EAGLE drop, block equal to the hit
        # alignment) depend on which cache answers: ``coordinator.check_config``.

    def hashed_units(self, num_tokens: int) -> int:
        """The hash units a prompt of ``num_tokens`` carries: the whole units
        of its tokens less the lookahead, whose hashes need the tokens after
        them (vLLM's block hasher)."""
        return max(num_tokens - self.num_hash_lookahead_tokens, 0) // self.hash_block_size

    def max_length_bound(self, num_hashes: int) -> int:
        """The bound ``max_length`` stays below for a lookup of ``num_hashes``
        hashes: the prompt of ``max_length + 1`` tokens the scheduler asks
        for carries them (``hashed_units``), so it ends before the next unit
        and its lookahead: ``(num_hashes + 1) * hash_block_size``, plus the
        lookahead's tokens past the first."""
        extra = max(self.num_hash_lookahead_tokens - 1, 0)
        return (num_hashes + 1) * self.hash_block_size + extra

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": 1,
            "kv_cache_groups": [g.to_json() for g in self.groups],
            "hash_block_size": self.hash_block_size,
            "scheduler_block_size": self.scheduler_block_size,
            "use_eagle": self.use_eagle,
            "enable_partial_hash_hits": self.enable_partial_hash_hits,
        }
        if self.num_hash_lookahead_tokens:
            # Optional: written only when set, so a trace without lookahead
            # hashes reads the same in a version of the tool that predates it.
            out["num_hash_lookahead_tokens"] = self.num_hash_lookahead_tokens
        if self.source is not None:
            out["source"] = dict(self.source)
        return out

    @classmethod
    def from_json(cls, obj: object) -> TraceConfig:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"expected a JSON object, got {type(obj).__name__}")
        if "version" not in obj:
            raise ConfigError("missing field 'version'")
        version = obj.get("version")
        if version != 1:
            raise ConfigError(f"field 'version': expected 1, got {version!r}")
        groups = obj.get("kv_cache_groups")
        if groups is None:
            raise ConfigError("missing field 'kv_cache_groups'")
        if not isinstance(groups, list):
            raise ConfigError(
                f"field 'kv_cache_groups': expected a list, got {type(groups).__name__}"
            )
        for name in ("hash_block_size", "scheduler_block_size", "use_eagle"):
            if name not in obj:
                raise ConfigError(f"missing field {name!r}")
        source = obj.get("source")
        if source is not None and not isinstance(source, Mapping):
            raise ConfigError(
                f"field 'source': expected a JSON object, got {type(source).__name__}"
            )
        return cls(
            groups=tuple(GroupSpec.from_json(g, i) for i, g in enumerate(groups)),
            hash_block_size=obj["hash_block_size"],
            scheduler_block_size=obj["scheduler_block_size"],
            use_eagle=obj["use_eagle"],
            enable_partial_hash_hits=obj.get("enable_partial_hash_hits", False),
            num_hash_lookahead_tokens=obj.get("num_hash_lookahead_tokens", 0),
            source=source,
        )

    def dumps(self) -> str:
        # A file name that is not UTF-8 is recorded escaped: always readable back.
        return json.dumps(readable(self.to_json()), sort_keys=True)


def lookahead_plus(config: TraceConfig) -> str:
    """How a message names the lookahead's part of ``max_length_bound``."""
    extra = config.max_length_bound(0) - config.hash_block_size
    return f" + {extra} lookahead tokens" if extra else ""

"""The model archetypes: the layer mixes vLLM's hybrid coordinator meets in
production, each a named ``TraceConfig`` built by :func:`archetype_config`
(the generator and the Mooncake importers replay a workload through one).

===================  =====================================================
``full``             dense transformers (Llama-3, Qwen-3): full attention
``full+mamba``       Nemotron-H, Jamba, Granite-4.0-H: full attention + Mamba
``full+swa``         Gemma-3 (window 1024), GPT-OSS (128), Mistral (4096)
``full+chunked``     Llama-4: chunked local attention, 8192-token chunks
                     (vLLM rejects it with EAGLE, so does this generator)
``swa+mamba``        Samba-style: sliding window (2048) + Mamba
``full+swa+mamba``   global, local (4096) and Mamba layers in one model
===================  =====================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from replay.base.errors import ConfigError, ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator import CACHES, check_config


@dataclass(frozen=True, slots=True, kw_only=True)
class Archetype:
    name: str
    models: str
    kinds: tuple[GroupKind, ...]
    sliding_window: int | None = None


_F = GroupKind.FULL_ATTENTION
_S = GroupKind.SLIDING_WINDOW
_C = GroupKind.CHUNKED_LOCAL_ATTENTION
_M = GroupKind.MAMBA

# name, the models it stands for, its groups, its sliding window.
_TABLE: tuple[tuple[str, str, tuple[GroupKind, ...], int | None], ...] = (
    ("full", "dense transformers (Llama-3, Qwen-3)", (_F,), None),
    ("full+mamba", "Nemotron-H, Jamba, Granite-4.0-H", (_F, _M), None),
    ("full+swa", "Gemma-3 (window 1024), GPT-OSS, Mistral", (_F, _S), 1024),
    ("full+chunked", "Llama-4 (chunk 8192)", (_F, _C), None),
    ("swa+mamba", "Samba-style (window 2048)", (_S, _M), 2048),
    ("full+swa+mamba", "global + local (window 4096) + Mamba layers", (_F, _S, _M), 4096),
)
ARCHETYPES: Mapping[str, Archetype] = {
    name: Archetype(name=name, models=models, kinds=kinds, sliding_window=window)
    for name, models, kinds, window in _TABLE
}

_GROUP_NAMES = {
    _F: "full_attention",
    _S: "sliding_window",
    _C: "chunked_local_attention",
    _M: "mamba",
}


def get_archetype(name: str) -> Archetype:
    try:
        return ARCHETYPES[name]
    except KeyError:
        raise ReplayError(
            f"unknown model {name!r}, expected one of {', '.join(ARCHETYPES)}"
        ) from None


def archetype_config(
    name: str,
    block_size: int = 16,
    hash_block_size: int | None = None,
    use_eagle: bool = False,
    *,
    sliding_window: int | None = None,
    extra_retained_tokens: int = 0,
    attention_chunk_size: int = 8192,
    mamba_block_size: int | None = None,
    source: Mapping[str, Any] | None = None,
) -> TraceConfig:
    """The ``TraceConfig`` of a named model archetype.

    Attention groups use ``block_size``; the Mamba group ``mamba_block_size``
    (default ``block_size``; vLLM raises it to match the state's page size,
    e.g. a multiple of the attention block). The scheduler block size is the
    LCM of the group block sizes, ``hash_block_size`` defaults to
    ``block_size``. Raises ``ReplayError`` for an unknown name, EAGLE with
    chunked local attention, or sizes vLLM would reject."""
    arch = get_archetype(name)
    hbs = block_size if hash_block_size is None else hash_block_size
    mbs = block_size if mamba_block_size is None else mamba_block_size
    window = sliding_window if sliding_window is not None else arch.sliding_window
    groups: list[GroupSpec] = []
    for kind in arch.kinds:
        common: dict[str, Any] = {"kind": kind, "name": _GROUP_NAMES[kind]}
        if kind is _M:
            groups.append(GroupSpec(block_size=mbs, mamba_cache_mode="align", **common))
        elif kind is _S:
            groups.append(
                GroupSpec(
                    block_size=block_size,
                    sliding_window=window,
                    extra_retained_tokens=extra_retained_tokens,
                    **common,
                )
            )
        elif kind is _C:
            groups.append(
                GroupSpec(
                    block_size=block_size, attention_chunk_size=attention_chunk_size, **common
                )
            )
        else:
            groups.append(GroupSpec(block_size=block_size, **common))
    config = TraceConfig(
        groups=tuple(groups),
        hash_block_size=hbs,
        scheduler_block_size=math.lcm(*(g.block_size for g in groups)),
        use_eagle=use_eagle,
        source=source,
    )
    # No group is flagged, so every group takes the EAGLE drop (the
    # coordinator's one rule), which vLLM refuses for chunked local attention.
    if use_eagle and not _accepted(config) and _accepted(replace(config, use_eagle=False)):
        raise ReplayError(
            f"model {name!r} has chunked local attention, which vLLM does not combine "
            "with EAGLE: use --no-eagle"
        )
    return config


def _accepted(config: TraceConfig) -> bool:
    """Whether both of vLLM's caches accept the configuration."""
    try:
        for cache in CACHES:
            check_config(config, cache)
    except ConfigError:
        return False
    return True

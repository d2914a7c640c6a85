"""The model archetypes (``replay.sources.archetypes``)."""

from __future__ import annotations

import pytest

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind
from replay.sources.archetypes import ARCHETYPES, archetype_config

F, S, C, M = (
    GroupKind.FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL_ATTENTION,
    GroupKind.MAMBA,
)


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("full", (F,)),
        ("full+mamba", (F, M)),
        ("full+swa", (F, S)),
        ("full+chunked", (F, C)),
        ("swa+mamba", (S, M)),
        ("full+swa+mamba", (F, S, M)),
    ],
)
@pytest.mark.parametrize("eagle", [False, True])
def test_archetype_configs_are_valid(name: str, kinds: tuple[GroupKind, ...], eagle: bool) -> None:
    if name == "full+chunked" and eagle:
        with pytest.raises(ReplayError) as err:
            archetype_config(name, use_eagle=eagle)
        assert str(err.value) == (
            "model 'full+chunked' has chunked local attention, which vLLM does not combine "
            "with EAGLE: use --no-eagle"
        )
        return
    config = archetype_config(name, use_eagle=eagle)
    assert tuple(g.kind for g in config.groups) == kinds
    assert [g.block_size for g in config.groups] == [16] * len(kinds)
    assert config.hash_block_size == 16
    assert config.scheduler_block_size == 16
    assert config.use_eagle is eagle
    windows = {"full+swa": 1024, "swa+mamba": 2048, "full+swa+mamba": 4096}
    for g in config.groups:
        if g.kind is S:
            assert g.sliding_window == windows[name]
        if g.kind is C:
            assert g.attention_chunk_size == 8192
        if g.kind is M:
            assert g.mamba_cache_mode == "align"


def test_archetype_names() -> None:
    assert list(ARCHETYPES) == [
        "full",
        "full+mamba",
        "full+swa",
        "full+chunked",
        "swa+mamba",
        "full+swa+mamba",
    ]


def test_archetype_block_sizes() -> None:
    config = archetype_config("full+mamba", 16, 8, True, mamba_block_size=64)
    assert [g.block_size for g in config.groups] == [16, 64]
    assert config.hash_block_size == 8
    assert config.scheduler_block_size == 64


def test_unknown_model() -> None:
    with pytest.raises(ReplayError) as err:
        archetype_config("mamba-only")
    assert str(err.value) == (
        "unknown model 'mamba-only', expected one of full, full+mamba, full+swa, "
        "full+chunked, swa+mamba, full+swa+mamba"
    )

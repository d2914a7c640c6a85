"""Config validity: exactly what vLLM 0.33 rejects, no more."""

from __future__ import annotations

import pytest

from replay.base.errors import ConfigError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.rules.coordinator import check_config, hit_alignment

CHUNKED = GroupSpec(kind=GroupKind.CHUNKED_LOCAL_ATTENTION, block_size=16, attention_chunk_size=64)


def _config(*groups: GroupSpec, use_eagle: bool) -> TraceConfig:
    return TraceConfig(
        groups=groups, hash_block_size=16, scheduler_block_size=16, use_eagle=use_eagle
    )


def test_chunked_accepted_when_only_another_group_is_eagle() -> None:
    # vLLM's Mooncake coordinator answers this: the chunked group never drops.
    full = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16, is_eagle_group=True)
    assert _config(full, CHUNKED, use_eagle=True).num_groups == 2


@pytest.mark.parametrize(
    ("groups", "use_eagle"),
    [
        ((CHUNKED,), True),
        ((GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16), CHUNKED), True),
        (
            (
                GroupSpec(
                    kind=GroupKind.CHUNKED_LOCAL_ATTENTION,
                    block_size=16,
                    attention_chunk_size=64,
                    is_eagle_group=True,
                ),
            ),
            False,
        ),
    ],
)
def test_chunked_rejected_when_its_spec_group_drops_for_eagle(
    groups: tuple[GroupSpec, ...], use_eagle: bool
) -> None:
    config = _config(*groups, use_eagle=use_eagle)
    with pytest.raises(ConfigError, match=r"chunked_local_attention does not combine with EAGLE"):
        check_config(config, "mooncake")
    if use_eagle:
        with pytest.raises(ConfigError, match=r"does not combine with EAGLE .* the gpu cache"):
            check_config(config, "gpu")
    else:
        # The engine drops nothing while use_eagle is off, flagged or not.
        check_config(config, "gpu")


def test_config_json_round_trip() -> None:
    config = TraceConfig(
        groups=(
            GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32, name="attn"),
            GroupSpec(
                kind=GroupKind.SLIDING_WINDOW,
                block_size=16,
                sliding_window=128,
                extra_retained_tokens=16,
            ),
            GroupSpec(
                kind=GroupKind.MAMBA, block_size=32, mamba_cache_mode="align", is_eagle_group=True
            ),
        ),
        hash_block_size=16,
        scheduler_block_size=32,
        use_eagle=True,
        enable_partial_hash_hits=True,
        source={"tool": "test"},
    )
    again = TraceConfig.from_json(config.to_json())
    assert again == config
    # The partial-hits flag survives: both caches align hits to the hash unit.
    assert (hit_alignment(again, "mooncake"), hit_alignment(again, "gpu")) == (16, 16)
    assert again.source == {"tool": "test"}

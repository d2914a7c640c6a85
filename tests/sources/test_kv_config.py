"""The KV-cache config of a recording (``replay.sources.kv_config``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.base.errors import ConfigError
from replay.format.writer import write_trace
from replay.sources.kv_config import load_config
from tests.kvpayloads import two_groups


def test_load_config_from_json_from_a_trace_and_from_block_size(tmp_path: Path) -> None:
    cfg = two_groups()
    (tmp_path / "kv.json").write_text(json.dumps(cfg.to_json()))
    assert load_config(tmp_path / "kv.json", None) == cfg
    write_trace(tmp_path / "t.parquet", cfg, [])
    assert load_config(tmp_path / "t.parquet", None) == cfg
    single = load_config(None, 32)
    assert single.to_json()["kv_cache_groups"] == [
        {"kind": "full_attention", "block_size": 32, "is_eagle_group": False}
    ]
    assert (single.hash_block_size, single.scheduler_block_size) == (32, 32)


def test_load_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"version": 1, "kv_cache_groups": []}))
    cases = [
        ((None, None), "no KV-cache config: pass --config kv-config.json (the replay.trace metadata object) or --block-size N (one full-attention group)"),
        ((str(bad), 16), "pass either --config or --block-size, not both"),
        ((str(tmp_path / "nope.json"), None), f"{tmp_path}/nope.json: no such file"),
        ((str(bad), None), f"{bad}: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ((str(wrong), None), f"{wrong}: missing field 'hash_block_size'"),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(ConfigError) as info:
            load_config(*args)
        assert str(info.value) == message

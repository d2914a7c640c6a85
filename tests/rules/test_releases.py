"""The release policies: which vLLM release each models, the #43559 lookup in
every release and cache, and `replay run` answering as the trace's release."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from replay.base.errors import ConfigError, ReplayError
from replay.format.results import read_results
from replay.format.writer import write_trace
from replay.rules.coordinator import (
    POLICIES,
    RELEASES,
    Coordinator,
    get_policy,
    policy_for_version,
    policy_rules,
    version_policy,
)
from replay.rules.coordinator.stores import policy_stores
from tests.builders import full_mamba, issue_43559_rows
from tests.conftest import run_cli


@pytest.mark.parametrize(
    ("version", "policy"),
    [
        ("0.16.0", "vllm-0.16"),
        ("0.19.1", "vllm-0.16"),
        ("0.21.0", "vllm-0.20"),
        ("0.22.1", "vllm-0.22"),
        ("0.23.0", "vllm-0.23"),
        ("0.24.0", "vllm-0.24"),
        ("0.25.0", "vllm-0.24"),
        ("0.25.1", "vllm-0.24"),
        ("0.26.0", "vllm-0.26"),
        ("0.27.1", "vllm-0.27"),
        ("0.28.0", "vllm-0.28"),
        ("0.29.0", "vllm-0.29"),
        ("0.31.0", "vllm-0.30"),
        ("0.32.0", "vllm-0.32"),
        ("0.33.0", "vllm-0.33"),
        ("0.34.0", "vllm-0.34"),
        ("0.30.1.dev3+g1234abc", "vllm-0.30"),
        ("0.34.1.dev3+g1234abc", "vllm-0.34"),
        ("0.35.0", "vllm-0.34"),
        ("0.1.dev1+g1234abc", "vllm-0.34"),
        ("v0.27.0", "vllm-0.27"),
    ],
)
def test_a_version_maps_to_its_release_policy(version: str, policy: str) -> None:
    assert policy_for_version(version).name == policy


@pytest.mark.parametrize(
    ("version", "line"),
    [
        ("0.34.0", ""),
        ("0.25.0", ""),
        (
            "0.1.dev1+gabc1234",
            "vLLM 0.1.dev1+gabc1234 is a development build with no release tag: assuming "
            "policy vllm-0.34 (vLLM 0.34.0, the newest modelled); choose another with "
            "--policy or REPLAY_POLICY",
        ),
        (
            "0.34.1.dev3+gabc1234",
            "vLLM 0.34.1.dev3+gabc1234 is newer than vLLM 0.34.0, the newest modelled "
            "release: assuming policy vllm-0.34 (vLLM 0.34.0); choose another with "
            "--policy or REPLAY_POLICY",
        ),
        (
            "0.36.0",
            "vLLM 0.36.0 is newer than vLLM 0.34.0, the newest modelled release: assuming "
            "policy vllm-0.34 (vLLM 0.34.0); choose another with --policy or REPLAY_POLICY",
        ),
        (
            "0.30.1.dev3+gabc1234",
            "vLLM 0.30.1.dev3+gabc1234 is a development build: assuming policy vllm-0.30 "
            "(vLLM 0.30.0 - 0.31.0); choose another with --policy or REPLAY_POLICY",
        ),
    ],
)
def test_a_version_no_policy_models_gets_one_with_the_line_that_says_so(
    version: str, line: str
) -> None:
    assert version_policy(version).note == line


def test_a_chosen_policy_wins_over_the_version() -> None:
    chosen = version_policy("0.1.dev1+gabc1234", "vllm-0.32")
    assert chosen.policy.name == "vllm-0.32"
    assert chosen.note == (
        "vLLM 0.1.dev1+gabc1234: checked as policy vllm-0.32 (vLLM 0.32.0), as chosen"
    )
    with pytest.raises(ReplayError, match=r"unknown policy 'vllm-9\.9'"):
        version_policy("0.33.0", "vllm-9.9")


def test_versions_before_the_oldest_release_or_malformed_are_refused() -> None:
    with pytest.raises(ReplayError, match=r"vLLM 0.15.1 is older than the oldest modelled"):
        policy_for_version("0.15.1")
    with pytest.raises(ReplayError, match=r"expected MAJOR.MINOR\[.PATCH\]"):
        policy_for_version("main")


def test_release_ranges_are_contiguous_and_named_by_their_first_release() -> None:
    assert [p.name for p in RELEASES] == [
        "vllm-0.16",
        "vllm-0.20",
        "vllm-0.22",
        "vllm-0.23",
        "vllm-0.24",
        "vllm-0.26",
        "vllm-0.27",
        "vllm-0.28",
        "vllm-0.29",
        "vllm-0.30",
        "vllm-0.32",
        "vllm-0.33",
        "vllm-0.34",
    ]
    for policy in RELEASES:
        assert policy.name == "vllm-" + ".".join(policy.first.split(".")[:2])
        assert policy.prs and policy.description.startswith("vLLM 0.")
    # The mirror exists from 0.22.0 on.
    assert [p.mooncake is not None for p in RELEASES] == [False, False] + [True] * 11


#: The #43559 lookup (full attention + Mamba, EAGLE, four blocks stored,
#: max_length 64) per policy and cache: 64 is the overrun.
OVERRUN = {
    "vllm-0.16": {"gpu": 48},
    "vllm-0.20": {"gpu": 64},
    "vllm-0.22": {"gpu": 64, "mooncake": 64},
    "vllm-0.23": {"gpu": 64, "mooncake": 64},
    "vllm-0.24": {"gpu": 64, "mooncake": 64},
    "vllm-0.26": {"gpu": 48, "mooncake": 64},
    "vllm-0.27": {"gpu": 48, "mooncake": 48},
    "vllm-0.28": {"gpu": 48, "mooncake": 48},
    "vllm-0.29": {"gpu": 48, "mooncake": 48},
    "vllm-0.30": {"gpu": 48, "mooncake": 48},
    "vllm-0.32": {"gpu": 48, "mooncake": 48},
    "vllm-0.33": {"gpu": 48, "mooncake": 48},
    "vllm-0.34": {"gpu": 48, "mooncake": 48},
    "pre-49502": {"gpu": 64, "mooncake": 64},
    "pre-32802": {"gpu": 48},
    "vllm-0.33-no-mamba-gate": {"gpu": 64, "mooncake": 64},
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_the_43559_lookup_in_every_release(policy: str, cache: str) -> None:
    config = full_mamba()
    hashes = [bytes([i]) * 32 for i in range(4)]
    contains = [set(hashes).__contains__] * 2
    want = OVERRUN[policy].get(cache)
    if want is None:
        with pytest.raises(ConfigError, match=r"has no Mooncake store mirror: .*#42828"):
            Coordinator(config, policy, cache)
        return
    outcome = Coordinator(config, policy, cache).lookup(hashes, 64, contains)
    assert (outcome.hit_tokens, outcome.mamba_state_tokens, outcome.verified_tokens) == (
        want,
        want,
        48,
    )


def test_each_release_departs_from_the_next_in_some_rule() -> None:
    """Every boundary is a real change: a release's lookup rules differ from
    the next release's in at least one cache, or its stores do (0.23.0 looks
    up as 0.24-0.25 but stores otherwise)."""
    for older, newer in itertools.pairwise(RELEASES):
        assert (older.gpu, older.mooncake, policy_stores(older)) != (
            newer.gpu,
            newer.mooncake,
            policy_stores(newer),
        ), older.name
    assert (get_policy("vllm-0.23").gpu, get_policy("vllm-0.23").mooncake) == (
        get_policy("vllm-0.24").gpu,
        get_policy("vllm-0.24").mooncake,
    )
    assert policy_rules("vllm-0.26", "gpu").mamba_peek_margin is False
    assert policy_rules("vllm-0.26", "mooncake").mamba_peek_margin is True


def test_the_aliases_are_the_release_rules_they_mean() -> None:
    """pre-49502: the newest rules with the #43559 overrun in each cache;
    pre-32802: the releases before #40860, engine only."""
    pre_49502, pre_32802 = get_policy("pre-49502"), get_policy("pre-32802")
    assert pre_49502.gpu is get_policy("vllm-0.24").gpu
    assert pre_49502.mooncake is get_policy("vllm-0.26").mooncake
    assert [pre_49502.release(c).name for c in ("gpu", "mooncake")] == ["vllm-0.24", "vllm-0.26"]
    assert pre_32802.gpu is get_policy("vllm-0.16").gpu and pre_32802.mooncake is None
    with pytest.raises(ConfigError, match=r"^policy pre-32802 \(vLLM 0.16.0 - 0.19.1\) has no "):
        pre_32802.rules("mooncake")
    # The newest: the next release has the gate in that cache.
    assert policy_rules("vllm-0.24", "gpu").mamba_peek_margin is True
    assert policy_rules("vllm-0.26", "gpu").mamba_peek_margin is False
    assert policy_rules("vllm-0.26", "mooncake").mamba_peek_margin is True
    assert policy_rules("vllm-0.27", "mooncake").mamba_peek_margin is False
    assert pre_49502.alias_note == (
        "policy pre-49502 means vllm-0.24 (vLLM 0.24.0 - 0.25.1) in the gpu cache, whose "
        "Mamba gate came with #46384 in 0.26.0, and vllm-0.26 (vLLM 0.26.0) in the mooncake "
        "cache, whose gate came with #49502 in 0.27.0"
    )
    assert pre_32802.alias_note == (
        "policy pre-32802 means vllm-0.16 (vLLM 0.16.0 - 0.19.1): #32802 is the issue, "
        "#40860 in 0.20.0 the fix; the Mooncake mirror did not exist yet"
    )


def _trace(tmp_path: Path, version: str | None) -> Path:
    source = {"cache": "mooncake"} | ({"vllm_version": version} if version else {})
    return write_trace(tmp_path / "t.parquet", full_mamba(source=source), issue_43559_rows())


def _hit(path: Path) -> tuple[str, int]:
    frame, info = read_results(path)
    return info["policy"], frame["hit_tokens"][0]


def test_run_answers_as_the_traces_release_and_says_so(tmp_path: Path) -> None:
    trace, out = _trace(tmp_path, "0.26.0"), tmp_path / "r.parquet"
    result = run_cli(["run", trace, "-o", out, "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "policy vllm-0.26: the trace's vLLM 0.26.0 (source.vllm_version, vLLM 0.26.0); "
        "--policy or --vllm overrides"
    ]
    assert json.loads(result.stdout)["variants"][0]["policy"] == "vllm-0.26"
    assert _hit(out) == ("vllm-0.26", 64)  # the 0.26 mirror still overruns
    # --vllm and --policy override the recorded release.
    assert run_cli(["run", trace, "-o", out, "-q", "--vllm", "0.27.1"]).exit_code == 0
    assert _hit(out) == ("vllm-0.27", 48)
    assert run_cli(["run", trace, "-o", out, "-q", "--policy", "vllm-0.22"]).exit_code == 0
    assert _hit(out) == ("vllm-0.22", 64)


def test_run_without_a_recorded_release_uses_the_default(tmp_path: Path) -> None:
    trace, out = _trace(tmp_path, None), tmp_path / "r.parquet"
    result = run_cli(["run", trace, "-o", out, "-q"])
    assert (result.exit_code, result.stderr) == (0, "")
    assert _hit(out) == ("vllm-0.33", 48)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--vllm", "0.26.0", "--policy", "vllm-0.33"],
            "--vllm and --policy both choose the policy: give one",
        ),
        (["--vllm", "0.12.0"], "--vllm: vLLM 0.12.0 is older than the oldest modelled release"),
        (
            ["--policy", "vllm-0.20", "--cache", "mooncake"],
            "policy vllm-0.20 (vLLM 0.20.0 - 0.21.0) has no Mooncake store mirror",
        ),
    ],
)
def test_run_refuses_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    trace, out = _trace(tmp_path, None), tmp_path / "r.parquet"
    result = run_cli(["run", trace, "-o", out, *args])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_an_alias_says_what_it_means(tmp_path: Path) -> None:
    trace, out = _trace(tmp_path, None), tmp_path / "r.parquet"
    result = run_cli(["run", trace, "-o", out, "--policy", "pre-32802", "--cache", "gpu", "--json"])
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [get_policy("pre-32802").alias_note]
    assert _hit(out) == ("pre-32802", 48)
    # Its releases had no Mooncake mirror: the one line, nothing written.
    refused = run_cli(["run", trace, "-o", out, "--policy", "pre-32802", "-q"])
    assert (refused.exit_code, refused.stderr) == (
        2,
        f"error: {trace}: replay.trace metadata: policy pre-32802 (vLLM 0.16.0 - 0.19.1) has "
        "no Mooncake store mirror: it came with #42828 in vLLM 0.22.0; use --cache gpu\n",
    )


TRACES = sorted((Path(__file__).resolve().parents[2] / "traces").glob("*.parquet"))


@pytest.mark.slow
@pytest.mark.parametrize("trace", TRACES, ids=[t.stem for t in TRACES])
def test_pre_49502_answers_as_its_releases_on_every_bundled_trace(trace: Path) -> None:
    """pre-49502 answers every lookup of every bundled trace as vllm-0.24 in
    the engine and vllm-0.26 in the mirror, pre-32802 as vllm-0.16 in the
    engine (hit, masks, group hits, facts), and each refuses what its
    release refuses."""
    from replay.engine.run import ReplayOptions, Variant, replay
    from replay.format.tracedir import open_trace

    config = open_trace(trace).config
    variants = []
    for alias, release, cache in (("pre-49502", "vllm-0.24", "gpu"), ("pre-49502", "vllm-0.26", "mooncake"), ("pre-32802", "vllm-0.16", "gpu")):  # fmt: skip
        try:
            Coordinator(config, release, cache)
        except ConfigError as exc:
            with pytest.raises(ConfigError, match=re.escape(str(exc).split(": ")[-1])):
                Coordinator(config, alias, cache)
            continue
        variants += [Variant(policy=alias, cache=cache), Variant(policy=release, cache=cache)]
    if not variants:
        return
    results = replay(trace, ReplayOptions(variants=tuple(variants)))
    for by_alias, by_release in zip(results[::2], results[1::2], strict=True):
        assert by_alias.policy.startswith("pre-") and by_alias.cache == by_release.cache
        assert by_alias.results.height > 0
        mine, theirs = (r.results.drop("policy") for r in (by_alias, by_release))
        assert mine.equals(theirs), (trace.name, by_alias.policy, by_alias.cache)


#: Full attention + Mamba with EAGLE, four of a prompt's five hash units
#: stored, max_length 79: the drop costs a block (48), no drop keeps 64.
LOOKAHEAD = {
    "vllm-0.32": {"gpu": (48, 48), "mooncake": (48, 48)},
    # The engine's scheduler turns the drop off under lookahead hashes (0.33.0
    # on); 0.33.0's mirror never got them and drops whatever the trace says.
    "vllm-0.33": {"gpu": (48, 64), "mooncake": (48, 48)},
    # 0.34.0's mirror: `use_eagle and not num_hash_lookahead_tokens`.
    "vllm-0.34": {"gpu": (48, 64), "mooncake": (48, 64)},
}


@pytest.mark.parametrize("policy", list(LOOKAHEAD))
@pytest.mark.parametrize("cache", ["gpu", "mooncake"])
def test_lookahead_hashes_turn_the_eagle_drop_off_where_the_release_did(
    policy: str, cache: str
) -> None:
    hashes = [bytes([i]) * 32 for i in range(5)]
    contains = [set(hashes[:4]).__contains__] * 2
    hits = tuple(
        Coordinator(replace(full_mamba(), num_hash_lookahead_tokens=n), policy, cache)
        .lookup(hashes, 79, contains)
        .hit_tokens
        for n in (0, 4)
    )
    assert hits == LOOKAHEAD[policy][cache]

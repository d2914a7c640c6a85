"""replay run / check / minimize: the summaries a user reads after a replay."""

from __future__ import annotations

import json
import re
from pathlib import Path

from replay.rules.coordinator import get_policy
from tests.conftest import run_cli

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_run_summary_text_and_json(tmp_path: Path) -> None:
    trace = Path(__file__).parent.parent.parent / "traces" / "observed-43559-in-production.parquet"
    out = tmp_path / "r.parquet"
    payload = json.loads(run_cli(["run", str(trace), "-o", str(out), "--json"]).stdout)
    assert (payload["version"], payload["command"], payload["trace"]) == (1, "run", str(trace))
    (data,) = payload["variants"]
    assert {
        k: data[k]
        for k in ("lookups", "lookups_with_hit", "prompt_tokens", "hit_tokens", "hit_ratio")
    } == {
        "lookups": 1,
        "lookups_with_hit": 1,
        "prompt_tokens": 65,
        "hit_tokens": 48,
        "hit_ratio": round(48 / 65, 6),
    }
    assert data["events_by_kind"] == {"store": 2, "remove": 0, "clear": 0, "lookup": 1}
    assert data["observed"] == {"lookups": 1, "mismatches": 1}
    assert data["flags"] == [{"flag": "observed_mismatch", "severity": "observed", "lookups": 1}]
    assert data["groups"][1] == {
        "group_id": 1,
        "kind": "mamba",
        "block_size": 16,
        "loaded_blocks": 1,
        "skipped_blocks": 2,
        "loaded_tokens": 16,
        "verified_tokens": 48,
    }
    assert data["results"] == str(out)
    text = run_cli(["run", str(trace), "-o", str(out)]).stdout.splitlines()
    assert "prompt tokens: 65, hit tokens: 48 (hit ratio 73.85%)" in text
    assert "observed hits: 1 reported, 1 differ from the replay" in text
    assert "flags: observed_mismatch 1 (observed)" in text
    assert (
        "  observed_mismatch: request prod-1 seq 2: replayed hit 48 but production reported 64"
        in text
    )


def test_run_summary_is_these_lines(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    result = run_cli(["run", str(TRACES / "issue-43559.parquet"), "--policy", "pre-49502", "-o", str(out)])  # fmt: skip
    # The emulation says, on stderr only, which releases it stands for (issue 23).
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [get_policy("pre-49502").alias_note]
    text = re.sub(r"time: .*", "time: T", result.stdout)
    assert text.splitlines() == [
        "replayed 3 events (store 2, remove 0, clear 0, lookup 1) with reference coordinator, policy pre-49502, mooncake cache",
        "lookups: 1 (1 with a hit)",
        "prompt tokens: 65, hit tokens: 64 (hit ratio 98.46%)",
        "  group 0 full_attention block=16: loaded 3 blocks (48 tokens), skipped 0",
        "  group 1 mamba block=16: loaded 1 block (16 tokens), skipped 3",
        "time: T",
        "flags: mamba_overrun 1 (corruption), eagle_not_dropped 1 (performance)",
        "flagged lookups (first examples):",
        "  mamba_overrun: request req-43559 seq 2: group 1 resumes Mamba state at 64, 16 tokens past the attention KV loaded for 48 tokens",
        "  eagle_not_dropped: request req-43559 seq 2: hit 64 reaches group 0's whole match: EAGLE recomputes nothing past it",
        f"results: {out}",
    ]


def test_check_and_minimize_summaries(tmp_path: Path) -> None:
    trace = TRACES / "issue-43559.parquet"
    flagged = run_cli(["check", str(trace), "--policy", "pre-49502", "--examples", "0"])
    assert (flagged.exit_code, flagged.stdout) == (
        1,
        f"{trace}: 1 flagged lookup under pre-49502: mamba_overrun 1 (corruption), eagle_not_dropped 1 (performance)\n"
        "fail (--fail-on corruption): 1 lookup with mamba_overrun 1 (corruption)\n",
    )
    clean = run_cli(["check", str(trace)])
    assert (clean.exit_code, clean.stdout) == (0, f"{trace}: clean under vllm-0.33 (no flags)\n")
    out = tmp_path / "min.parquet"
    # A trace is shrunk under the current release unless told otherwise
    # (before, pre-49502 was the default): there the lookup is clean.
    clean = run_cli(["minimize", str(trace), "--request", "req-43559", "-o", str(out)])
    assert (clean.exit_code, clean.stderr) == (
        2,
        f"error: {trace}: request 'req-43559' raises no flag under vllm-0.33: nothing to minimize\n",
    )
    small = run_cli(["minimize", str(trace), "--request", "req-43559", "--policy", "pre-49502", "-o", str(out)])  # fmt: skip
    # Every pinned policy in both caches, with the original lookup's answers
    # (issue 31: the lookup is no longer shortened to a hit of 0 and 16);
    # pre-32802's releases had no Mooncake mirror, so it is pinned in gpu only.
    assert small.stdout.splitlines() == [
        f"{trace}: 3 events -> {out}: 3 events",
        "  vllm-0.33 (mooncake): no flags; hit 48",
        "  vllm-0.34 (mooncake): no flags; hit 48",
        "  pre-49502 (mooncake): eagle_not_dropped, mamba_overrun; hit 64",
        "  vllm-0.33 (gpu): no flags; hit 48",
        "  vllm-0.34 (gpu): no flags; hit 48",
        "  pre-49502 (gpu): eagle_not_dropped, mamba_overrun; hit 64",
        "  pre-32802 (gpu): no flags; hit 48",
    ]

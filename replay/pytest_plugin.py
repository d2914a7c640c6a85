"""pytest plugin: every trace with an expectation becomes a test, per policy.

A trace opts in with an Arrow metadata key ``replay.expect`` (JSON)::

    {"expect": [
        {"policy": "vllm-0.33", "flags": {}},
        {"policy": "pre-49502", "flags": {"mamba_overrun": 1},
         "hits": {"req-43559": 64}}
    ]}

``flags`` is the exact count of flagged lookups per flag kind (``{}``: clean);
``hit_tokens`` the total hit over every lookup; ``group_hit_tokens`` per
group the total of that group's own finder hit; ``hits`` pins the replayed hit
of named requests (the last lookup of each); ``cache`` picks the cache that
answers (default: the trace's own). Any may be left out. Registered through the ``pytest11`` entry point, so
``pip install cache-trace-replay`` then ``pytest traces/`` runs a corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replay.format.schema import EXPECT_META_KEY
from replay.format.trace import TraceReader


def read_expectations(path: Path) -> list[dict[str, Any]] | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(str(path)).metadata or {}
    except Exception:  # not a Parquet file: not ours to collect
        return None
    raw = meta.get(EXPECT_META_KEY)
    if raw is None:
        return None
    data = json.loads(raw)
    entries = data.get("expect") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: replay.expect must be an object with an 'expect' list")
    return entries


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Collector | None:
    if file_path.suffix != ".parquet" or file_path.name.endswith(".results.parquet"):
        return None
    if read_expectations(file_path) is None:
        return None
    return TraceFile.from_parent(parent, path=file_path)


class TraceFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        for entry in read_expectations(self.path) or []:
            label = str(entry.get("policy", "vllm-0.33"))
            if entry.get("cache"):
                label += f"-{entry['cache']}"
            yield TraceItem.from_parent(self, name=f"{self.path.stem}[{label}]", entry=entry)


#: How many wrong requests a failure lists, and how many it explains.
SHOWN = 10
EXPLAINED = 3


class ExpectationMismatch(Exception):
    pass


class TraceItem(pytest.Item):
    def __init__(self, *, entry: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entry = entry
        self.policy = str(entry.get("policy", "vllm-0.33"))
        #: the cache that answers; unset: the trace's own (``source.cache``)
        self.cache = str(entry["cache"]) if entry.get("cache") else None

    def runtest(self) -> None:
        from analysis.flags import flag_counts, result_flags
        from replay.engine.run import ReplayOptions, replay
        from replay.format.tracedir import open_trace

        reader = open_trace(self.path)  # once: replayed, then explained on a failure
        options = ReplayOptions(policies=(self.policy,), caches=(self.cache,))
        (result,) = replay(reader, options)
        flags = result_flags(result)
        problems: list[str] = []
        explain_ids: list[str] = []
        if "flags" in self.entry:
            want = {k: int(v) for k, v in self.entry["flags"].items() if v}
            got = flag_counts(flags)
            if got != want:
                problems.append(f"flags: expected {want or 'none'}, replayed {got or 'none'}")
                explain_ids += flags["request_id"].unique(maintain_order=True).head(3).to_list()
        res = result.results
        if "hit_tokens" in self.entry:
            got_total = int(res["hit_tokens"].sum() or 0)
            if got_total != int(self.entry["hit_tokens"]):
                problems.append(
                    f"hit tokens: expected {self.entry['hit_tokens']} in all, replayed {got_total}"
                )
        if "group_hit_tokens" in self.entry:
            per_lookup = res["group_hit_tokens"].to_list()
            got_groups = [sum(col) for col in zip(*per_lookup, strict=True)] if per_lookup else []
            if got_groups != [int(v) for v in self.entry["group_hit_tokens"]]:
                problems.append(
                    f"group hit tokens: expected {self.entry['group_hit_tokens']} per group, "
                    f"replayed {got_groups}"
                )
        last = dict(zip(res["request_id"].to_list(), res["hit_tokens"].to_list(), strict=True))
        wrong: list[str] = []
        for request_id, want_hit in (self.entry.get("hits") or {}).items():
            if request_id not in last:
                wrong.append(f"request {request_id}: not in the trace")
            elif int(last[request_id]) != int(want_hit):
                wrong.append(
                    f"request {request_id}: expected hit {want_hit}, replayed {last[request_id]}"
                )
                explain_ids.append(request_id)
        problems += wrong[:SHOWN]
        if len(wrong) > SHOWN:
            problems.append(f"... and {len(wrong) - SHOWN} more requests with another hit")
        explain_ids = list(dict.fromkeys(explain_ids))[:EXPLAINED]
        if problems:
            raise ExpectationMismatch("\n".join(problems + self._explain(reader, explain_ids)))

    def _explain(self, reader: TraceReader, request_ids: list[str]) -> list[str]:
        from replay.engine.replay import explain_lookups
        from replay.tools.render import explain_table

        wanted = set(request_ids)
        config, found = explain_lookups(
            reader, lambda e: e.request_id in wanted, self.policy, cache=self.cache
        )
        last = {lookup.request_id: outcome for lookup, outcome, _ in found}
        out = []
        for rid in dict.fromkeys(request_ids):
            if rid in last:
                out += [
                    "",
                    f"replay explain {self.path.name} --request {rid} --policy {self.policy}"
                    + (f" --cache {self.cache}" if self.cache else "")
                    + ":",
                ]
                out.append(explain_table(config, last[rid]))
        return out

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ExpectationMismatch):
            where = f" in the {self.cache} cache" if self.cache else ""
            return f"{self.path.name} under policy {self.policy}{where}:\n{excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"trace {self.path.name} [{self.policy}]"

"""A diff as ``replay diff`` prints it: who A and B are, the totals, what
explains the changes (flags, groups, cache rules) and the first changed
lookups. The diff itself is computed in ``analysis.diff``."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from analysis.diff import DiffResult
from replay.tools.render import table


def _signed(n: int) -> str:
    return f"+{n}" if n > 0 else str(n)


def _flags_text(flags: Sequence[str]) -> str:
    return ",".join(flags) if flags else "-"


def render_text(diff: DiffResult, limit: int = 20) -> str:
    s = diff.summary()
    a, b = diff.a, diff.b
    lines = [
        f"diff of trace {diff.trace}",
        f"  A = {a.label}: policy {a.policy}, coordinator {a.coordinator}, cache {a.cache} "
        f"({a.source})",
        f"  B = {b.label}: policy {b.policy}, coordinator {b.coordinator}, cache {b.cache} "
        f"({b.source})",
        f"lookups: {s['lookups']} compared, {s['changed']} with a different hit "
        f"(B higher on {s['b_higher']}, lower on {s['b_lower']})",
        f"hit tokens: A {s['hit_tokens_a']}, B {s['hit_tokens_b']}: net {_signed(s['net'])} "
        f"(B gains {s['gained']}, loses {s['lost']})",
    ]
    if s["same_hit_groups_changed"]:
        lines.append(
            f"same hit, different group masks or group hits: {s['same_hit_groups_changed']} lookups"
        )
    if not diff.changed:
        lines.append("no lookup's hit differs")
        return "\n".join(lines)
    reason_rows = [
        [
            r["reason"] if r["reason_kind"] != "flag" else f"flag {r['reason']}",
            f"only in {r['reason_side']}" if r["reason_side"] else "-",
            r["lookups"],
            r["gained"],
            r["lost"],
            _signed(r["net"]),
        ]
        for r in diff.reasons.iter_rows(named=True)
    ]
    lines += [
        "",
        "explained by:",
        table(["reason", "where", "lookups", "gained", "lost", "net"], reason_rows),
    ]
    rules = diff.lookups.filter(pl.col("rule").is_not_null())
    if rules.height:
        per_rule = (
            rules.group_by("rule")
            .agg(pl.len().alias("n"), pl.col("delta").sum().alias("net"), pl.col("seq").min())
            .sort("n", "seq", descending=[True, False])
        )
        lines += [
            "",
            "cache rules behind the changes:",
            table(
                ["rule", "lookups", "net"],
                [[r, n, _signed(int(net))] for r, n, net, _ in per_rule.iter_rows()],
            ),
        ]
    lines += [
        "",
        f"changed lookups (first {min(limit, diff.changed)} of {diff.changed}):"
        if diff.changed > limit
        else "changed lookups:",
    ]
    rows = [
        [
            r["seq"],
            r["request_id"],
            r["max_length"],
            r["hit_a"],
            r["hit_b"],
            _signed(r["delta"]),
            r["reason"] if r["reason_kind"] != "group" else f"group {r['reason_group']}",
            _flags_text(r["flags_only_a"]),
            _flags_text(r["flags_only_b"]),
            ",".join(str(g) for g in r["groups_changed"]) or "-",
        ]
        for r in diff.lookups.head(limit).iter_rows(named=True)
    ]
    lines.append(
        table(
            [
                "seq",
                "request_id",
                "max_length",
                "hit A",
                "hit B",
                "delta",
                "explained by",
                "flags only in A",
                "flags only in B",
                "groups changed",
            ],
            rows,
        )
    )
    return "\n".join(lines)

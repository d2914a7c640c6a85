"""A diff as ``replay diff`` shows it: who A and B are, the totals, what
explains the changes (flags, groups, cache rules) and the first changed
lookups, as plain text on the terminal, Markdown for a pull request or one
HTML page (``-o d.md``, ``-o d.html``). The three are laid out from the same
lines and tables (:func:`diff_sections`); the diff itself is computed in
``replay.analysis.diff``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from replay.analysis.diff import DiffResult
from replay.analysis.flags import severity
from replay.base.text import counted, printable
from replay.tools.render import policy_label, table


def _signed(n: int) -> str:
    return f"+{n:,}" if n > 0 else f"{n:,}"


def _flags_text(flags: Sequence[str]) -> str:
    return ",".join(flags) if flags else "-"


@dataclass(frozen=True, slots=True)
class Section:
    """One table of a diff: its title, headers and rows (numbers as numbers)."""

    title: str
    headers: list[str]
    rows: list[list[object]]
    numeric: tuple[int, ...]


def diff_lines(diff: DiffResult) -> list[str]:
    """Who A and B are and the totals, one line each."""
    s = diff.summary()
    a, b = diff.a, diff.b
    lines = [
        f"A = {a.label}: policy {policy_label(a.policy, a.cache)}, coordinator "
        f"{a.coordinator}, cache {a.cache} ({a.source})",
        f"B = {b.label}: policy {policy_label(b.policy, b.cache)}, coordinator "
        f"{b.coordinator}, cache {b.cache} ({b.source})",
        f"lookups: {s['lookups']:,} compared, {s['changed']:,} with a different hit "
        f"(B higher on {s['b_higher']:,}, lower on {s['b_lower']:,})",
        f"hit tokens: A {s['hit_tokens_a']:,}, B {s['hit_tokens_b']:,}: net {_signed(s['net'])} "
        f"(B gains {s['gained']:,}, loses {s['lost']:,})",
    ]
    if s["same_hit_groups_changed"]:
        lines.append(
            "same hit, different group masks or group hits: "
            + counted(s["same_hit_groups_changed"], "lookup")
        )
    if not diff.changed:
        lines.append("no lookup's hit differs")
    return lines


def diff_sections(diff: DiffResult, limit: int) -> list[Section]:
    """What explains the changes, the cache rules behind them, and the first
    ``limit`` changed lookups; nothing when no hit differs."""
    if not diff.changed:
        return []
    sections = [
        Section(
            "explained by:",
            ["reason", "where", "lookups", "gained", "lost", "net"],
            [
                [
                    r["reason"]
                    if r["reason_kind"] != "flag"
                    else f"flag {r['reason']} ({severity(r['reason'])})",
                    f"only in {r['reason_side']}" if r["reason_side"] else "-",
                    r["lookups"],
                    r["gained"],
                    r["lost"],
                    _signed(r["net"]),
                ]
                for r in diff.reasons.iter_rows(named=True)
            ],
            (2, 3, 4, 5),
        )
    ]
    rules = diff.lookups.filter(pl.col("rule").is_not_null())
    if rules.height:
        per_rule = (
            rules.group_by("rule")
            .agg(pl.len().alias("n"), pl.col("delta").sum().alias("net"), pl.col("seq").min())
            .sort("n", "seq", descending=[True, False])
        )
        sections.append(
            Section(
                "cache rules behind the changes:",
                ["rule", "lookups", "net"],
                [[r, n, _signed(int(net))] for r, n, net, _ in per_rule.iter_rows()],
                (1, 2),
            )
        )
    sections.append(
        Section(
            f"changed lookups (first {min(limit, diff.changed)} of {diff.changed}):"
            if diff.changed > limit
            else "changed lookups:",
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
            [
                [
                    r["seq"],
                    printable(r["request_id"]),
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
            ],
            (0, 2, 3, 4, 5),
        )
    )
    return sections


def render_text(diff: DiffResult, limit: int = 20) -> str:
    lines = [f"diff of trace {diff.trace}"]
    head = diff_lines(diff)
    lines += ["  " + line for line in head[:2]] + head[2:]
    for section in diff_sections(diff, limit):
        lines += ["", section.title, table(section.headers, section.rows)]
    return "\n".join(lines)


def render_markdown(diff: DiffResult, limit: int = 20) -> str:
    """The diff for a pull request: the lines, then each table."""
    from replay.analysis.report.markdown import md_table

    out = [f"## Diff of trace {diff.trace}", ""]
    out += [f"- {line}" for line in diff_lines(diff)] + [""]
    for section in diff_sections(diff, limit):
        out += [f"### {section.title.rstrip(':').capitalize()}", ""]
        out += [md_table(section.headers, section.rows, section.numeric), ""]
    return "\n".join(out)


def render_html(diff: DiffResult, limit: int = 20) -> str:
    """The diff as one self-contained page (the report's frame and styles)."""
    from replay.analysis.report.html import environment
    from replay.analysis.report.html import table as html_table

    return (
        environment()
        .get_template("diff.html.j2")
        .render(
            title=f"Diff of trace {diff.trace}",
            lines=diff_lines(diff),
            sections=[
                {
                    "title": s.title.rstrip(":").capitalize(),
                    "table": html_table(s.headers, s.rows, s.numeric),
                }
                for s in diff_sections(diff, limit)
            ],
        )
    )

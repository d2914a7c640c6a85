"""The HTML report in a real browser: headless Chromium runs the page's
inline script, which stamps every chart with the marks it laid out
(``data-marks``) and ``<body>`` with a summary (``data-rendered``); the
dumped DOM is read back. A screenshot checks the page paints at full size.

Needs a ``chromium`` binary (Debian package ``chromium``); skipped otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tests.analysis.test_diff import write_workload
from tests.reports import invoke_report, results_of


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


CHROMIUM = _chromium()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium binary on PATH (install the Debian package `chromium`)",
    ),
]


def _browser(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _report(tmp_path: Path, trace: Path, policy: str = "pre-49502") -> Path:
    results = results_of(trace, policy, out=tmp_path / "r.results.parquet")
    out = tmp_path / "report.html"
    res = invoke_report([results, "-o", out, "--trace", trace])
    assert res.exit_code == 0, res.output
    return out


def _dom(tmp_path: Path, page: Path) -> str:
    proc = _browser(tmp_path, "--dump-dom", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _chart_marks(dom: str) -> dict[str, int]:
    out = {}
    for tag in re.findall(r"<svg\b[^>]*>", dom):
        name = re.search(r'data-chart="(\w+)"', tag)
        n = re.search(r'data-marks="(\d+)"', tag)
        if name:
            assert n is not None, f"chart {name.group(1)} was not stamped by the script"
            out[name.group(1)] = int(n.group(1))
    return out


@pytest.mark.slow
def test_workload_report_renders(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet")
    dom = _dom(tmp_path, _report(tmp_path, trace))
    rendered = re.search(r'<body[^>]*data-rendered="([^"]+)"', dom)
    assert rendered is not None, "the inline script did not run"
    assert rendered.group(1) == "3 charts, 3 visible, 48 marks"
    assert _chart_marks(dom) == {"timeline": 40, "histogram": 6, "groups": 2}
    points = r'role="graphics-symbol" aria-roledescription="point"'
    assert len(re.findall(points, dom)) == 40


def test_43559_report_renders(tmp_path: Path, trace_43559: Path) -> None:
    dom = _dom(tmp_path, _report(tmp_path, trace_43559))
    assert 'data-rendered="3 charts, 3 visible, 8 marks"' in dom
    assert _chart_marks(dom) == {"timeline": 1, "histogram": 5, "groups": 2}
    assert "state at 64" in dom


@pytest.mark.slow
def test_screenshot(tmp_path: Path) -> None:
    trace = write_workload(tmp_path / "work.parquet")
    page = _report(tmp_path, trace)
    shot = tmp_path / "report.png"
    proc = _browser(tmp_path, "--window-size=1100,2400", f"--screenshot={shot}", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 2400)
    # A blank page compresses to a few kB; text, tables and charts do not.
    assert len(data) > 50_000


def test_demo_report_in_chromium(tmp_path: Path) -> None:
    """The demo report (``make demo``'s trace) as a user opens it: three
    Altair charts, each laid out at a size and holding its marks; the
    screenshot is kept under tmp_path and, when set, $REPLAY_ARTEFACTS."""
    trace = (
        Path(__file__).resolve().parent.parent.parent / "traces" / "demo-full-mamba-eagle.parquet"
    )
    results = results_of(trace, out=tmp_path / "demo.results.parquet")
    page = tmp_path / "demo-report.html"
    res = invoke_report([results, "-o", page])
    assert res.exit_code == 0, res.output
    dom = _dom(tmp_path, page)
    charts = re.findall(r'<svg [^>]*class="chart marks" data-chart="(\w+)"', dom)
    assert charts == ["timeline", "histogram", "groups"]
    rendered = re.search(r'<body[^>]*data-rendered="([^"]+)"', dom)
    assert rendered is not None, "the inline script did not run"
    assert rendered.group(1) == "3 charts, 3 visible, 70 marks"
    assert _chart_marks(dom) == {"timeline": 40, "histogram": 28, "groups": 2}
    # Hovering a mark shows its values offline: Chromium parsed each mark's
    # <title> as its child (the DOM it dumps is its own, re-serialized).
    bars = re.findall(r'aria-roledescription="bar"[^>]*><title>([^<]*)</title></path>', dom)
    assert bars[:3] == [
        "no hit: 103 lookups",
        "hit 16–207 tokens: 2 lookups",
        "hit 208–399 tokens: 16 lookups",
    ]
    points = re.findall(r'aria-roledescription="point"[^>]*><title>([^<]*)</title>', dom)
    assert len(points) == 40
    assert points[2] == "00:00:06 – 00:00:08: 6 lookups, hit ratio 38.90% (3,072 of 7,897 tokens)"
    shot = tmp_path / "demo-report.png"
    proc = _browser(tmp_path, "--window-size=1100,2400", f"--screenshot={shot}", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1100, 2400)
    assert len(data) > 50_000
    artefacts = os.environ.get("REPLAY_ARTEFACTS")
    if artefacts:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(artefacts) / shot.name)

"""replay.base.jit: a read-only install works. With the package directory
read-only and a home whose cache directory cannot be made (a system-wide or
container install run by a plain user), ``@njit(cache=True)`` once killed
every command at import, ``--version`` included (issue 25)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The console script's own entry, after the kernels: one process.
PROBE = (
    "import sys, replay.whatif.stack, replay.whatif.kernel, replay.engine.kernels, replay.base.jit as j; "
    "from numba.core import config; print(j.CACHE, config.CACHE_DIR, flush=True); "
    "sys.argv = ['replay', '--version']; from replay.cli import main; main()"
)


def _read_only_copy(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    for name in ("replay",):
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "home").mkdir()
    return pkg


def _run_read_only(
    tmp_path: Path, pkg: Path, commands: list[str]
) -> subprocess.CompletedProcess[str]:
    """Run ``commands`` (shell lines) with ``pkg`` and HOME read-only: as
    root in a user and mount namespace with read-only bind mounts (root
    ignores file modes), else with the modes taken away."""
    home = tmp_path / "home"
    env = {
        **os.environ,
        "HOME": str(home),
        "PYTHONPATH": str(pkg),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("XDG_CACHE_HOME", None)
    env.pop("NUMBA_CACHE_DIR", None)
    lines = list(commands)
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: cannot make a read-only directory")
        mounts = [f"mount --bind {d} {d} && mount -o remount,bind,ro {d}" for d in (pkg, home)]
        script = " && ".join([*mounts, f"touch {pkg}/w 2>/dev/null && exit 99 || true", *lines])
        args = ["unshare", "-rm", "sh", "-c", script]
    else:
        for d in (pkg, home):
            for p in [d, *d.rglob("*")]:
                p.chmod(p.stat().st_mode & ~0o222)
        args = ["sh", "-c", " && ".join(lines)]
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path)
    if result.returncode == 99 or "unshare:" in result.stderr:
        pytest.skip(f"no read-only mount here: {result.stderr.strip()}")
    return result


def test_the_cli_starts_from_a_read_only_install_with_an_unwritable_home(tmp_path: Path) -> None:
    pkg = _read_only_copy(tmp_path)
    py = sys.executable
    result = _run_read_only(
        tmp_path,
        pkg,
        [f'{py} -c "{PROBE}"'],
    )
    assert result.returncode == 0, result.stderr
    cached, where = result.stdout.splitlines()[0].split(" ", 1)
    # The machine code goes to this user's private directory under the
    # system's temporary directory (or, failing that, nowhere).
    assert (cached, where) in {
        ("True", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"replay-numba-{os.getuid()}")),
        ("False", ""),
    }
    assert result.stdout.splitlines()[1].startswith("replay, version ")
    assert "Traceback" not in result.stderr
    assert not list(pkg.rglob("__pycache__"))

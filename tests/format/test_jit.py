"""replay.base.jit: a read-only install works. With the package directory
read-only and a home whose cache directory cannot be made (a system-wide or
container install run by a plain user), ``@njit(cache=True)`` once killed
every command at import, ``--version`` included (issue 25)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay.base.jit import fingerprint

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
    # (in the directory of this fingerprint of the kernels' sources)
    private = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"replay-numba-{os.getuid()}")
    assert (cached, where) in {("True", os.path.join(private, fingerprint())), ("False", "")}
    assert result.stdout.splitlines()[1].startswith("replay, version ")
    assert "Traceback" not in result.stderr
    assert not list(pkg.rglob("__pycache__"))


# shard._shard_ids compiles key_meta and mix of engine/kernels.py into its
# own machine code: numba's cache checks only shard.py's timestamp.
SHARDS = (
    "import pyarrow as pa; from replay.engine.shard import shard_of; "
    "print(shard_of(pa.array([[bytes([i]) * 16 for i in range(8)]]), 4096).tolist())"
)


@pytest.mark.slow
def test_an_edit_to_an_inlined_function_of_another_file_reaches_the_cached_kernels(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "replay", pkg / "replay", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(pkg), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def shards() -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", SHARDS],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            check=True,
        )
        return [int(s) for s in out.stdout.strip()[1:-1].split(", ")]

    before = shards()
    assert shards() == before  # the same sources: the same machine code, from the cache
    kernels = pkg / "replay/engine/kernels.py"
    text = kernels.read_text()
    old = "(z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)"
    assert text.count(old) == 1
    kernels.write_text(
        text.replace(old, "(z ^ (z >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9)")
    )
    after = shards()
    assert after != before  # the edited mix, not the machine code cached before it
    # Two directories, one per fingerprint, each with its own machine code.
    assert len([d for d in (tmp_path / "cache").iterdir() if d.is_dir()]) == 2


def test_fingerprint_directories_unused_for_a_day_beyond_the_newest_eight_are_removed(
    tmp_path: Path,
) -> None:
    base = tmp_path / "xdg" / "cache-trace-replay" / "numba"
    old = time.time() - 3 * 24 * 3600
    for i in range(12):  # twelve earlier fingerprints, the first ten unused for days
        d = base / f"{i:016x}"
        d.mkdir(parents=True)
        if i < 10:
            os.utime(d, (old + i, old + i))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("NUMBA_CACHE_DIR", None)
    probe = "import replay.base.jit as j; from numba.core import config; print(config.CACHE_DIR)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == str(base / fingerprint())
    # This run's, the two recent ones, and the five newest of the old ones.
    kept = sorted(d.name for d in base.iterdir())
    assert kept == sorted([fingerprint(), *(f"{i:016x}" for i in range(5, 12))])

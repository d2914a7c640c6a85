"""The replay on a real Ray cluster (``make test-ray``): two nodes on this
machine, one CPU and a few hundred MB of object store each; results
identical to the serial run; a killed worker retried or reported, never a
shorter results file."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from replay.format.tracedir import open_trace, split_trace
from replay.format.writer import TraceWriter
from replay.sources.synth import synth_trace
from tests.builders import replay_trace
from tests.conftest import run_cli

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from replay.analysis.flags import flag_results  # noqa: E402
from replay.engine.cluster import NAMESPACE, ClusterError, ShardPool, replay_on_ray  # noqa: E402
from replay.engine.run import ReplayOptions, replay  # noqa: E402

POLICIES = ("vllm-0.33", "pre-49502")
STORE_MB = 200


@pytest.fixture(scope="module")
def ray_tmp() -> Iterator[str]:
    # Ray's socket paths must stay short: a directory right under /tmp, and
    # never Ray's default one, which other runs on this machine share.
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    yield tmp
    if old is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Full attention + Mamba with EAGLE, a bounded LRU store (removes),
    clears, and injected #43559 overruns, as 5 files and an empty one."""
    root = tmp_path_factory.mktemp("ray-trace")
    single = root / "one.parquet"
    synth_trace(
        single,
        model="full+mamba",
        requests=600,
        seed=13,
        eagle=True,
        capacity_blocks=3000,
        inject_overrun=4,
        clear_every=250,
        hash_bytes=32,
    )
    split_trace(single, root / "dir", 5)
    # A file without events (a quiet hour) between two others.
    with TraceWriter(root / "dir" / "part-000002a.parquet", open_trace(single).config):
        pass
    return root


@pytest.fixture(scope="module")
def serial(trace_dir: Path) -> dict[str, pl.DataFrame]:
    return {p: replay_trace(trace_dir / "one.parquet", policy=p).results for p in POLICIES}


@pytest.fixture(scope="module")
def cluster(ray_tmp: str, serial: dict[str, pl.DataFrame]) -> Iterator[Cluster]:
    node: dict[str, Any] = {"num_cpus": 1, "object_store_memory": STORE_MB << 20}
    c = Cluster(initialize_head=True, head_node_args=node)
    c.add_node(**node)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    # Ray's own annotations (when it is installed) leave this one untyped.
    stop: Any = c.shutdown
    stop()


def test_the_trace_has_what_the_cluster_must_get_right(
    trace_dir: Path, serial: dict[str, pl.DataFrame]
) -> None:
    kinds = open_trace(trace_dir / "dir").read_frame(["kind"])["kind"].value_counts()
    counts = dict(kinds.iter_rows())
    assert counts["remove"] > 100 and counts["clear"] >= 2 and counts["lookup"] > 600
    flagged = serial["pre-49502"].filter(pl.col("flags").list.contains("mamba_overrun"))
    assert flagged["request_id"].str.starts_with("overrun-").sum() >= 4
    assert serial["vllm-0.33"].filter(pl.col("flags").list.len() > 0).height == 0


def test_two_nodes_give_the_serial_results_for_both_policies(
    cluster: Cluster, trace_dir: Path, serial: dict[str, pl.DataFrame]
) -> None:
    seen: list[tuple[int, int]] = []
    stats: dict[str, Any] = {}
    options = ReplayOptions(
        policies=tuple(POLICIES),
        ray_address="auto",  # the cluster this process is connected to
        progress=lambda p: seen.append((p.events, p.total_events)),
        stats=stats,
    )
    results = flag_results(replay(trace_dir / "dir", options))
    assert [r.policy for r in results] == list(POLICIES)
    for r in results:
        assert r.results.equals(serial[r.policy])
    total = seen[-1][1]
    assert seen[-1] == (total, total)
    assert stats["shards"] == 2 and stats["files"] == 6


@pytest.mark.parametrize("shards", [1, 3])
def test_one_file_on_the_cluster_is_the_serial_run(
    cluster: Cluster, trace_dir: Path, serial: dict[str, pl.DataFrame], shards: int
) -> None:
    options = ReplayOptions(policies=("pre-49502",), workers=shards)
    (result,) = flag_results(replay(trace_dir / "one.parquet", options))
    assert result.results.equals(serial["pre-49502"])


def test_shards_are_spread_over_both_nodes(cluster: Cluster) -> None:
    pool = ShardPool(ray, num_groups=2, shards=2)
    try:
        nodes = {ray.get(a.node.remote()) for a in pool.actors}
    finally:
        pool.close()
    assert len(nodes) == 2


def test_cli_writes_one_results_file_per_policy(
    cluster: Cluster, trace_dir: Path, serial: dict[str, pl.DataFrame], tmp_path: Path
) -> None:
    out = tmp_path / "r.results.parquet"
    args = ["run", str(trace_dir / "dir"), "--ray", cluster.address, "-o", str(out), "-q"]
    result = run_cli([*args, "--policy", POLICIES[0], "--policy", POLICIES[1]])
    assert result.exit_code == 0, result.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(f"r.{p}.results.parquet" for p in POLICIES)
    for p in POLICIES:
        assert pl.read_parquet(tmp_path / f"r.{p}.results.parquet").equals(serial[p])
    check = run_cli(["check", str(tmp_path / "r.pre-49502.results.parquet")])
    assert check.exit_code == 1
    assert "mamba_overrun" in check.stdout


def test_a_dead_shard_is_reported_and_nothing_written(cluster: Cluster, trace_dir: Path) -> None:
    pool = ShardPool(ray, num_groups=2, shards=2)
    pid = ray.get(pool.actors[1].pid.remote())
    os.kill(pid, signal.SIGKILL)
    try:
        with pytest.raises(ClusterError, match=r"the replay on Ray failed \(.*\); no results"):
            replay_on_ray(trace_dir / "dir", ReplayOptions(policies=tuple(POLICIES)), pool=pool)
    finally:
        pool.close()


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return seen


def _kill_first(title: str, stop: threading.Event, killed: list[str]) -> None:
    """SIGKILL the first process of this test's Ray whose title is ``title``
    (Ray names a worker after the task or actor it runs)."""
    me = os.getpid()
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(title) and me in _ancestors(int(entry.name)):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(cmd)
                return
        time.sleep(0.005)


@pytest.mark.parametrize("title", ["ray::_answer_file", "ray::_Shard"])
def test_a_worker_killed_mid_run_is_retried_or_reported(
    cluster: Cluster,
    trace_dir: Path,
    serial: dict[str, pl.DataFrame],
    tmp_path: Path,
    title: str,
) -> None:
    out = tmp_path / "r.parquet"
    stop, killed = threading.Event(), list[str]()
    killer = threading.Thread(target=_kill_first, args=(title, stop, killed), daemon=True)
    killer.start()
    try:
        result = run_cli(
            [
                *("run", str(trace_dir / "dir"), "--ray", cluster.address, "-o", str(out), "-q"),
                *("--policy", "pre-49502"),
            ]
        )
    finally:
        stop.set()
        killer.join()
    assert killed, f"no {title} process was seen to kill"
    if result.exit_code == 0:  # a stateless task: Ray ran it again
        assert pl.read_parquet(out).equals(serial["pre-49502"])
    else:  # a shard's store is gone with its worker
        assert title == "ray::_Shard"
        assert result.exit_code == 2
        assert "the replay on Ray failed" in result.stderr and "no results" in result.stderr
        assert not out.exists()
    if title == "ray::_answer_file":
        assert result.exit_code == 0, result.stderr
    # The run's shard actors are gone with it, whatever happened.
    deadline = time.monotonic() + 20
    while _shard_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _shard_actors() == []


def _shard_actors() -> list[dict[str, str]]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return [n for n in named if n["namespace"] == NAMESPACE]


def test_workers_on_a_local_ray_from_the_command_line(
    ray_tmp: str, trace_dir: Path, serial: dict[str, pl.DataFrame], tmp_path: Path
) -> None:
    # A stale ray_current_cluster file must not send the run to a dead cluster.
    Path(ray_tmp, "ray", "ray_current_cluster").parent.mkdir(parents=True, exist_ok=True)
    Path(ray_tmp, "ray", "ray_current_cluster").write_text("127.0.0.1:1\n")
    out = tmp_path / "w.parquet"
    replay = Path(sys.executable).parent / "replay"
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    done = subprocess.run(
        [
            *(str(replay), "run", str(trace_dir / "dir"), "--workers", "2", "-o", str(out)),
            *("-q", "--policy", "pre-49502"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert pl.read_parquet(out).equals(serial["pre-49502"])


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (
            "127.0.0.1:1",
            "--ray 127.0.0.1:1: no Ray there (Connection refused); start one with "
            "`ray start --head` or give its address",
        ),
        ("nonsense", "--ray nonsense: expected auto or HOST:PORT"),
    ],
)
def test_a_bad_cluster_address_is_one_line_and_quick(
    trace_dir: Path, tmp_path: Path, address: str, message: str
) -> None:
    out = tmp_path / "r.parquet"
    replay = Path(sys.executable).parent / "replay"
    done = subprocess.run(
        [str(replay), "run", str(trace_dir / "dir"), "--ray", address, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == f"error: {message}\n"
    assert not out.exists()


# ------------------------------------------------ faults of a real run (issue 32 item 5)


def _kill_first_under(root: int, title: str, stop: threading.Event, killed: list[str]) -> None:
    """SIGKILL the first descendant of process ``root`` whose title is ``title``."""
    while not stop.is_set():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(title) and root in _ancestors(int(entry.name)):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(cmd)
                return
        time.sleep(0.005)


def _identical_or_one_line(code: int, err: str, out: Path, serial: pl.DataFrame, fault: str) -> str:
    """The promise of issue 32: the results of the serial run, or one line,
    exit 2 and no output. Returns which."""
    print(f"\nFAULT {fault}: exit {code} {err.strip()}")  # what happened, for `-s`
    if code == 0:
        assert pl.read_parquet(out).equals(serial), fault
        return "identical"
    assert code == 2, (fault, code, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (fault, err)
    assert "no results written" in lines[0], (fault, err)
    assert not out.exists(), fault
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], fault
    return "failed"


@pytest.mark.parametrize("title", ["ray::_scatter_file", "ray::_answer_file", "ray::_Shard"])
def test_a_worker_process_killed_during_workers_2(
    ray_tmp: str, trace_dir: Path, serial: dict[str, pl.DataFrame], tmp_path: Path, title: str
) -> None:
    """`replay run --workers 2` (its own local Ray): a worker process of
    each kind is SIGKILLed mid-run."""
    out = tmp_path / "w.parquet"
    replay = Path(sys.executable).parent / "replay"
    proc = subprocess.Popen(
        [
            *(str(replay), "run", str(trace_dir / "dir"), "--workers", "2", "-o", str(out)),
            *("-q", "--policy", "pre-49502"),
        ],
        env={**os.environ, "RAY_TMPDIR": ray_tmp},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stop, killed = threading.Event(), list[str]()
    killer = threading.Thread(
        target=_kill_first_under, args=(proc.pid, title, stop, killed), daemon=True
    )
    killer.start()
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        stop.set()
        killer.join()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert killed, f"no {title} process was seen to kill"
    how = _identical_or_one_line(proc.returncode, err, out, serial["pre-49502"], title)
    if title != "ray::_Shard":  # a stateless task: Ray runs it again
        assert how == "identical", err


def test_a_worker_node_stopped_mid_run(
    cluster: Cluster, trace_dir: Path, serial: dict[str, pl.DataFrame], tmp_path: Path
) -> None:
    """`replay run --ray ADDRESS` on the two-node cluster: the worker node
    (its raylet, its workers, a shard's store) is stopped mid-run."""
    out = tmp_path / "r.parquet"
    replay = Path(sys.executable).parent / "replay"
    (node,) = list(cluster.worker_nodes)
    proc = subprocess.Popen(
        [
            *(str(replay), "run", str(trace_dir / "dir"), "--ray", cluster.address),
            *("-o", str(out), "-q", "--policy", "pre-49502"),
        ],
        env={**os.environ, "RAY_TMPDIR": os.environ["RAY_TMPDIR"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _shard_actors():  # the run's shards are placed: it is under way
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never placed its shards"
            time.sleep(0.01)
        cluster.remove_node(node, allow_graceful=False)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        # The module's cluster gets its second node back.
        cluster.add_node(num_cpus=1, object_store_memory=STORE_MB << 20)
        cluster.wait_for_nodes()
    _identical_or_one_line(proc.returncode, err, out, serial["pre-49502"], "node stopped")

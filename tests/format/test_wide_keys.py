"""Mixed hash widths never pad to the widest (issue 25): the store's table
keeps keys up to 32 bytes in their slots and a longer one out of line, so
one 64 KiB hash among 200,000 9-byte ones costs its own words once (it
took 23 GB and was killed); the what-if interns mixed widths by their own
words (it read a packed batch at the wrong offsets and gave distinct
hashes one id)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.engine.kernels import LOOKUP, STORE, KeyTable
from replay.engine.shard import fold_rows
from replay.format.writer import events_table
from replay.whatif.kernel import intern_hashes
from tests.builders import full_mamba

ROOT = Path(__file__).resolve().parents[2]
N = 200_000
WIDE = b"w" * 65534  # the widest hash the table keys (64 KiB less 2 bytes)


def _narrow(i: int) -> bytes:
    return i.to_bytes(9, "big")


def test_one_64_kib_hash_among_200000_narrow_ones_costs_its_own_words_once() -> None:
    table = KeyTable(2)
    narrow = [_narrow(i) for i in range(N)]
    stores = pa.array([narrow[: N // 2], [WIDE], narrow[N // 2 :]], pa.list_(pa.binary()))
    fold_rows(table, np.array([0, 0, 1], np.int32), stores, np.full(3, STORE, np.int8))
    probe = [*narrow[:3], WIDE, narrow[-1], b"w" * 65533, _narrow(N)]
    out, _, _ = fold_rows(
        table,
        np.array([0], np.int32),
        pa.array([probe], pa.list_(pa.binary())),
        np.array([LOOKUP], np.int8),
    )
    assert out.reshape(2, len(probe)).tolist() == [[1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0]]
    assert table.num_keys == N + 1
    assert table.group_counts() == [N // 2 + 1, N // 2]
    # 2**19 slots of 3 words (meta and a 9-byte key's 2), the wide key's
    # 8,192 words in the heap (which doubles what it holds): 12.1 MiB; every
    # slot padded to the widest took 2**19 x 8,194 words (32 GiB).
    assert table.nbytes == (1 << 19) * 3 * 8 + 2 * 8192 * 8


def test_wide_keys_churn_against_python_sets() -> None:
    """Keys of 1 to 200 bytes stored, removed, cleared and looked up: the
    heap of the long ones is compacted as it grows, presence always equals a
    set's, and the heap never holds more than twice the words of every long
    key there is (each store of a removed key appended its words again)."""
    rng = np.random.default_rng(5)
    table = KeyTable(3)
    universe = [rng.bytes(int(w)) for w in rng.integers(1, 201, 3000)]
    truth: list[set[bytes]] = [set(), set(), set()]
    every = sum((len(h) + 7) // 8 for h in set(universe) if len(h) > 32)
    for step in range(80):
        kinds, gids, rows = [], [], []
        for _ in range(6):
            op, g = int(rng.integers(0, 10)), int(rng.integers(0, 3))
            keys = [universe[i] for i in rng.integers(0, len(universe), int(rng.integers(0, 400)))]
            if op < 5:
                truth[g].update(keys)
                kinds.append(STORE)
            elif op < 9:
                truth[g].difference_update(keys)
                kinds.append(1)
            else:
                keys = []
                kinds.append(2)
                g = -1 if step % 9 == 0 else g
                for t in truth if g < 0 else [truth[g]]:
                    t.clear()
            gids.append(g)
            rows.append(keys)
        probe = [universe[i] for i in rng.integers(0, len(universe), 300)]
        kinds.append(LOOKUP)
        gids.append(0)
        rows.append(probe)
        out, _, _ = fold_rows(
            table,
            np.array(gids, np.int32),
            pa.array(rows, pa.list_(pa.binary())),
            np.array(kinds, np.int8),
        )
        assert out.reshape(3, len(probe)).astype(bool).tolist() == [
            [h in t for h in probe] for t in truth
        ]
        assert table.group_counts() == [len(t) for t in truth]
        assert table.heap.shape[0] <= 2 * (every + 25)
    assert table.info[2] == 4  # keys up to 32 bytes in their slots, no wider


def test_the_what_if_interns_mixed_widths_by_their_own_words() -> None:
    hashes = pa.array(
        [[b"a" * 9, b"b" * 9, b"c" * 9, b"w" * 20], [b"a" * 9, b"b" * 9, b"d" * 9]],
        pa.list_(pa.binary()),
    )
    ids, digests = intern_hashes(hashes)
    assert ids.tolist() == [0, 1, 2, 3, 0, 1, 4]
    assert digests.to_pylist() == [b"a" * 9, b"b" * 9, b"c" * 9, b"w" * 20, b"d" * 9]


DRIVER = """
import json, resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "replay", *json.loads(sys.argv[1])],
                   capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps([r.returncode, r.stderr, peak]))
"""


def _trace(path: Path, wide: bytes) -> Path:
    narrow = [_narrow(i) for i in range(N)]
    rows = [
        {"kind": "store", "group_id": 0, "block_hashes": narrow[: N // 2]},
        {"kind": "store", "group_id": 0, "block_hashes": [wide]},
        {"kind": "store", "group_id": 0, "block_hashes": narrow[N // 2 :]},
        {"kind": "store", "group_id": 1, "block_hashes": [*narrow[:4], wide]},
        {
            "kind": "lookup",
            "request_id": "r",
            "block_hashes": [*narrow[:4], wide],
            "max_length": 95,
        },
        {"kind": "lookup", "request_id": "s", "block_hashes": narrow[:6], "max_length": 95},
    ]
    pq.write_table(events_table(rows, full_mamba(eagle=False)), str(path))
    return path


@pytest.mark.slow
def test_run_and_whatif_of_one_wide_hash_match_the_narrow_path_in_bounded_memory(
    tmp_path: Path,
) -> None:
    """The same trace with the wide hash replaced by a tenth 9-byte one:
    the results and the sweep are the same, and the command's peak RSS
    stays under 1 GiB."""
    import polars as pl

    wide = _trace(tmp_path / "wide.parquet", WIDE)
    narrow = _trace(tmp_path / "narrow.parquet", b"\xff" * 9)
    peaks = {}
    for name in ("wide", "narrow"):
        for args in (
            ["run", f"{name}.parquet", "-o", f"{name}.r.parquet", "-q"],
            ["whatif", f"{name}.parquet", "--cache", "gpu", "--capacity-blocks", "3,1M", "-o", f"{name}.w.parquet", "-q", "--jobs", "1"],
        ):  # fmt: skip
            run = subprocess.run(
                [sys.executable, "-c", DRIVER, json.dumps(["--max-hash-bytes", "65534", *args])],
                capture_output=True, text=True, cwd=tmp_path, check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            code, stderr, peak = json.loads(run.stdout)
            assert (code, stderr) == (0, ""), args
            peaks[(name, args[0])] = peak
    assert max(peaks.values()) < 1024, peaks
    results = [pl.read_parquet(tmp_path / f"{n}.r.parquet") for n in ("wide", "narrow")]
    assert results[0].equals(results[1])
    # "s" (six narrow hashes, a 96-token prompt) enters as the Mooncake
    # worker's lookup: full attention finds the whole prompt at the aligned
    # length 96, Mamba 64, and 64 stands (below the prompt's end).
    assert results[0]["group_hit_tokens"].to_list() == [[80, 80], [96, 64]]
    sweeps = [
        pl.read_parquet(tmp_path / f"{n}.w.parquet").drop("seconds") for n in ("wide", "narrow")
    ]
    assert sweeps[0].equals(sweeps[1])
    assert wide.exists() and narrow.exists()

"""Check that two builds of ``replay whatif`` write the same sweep files.

    python tools/sweep_identity.py OLD_REPLAY NEW_REPLAY [OUTDIR]

runs both console scripts over a few corpus traces and option sets and
compares the sweep files: every column and every metadata key must be equal,
except the wall-clock ``seconds`` (a column and a metadata key), which no two
runs share; the files are also compared byte for byte after those are
zeroed (both rewritten by the same pyarrow call). Exit 1 on any difference.
Emitted traces (``--emit-traces``) are compared byte for byte as written.
"""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CORPUS = Path(__file__).resolve().parent.parent / "traces"
KEY = b"replay.sweep"

CASES: list[tuple[str, list[str]]] = [
    ("archetype-full.parquet", ["--cache", "gpu", "--capacity", "8,16,64,1k"]),
    ("archetype-full-mamba.parquet", ["--capacity", "10%,50%", "--eviction", "lru,fifo,belady"]),
    (
        "demo-full-mamba-eagle.parquet",
        ["--cache", "gpu", "--points", "3", "--min", "16", "--max", "4k", "--eviction", "lru,lfu"],
    ),
    ("archetype-full-swa.parquet", ["--capacity", "32,256", "--sample", "0.5"]),
    ("archetype-full-chunked.parquet", ["--capacity-bytes", "64MiB,1GiB", "--page-bytes", "2MiB"]),
    # A refusal: the same one line and exit status, no file.
    ("random-0001.parquet", ["--capacity", "64"]),
    (
        "archetype-swa-mamba.parquet",
        ["--cache", "gpu", "--capacity", "64,512", "--policy", "pre-49502", "--eviction", "fifo"],
    ),
    ("archetype-full.parquet", ["--capacity", "16,64", "--emit-traces", "{emit}"]),
]


def normalised(path: Path, out: Path) -> tuple[pa.Table, dict[str, object]]:
    table = pq.read_table(path)
    meta = json.loads((table.schema.metadata or {})[KEY])
    meta.pop("seconds", None)
    i = table.schema.get_field_index("seconds")
    table = table.set_column(i, "seconds", pa.array([0.0] * len(table), pa.float64()))
    table = table.replace_schema_metadata({KEY: json.dumps(meta).encode()})
    pq.write_table(table, out)
    return table, meta


def main() -> int:
    old, new = sys.argv[1], sys.argv[2]
    work = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/sweep-identity")
    work.mkdir(parents=True, exist_ok=True)
    bad = 0
    for k, (trace, args) in enumerate(CASES):
        outs = []
        for side, exe in (("old", old), ("new", new)):
            emit = work / f"{k}.{side}.emitted"
            out = work / f"{k}.{side}.parquet"
            for p in (out,):
                p.unlink(missing_ok=True)
            if emit.exists():
                for f in emit.iterdir():
                    f.unlink()
                emit.rmdir()
            argv = [a.replace("{emit}", str(emit)) for a in args]
            done = subprocess.run(
                [exe, "whatif", str(CORPUS / trace), *argv, "-o", str(out), "-q", "--jobs", "1"],
                capture_output=True,
                text=True,
            )
            outs.append((out, emit, done.returncode, done.stderr.replace(str(work), "W")))
        (a, ea, ra, sa), (b, eb, rb, sb) = outs
        if ra or rb:
            same = (ra, sa) == (rb, sb) and not a.exists() and not b.exists()
            print(
                f"{trace} {' '.join(args)}: exit {ra}/{rb}, stderr {'equal' if same else 'DIFFER'}"
            )
            bad += not same
            continue
        ta, ma = normalised(a, work / f"{k}.old.norm.parquet")
        tb, mb = normalised(b, work / f"{k}.new.norm.parquet")
        same = ta.equals(tb) and ma == mb and ta.schema == tb.schema
        same_bytes = filecmp.cmp(
            work / f"{k}.old.norm.parquet", work / f"{k}.new.norm.parquet", shallow=False
        )
        emitted = "-"
        if ea.exists() or eb.exists():
            na = sorted(p.name for p in ea.iterdir())
            nb = sorted(p.name for p in eb.iterdir())
            ok = na == nb and all(filecmp.cmp(ea / n, eb / n, shallow=False) for n in na)
            emitted = f"{len(na)} traces {'identical' if ok else 'DIFFER'}"
            same = same and ok
        print(
            f"{trace} {' '.join(args)}: {len(ta)} rows, values {'equal' if same else 'DIFFER'}, normalised bytes {'identical' if same_bytes else 'DIFFER'}, emitted {emitted}"
        )
        bad += not (same and same_bytes)
    print("all identical" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

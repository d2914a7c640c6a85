"""Check that two builds of ``replay`` write the same files for the whole
bundled corpus.

    python tools/corpus_identity.py OLD_REPLAY NEW_REPLAY [OUTDIR] [GLOB]

runs both console scripts over every trace of ``traces/`` (or those GLOB
names): ``replay run`` (the results files byte for byte) and ``replay
whatif`` with the gpu and the mooncake cache, every eviction order, at four
small capacities (the sweep files as ``tools/sweep_identity.py`` compares
them: equal but for the wall-clock ``seconds``, then byte for byte with those
zeroed). A refusal must be the same exit status and message on both sides,
with no file. Exit 1 on any difference.
"""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

from sweep_identity import CORPUS, normalised

WHATIF = ["--capacity-blocks", "4,16,64,256", "--eviction", "lru,fifo,lfu,belady"]


def main() -> int:
    old, new = sys.argv[1], sys.argv[2]
    work = Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/corpus-identity")
    pattern = sys.argv[4] if len(sys.argv) > 4 else "*.parquet"
    work.mkdir(parents=True, exist_ok=True)
    bad = runs = 0
    for trace in sorted(CORPUS.glob(pattern)):
        cases = [("run", ["run", str(trace)], "results")] + [
            (cache, ["whatif", str(trace), "--cache", cache, *WHATIF, "-q", "--jobs", "1"], "sweep")
            for cache in ("gpu", "mooncake")
        ]
        for name, argv, kind in cases:
            outs = []
            for side, exe in (("old", old), ("new", new)):
                out = work / f"{trace.stem}.{name}.{side}.parquet"
                out.unlink(missing_ok=True)
                done = subprocess.run([exe, *argv, "-o", str(out)], capture_output=True, text=True)
                outs.append((out, done.returncode, done.stderr.replace(str(work), "W")))
            (a, ra, sa), (b, rb, sb) = outs
            runs += 1
            if ra or rb:
                same = (ra, sa) == (rb, sb) and not a.exists() and not b.exists()
            elif kind == "results":
                same = filecmp.cmp(a, b, shallow=False)
            else:
                ta, ma = normalised(a, a.with_suffix(".norm.parquet"))
                tb, mb = normalised(b, b.with_suffix(".norm.parquet"))
                same = ta.equals(tb) and ma == mb and ta.schema == tb.schema
                same = same and filecmp.cmp(
                    a.with_suffix(".norm.parquet"), b.with_suffix(".norm.parquet"), shallow=False
                )
            if not same:
                print(f"{trace.name} {name}: DIFFER (exit {ra}/{rb})")
                bad += 1
    print(f"{runs} commands on both sides: " + ("all identical" if not bad else f"{bad} differ"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

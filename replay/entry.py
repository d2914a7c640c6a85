"""The console script's first code: signals are set before the command line
is imported (polars, pyarrow and the rest take a while to load), so a
signal at any moment ends the process with 128 + its number. Nothing can
have been written yet, so there is nothing to clean up either."""

from __future__ import annotations

import os
import signal

from replay.base.signals import exit_now


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_now)
    # numpy's OpenBLAS starts a thread per core when numpy is imported, and
    # the thread spins waiting for work that no command gives it (nothing
    # here calls BLAS): `import numpy` took 0.12-0.13 s of CPU against
    # 0.06-0.08 with one thread, and a corpus trace's `replay run` 0.91 s
    # of CPU against 0.81, 0.92 s of wall against 0.85 (paired runs,
    # medians). One thread starts none. A setting of the user's own is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from replay.cli import main as run

    run()

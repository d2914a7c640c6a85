"""The watch tests' kernels loaded once per test process, before any of
them starts a watch: with numba's cache cold (a fresh checkout, a changed
kernel source) the watch's own warm-up compiles them, about 15 s on this
machine, which a test's publisher, waiting 20 s for the watch to
subscribe, cannot tell from a watch that never came."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _kernels_loaded() -> None:
    from replay.watch._service import _warm_up

    _warm_up()

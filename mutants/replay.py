"""``REPLAY_MUTANT=NAME python -m mutants.replay ARGS...``: the ``replay``
command line with the mutant applied to the installed vLLM (at import time,
nothing edited). Without ``REPLAY_MUTANT`` it is ``replay`` itself."""

from __future__ import annotations

import sys

from mutants.loader import MutantError, install_from_env


def main() -> None:
    try:
        install_from_env()
    except MutantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from replay.entry import main as replay_main

    replay_main()


if __name__ == "__main__":
    main()

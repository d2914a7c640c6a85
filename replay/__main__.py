"""``python -m replay``: the same command line as the ``replay`` script."""

from replay.entry import main

main()

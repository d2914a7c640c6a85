"""Which lookup a request id names: the one rule ``explain`` and ``minimize``
share. A request id may occur in several lookups (a resent request, a
retry); then ``--seq`` must say which one, rather than each command
silently taking a different one."""

from __future__ import annotations

import os
from collections.abc import Sequence

from replay.base.errors import ReplayError


def choose_lookup(
    trace: str | os.PathLike[str], request_id: str, seqs: Sequence[int], seq: int | None
) -> int:
    """The seq of the lookup meant: ``seqs`` are the request's lookups in the
    trace, ``seq`` the user's ``--seq`` (or None)."""
    if seq is not None:
        if seq not in seqs:
            where = f" (its lookups: seq {', '.join(map(str, seqs))})" if seqs else ""
            raise ReplayError(
                f"{trace}: no lookup with request_id {request_id!r} at seq {seq}{where}"
            )
        return seq
    if not seqs:
        raise ReplayError(f"{trace}: no lookup with request_id {request_id!r}")
    if len(seqs) > 1:
        shown = ", ".join(map(str, seqs[:10])) + (", ..." if len(seqs) > 10 else "")
        raise ReplayError(
            f"{trace}: request_id {request_id!r} occurs in {len(seqs)} lookups (seq {shown}); "
            "pick one with --seq"
        )
    return seqs[0]

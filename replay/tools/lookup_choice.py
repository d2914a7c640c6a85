"""Which lookup a request id names: the one rule ``explain`` and ``minimize``
share. A request id may occur in several lookups (a resent request, a
retry); then ``--seq`` must say which one, rather than each command
silently taking a different one."""

from __future__ import annotations

import os
from collections.abc import Sequence

from replay.base.errors import ReplayError
from replay.base.text import nearest, printable


def nearest_requests(trace: str | os.PathLike[str], request_id: str) -> str:
    """The end of an unknown request id's error: the trace's request ids
    nearest to it by edit distance, and the command that lists them all."""
    import shlex

    from replay.format.tracedir import open_trace

    frame = open_trace(trace).read_frame(["kind", "request_id"])
    ids = frame.filter(frame["kind"] == "lookup")["request_id"].drop_nulls()
    if ids.is_empty():
        return " (the trace has no lookups)"
    close = ", ".join(
        repr(printable(i)) for i in nearest(request_id, ids.unique(maintain_order=True).to_list())
    )
    where = shlex.quote(os.fspath(trace))
    return f"; nearest: {close} (replay info {where} --requests lists them all)"


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
        raise ReplayError(
            f"{trace}: no lookup with request_id {request_id!r}{nearest_requests(trace, request_id)}"
        )
    if len(seqs) > 1:
        shown = ", ".join(map(str, seqs[:10])) + (", ..." if len(seqs) > 10 else "")
        raise ReplayError(
            f"{trace}: request_id {request_id!r} occurs in {len(seqs):,} lookups (seq {shown}); "
            "pick one with `seq`"
        )
    return seqs[0]

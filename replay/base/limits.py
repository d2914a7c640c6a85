"""The resource limits every reader and importer holds a file to.

A small file may declare sizes that decode to far more memory than the
machine has (a 792-byte Parquet file claiming 2**31 copies of a hash in one
row, one JSONL line of millions of hash ids). Each limit is checked against
what a file declares before it is decoded where the format allows (the
Parquet footer), else as each row is read, and a refusal is one line naming
the limit and the environment variable that raises it (a face names its
own option instead: the ``replay`` group's ``--max-row-hashes N`` sets
``REPLAY_MAX_ROW_HASHES``); they travel to worker processes through those
variables.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, AnyStr

from replay.base.errors import ReplayError
from replay.base.units import parse_count

#: Token counts above this are refused: sums over millions of lookups
#: (hit ratios, report totals) must stay inside int64.
TOKEN_LIMIT = 1 << 48


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: its name, its environment variable, its default, and
    what it bounds (in the refusal's words)."""

    name: str
    env: str
    default: int
    what: str

    def value(self) -> int:
        text = os.environ.get(self.env)
        if text is None:
            return self.default
        return parse_count(text, self.env, least=1)

    def refuse(self, where: str, found: int, error: type[ReplayError] = ReplayError) -> ReplayError:
        """The one-line refusal (an ``error``): ``where`` (e.g. ``"t.parquet:
        seq 5: block_hashes holds"``) then ``found`` and what is over the limit."""
        return error(
            f"{where} {found:,} {self.what}, above the limit of {self.value():,} "
            f"(`{self.env}` raises it)"
        )


#: Hashes in one row (a trace row's ``block_hashes``, a JSONL line's hash ids).
ROW_HASHES = Limit("max_row_hashes", "REPLAY_MAX_ROW_HASHES", 1 << 22, "hashes in one row")
#: Hashes in one Parquet row group (decoded a batch at a time, but declared whole).
GROUP_HASHES = Limit(
    "max_group_hashes", "REPLAY_MAX_GROUP_HASHES", 1 << 26, "hashes in one row group"
)
#: Bytes of one hash. vLLM's digests are 32 bytes; a longer hash is kept out
#: of the store's slots (replay.engine.kernels), so one long hash among short
#: ones costs its own bytes only, but a trace of them is likely a mistake.
HASH_BYTES = Limit("max_hash_bytes", "REPLAY_MAX_HASH_BYTES", 128, "bytes in one hash")
#: What the store's keys can hold at all (replay.engine.kernels).
MAX_HASH_BYTES = 65534
#: Bytes of one line of a JSONL input.
LINE_BYTES = Limit("max_line_bytes", "REPLAY_MAX_LINE_BYTES", 64 << 20, "bytes in one line")

#: Bytes of one record of a binary input (a KV-event dump's length-prefixed
#: msgpack record), checked against its length prefix before it is read.
RECORD_BYTES = Limit("max_record_bytes", "REPLAY_MAX_RECORD_BYTES", 64 << 20, "bytes in one record")

#: KV-cache groups of a trace's config (vLLM's models have a handful): a
#: config of 5,000 groups took 2.5 GB and half a minute to replay 50 blocks.
GROUPS = Limit("max_groups", "REPLAY_MAX_GROUPS", 1024, "KV-cache groups")

#: Bytes of a text column (request_id, medium) in one Parquet row group, as
#: the footer declares them: one 256 MiB request_id (a few KB compressed)
#: took 2.2 GB to validate and 2.8 GB to replay.
TEXT_BYTES = Limit(
    "max_text_bytes", "REPLAY_MAX_TEXT_BYTES", 64 << 20, "bytes of text in one row group"
)

#: Bytes of a Parquet file's footer (its schema, the key-value metadata that
#: holds a trace's config, and the row-group index), read from the file's
#: last eight bytes before pyarrow parses it: a 400,000-group config in the
#: metadata took 759 MB to parse before the group limit could refuse it.
FOOTER_BYTES = Limit(
    "max_footer_bytes", "REPLAY_MAX_FOOTER_BYTES", 16 << 20, "bytes of Parquet footer"
)

LIMITS = (
    ROW_HASHES,
    GROUP_HASHES,
    HASH_BYTES,
    LINE_BYTES,
    RECORD_BYTES,
    GROUPS,
    TEXT_BYTES,
    FOOTER_BYTES,
)


def bounded_lines(fh: IO[AnyStr], path: object) -> Iterator[tuple[int, AnyStr]]:
    """The lines of a JSONL file, numbered from 1; a line longer than
    :data:`LINE_BYTES` is refused once that much of it was read (a file of
    one endless line is never held whole)."""
    limit = LINE_BYTES.value()
    line_no = 0
    while True:
        try:
            line = fh.readline(limit + 1)
        except OSError as exc:  # a file that is no file (/proc/self/mem) names itself
            raise ReplayError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if not line:
            return
        line_no += 1
        if len(line) > limit and line[-1:] not in ("\n", b"\n"):
            raise LINE_BYTES.refuse(f"{path}: line {line_no} holds more than", limit)
        yield line_no, line

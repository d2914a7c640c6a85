"""The reference coordinator's fixed point and a lookup's facts, compiled
(numba): one implementation for the replay and the what-if's pools."""

from replay.rules.compiled.lookup import answer, answer_batch, new_out
from replay.rules.compiled.tables import LookupTables, lookup_tables, out_width, supported

__all__ = [
    "LookupTables",
    "answer",
    "answer_batch",
    "lookup_tables",
    "new_out",
    "out_width",
    "supported",
]

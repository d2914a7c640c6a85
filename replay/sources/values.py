"""What the source readers share about a decoded value: how an error names
its type, whether it is an integer, a block hash or text, and the row dict
they hand to a trace writer; where their reports go.

Readers of msgpack (KV events) and of JSON (lookup logs, Mooncake files)
name types in the vocabulary of their format, so a user reads ``bin`` or
``an object`` as the file calls it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from replay.base.errors import ReplayError

Row = dict[str, Any]
#: Where a reader's one-line reports (a skipped message, a gap) go.
Report = Callable[[str], None]

U64_MAX = (1 << 64) - 1

# The kinds of decoded value, bool before int (a bool is an int), and what
# each format's messages call them.
_KINDS: tuple[type | tuple[type, ...], ...] = (
    type(None),
    bool,
    int,
    float,
    str,
    (bytes, bytearray, memoryview),
    (list, tuple),
    dict,
)
#: msgpack's words (KV-event payloads, and the lookup logs' messages, which
#: have always used them).
MSGPACK_TYPES = ("nil", "bool", "int", "float", "str", "bin", "array", "map")
#: A JSON reader's words (the Mooncake importers).
JSON_TYPES = (
    "null",
    "a boolean",
    "an integer",
    "a number",
    "a string",
    "bytes",
    "a list",
    "an object",
)


def type_name(value: object, vocabulary: tuple[str, ...]) -> str:
    """``value``'s type in a format's vocabulary."""
    for kind, name in zip(_KINDS, vocabulary, strict=True):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def msgpack_type(value: object) -> str:
    return type_name(value, MSGPACK_TYPES)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def hash_bytes(value: object) -> bytes:
    """A block hash as the trace stores it (an integer as 8 bytes big-endian);
    ``ValueError`` names what is wrong."""
    if isinstance(value, bytes | bytearray | memoryview):
        if not len(value):
            # No block of vLLM's has an empty hash; the trace format refuses one.
            raise ValueError("hash is empty (expected non-empty bytes)")
        return bytes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= U64_MAX:
            raise ValueError(f"hash {value} is not an unsigned 64-bit integer")
        return value.to_bytes(8, "big")
    raise ValueError(f"expected bytes or an unsigned 64-bit integer, got {msgpack_type(value)}")


def is_text(value: str) -> bool:
    """Whether ``value`` can be written as UTF-8: JSON may escape lone
    surrogates ("\\ud800") and a command line may hold undecodable bytes;
    no trace can hold either."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def parse_json(
    data: str | bytes, *, invalid: str, nested: str, error: type[ReplayError] = ReplayError
) -> Any:
    """``json.loads``, or ``error`` in one line: ``invalid`` and the reason in
    parentheses (bad JSON, bad UTF-8, an integer of more than 4300 digits),
    or ``nested`` when it is nested too deeply for Python."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        reason = nested if isinstance(exc, RecursionError) else f"{invalid} ({one_line(exc)})"
        raise error(reason) from None


def to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

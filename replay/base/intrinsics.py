"""Two machine instructions numba does not offer, for the compiled kernels.

``load_u64``: an 8-byte word read at any byte of an array, for the kernels
that read wire formats a word at a time (``replay.sources.lookup_wire``,
``replay.sources.kv_columns``): numba has no unaligned load, and a word put
together from its 8 bytes was 20 times slower than the one load the CPU
does (x86 and ARM read any address).

``prefetch``: a hint that an element will be read soon, for a hash table
whose keys land anywhere in hundreds of MB (the store fold's
``replay.engine.kernels``): asked a few keys ahead, a probe's cache miss
overlaps the ones before it instead of stalling the loop."""

from __future__ import annotations

import sys
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: The words are read in the machine's byte order: the kernels that read
#: them as little-endian take their fast path only where this is True.
LITTLE_ENDIAN = sys.byteorder == "little"


def _element(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """A pointer to ``arr[idx]``, the intrinsics' two arguments."""
    aryty = signature.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(  # type: ignore[no-untyped-call]
        context, builder, aryty, ary, [args[1]]
    )


@intrinsic
def _load_u64_intrinsic(typingctx: Any, arr: Any, idx: Any) -> Any:
    """``arr[idx : idx + 8]`` (a uint8 array) as one uint64 in the machine's
    byte order; the caller keeps ``idx + 8`` within the array."""
    sig = types.uint64(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = _element(context, builder, signature, args)
        word = builder.bitcast(ptr, ir.IntType(64).as_pointer())
        return builder.load(word, align=1)

    return sig, codegen


load_u64: Any = _load_u64_intrinsic


@intrinsic
def _prefetch_intrinsic(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Hint the CPU to fetch ``arr[idx]`` into cache (LLVM's prefetch: a
    read, kept in every level of cache)."""
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        # As a byte pointer: one declaration serves arrays of every dtype in
        # one function (a uint64 table's and an int32 one's).
        ptr = builder.bitcast(
            _element(context, builder, signature, args), ir.IntType(8).as_pointer()
        )
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, fnty, "llvm.prefetch.p0"
        )
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


prefetch: Any = _prefetch_intrinsic

"""The hybrid fixed point and a lookup's facts, compiled: the reference's
``Coordinator.lookup_present`` and ``FactRules.facts`` line for line, for
every release's rules (field values in ``params``, see
``replay.rules.compiled.tables``), both caches, every group kind.

``answer`` is the one compiled lookup: the replay answers its batches with
``answer_batch``, and the what-if's pools (``replay.whatif.kernel``,
``replay.whatif.mooncake_kernel``) call ``answer`` once per request with the
presence their simulated store gives. Presence comes flat: group ``g``'s
hash unit ``x`` is ``present[base + g * stride + x]`` for ``x < u``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.base.jit import jit
from replay.rules.compiled.finders import cdiv, find
from replay.rules.compiled.tables import (
    FA,
    G_ASK_NEED,
    G_ASK_PER,
    G_ASK_SHIFT,
    G_BS,
    G_EAGLE_ATTENTION,
    G_FINE,
    G_KIND,
    G_SPEC,
    L_ALIGN,
    L_ALIGN_BEFORE_POP,
    L_ASK_ALL,
    L_FULL_REUSE_OWN,
    L_HBS,
    L_MAMBA_PEEK,
    L_PEEK_CAP_HASHED,
    L_SINGLE_CALL,
    L_SINGLE_PASS,
    L_TRIM_CEIL,
    L_TRIM_EVERY_FULL,
    L_VERIFY_ONCE,
    L_WORKER,
    MAMBA,
    O_ABSENT,
    O_ATTENTION,
    O_EAGLE,
    O_GROUP_HIT,
    O_GROUP_STATE,
    O_GROUPS,
    O_HIT,
    O_LOADED,
    O_MASK,
    O_STATE,
    O_VERIFIED,
    O_WIDTH,
    SP_BS,
    SP_EAGLE,
    SP_FIRST,
    SP_KIND,
    SP_MARGIN,
    SP_MEMBERS,
    out_width,
)

#: Columns of ``res`` (one row per spec group): the finder's last answer
#: (null blocks, loaded blocks, hit, matched), whether it was called, and
#: where the spec group's presence is read (its own member's, or ``merged``).
R_NULLS, R_LOADED, R_HIT, R_MATCHED, R_CALLED, R_OFF, R_OWN, R_LEN = range(8)


@jit(nogil=True)
def spec_presence(
    specs: Any, members: Any, present: Any, base: int, stride: int, u: int, merged: Any, s: int
) -> Any:
    """Spec group ``s``'s presence as ``(array, offset)``: its one member's
    own, or the AND of its members' written into ``merged``'s row ``s``."""
    if specs[s, SP_MEMBERS] == 1:
        return present, base + specs[s, SP_FIRST] * stride
    off = s * stride
    first = True
    for g in range(members.shape[1]):
        if not members[s, g]:
            continue
        src = base + g * stride
        if first:
            for x in range(u):
                merged[off + x] = present[src + x]
            first = False
        else:
            for x in range(u):
                merged[off + x] &= present[src + x]
    return merged, off


@jit(nogil=True)
def fixed_point(
    params: Any,
    specs: Any,
    members: Any,
    present: Any,
    base: int,
    stride: int,
    u: int,
    max_length: int,
    merged: Any,
    res: Any,
    verified: Any,
) -> Any:
    """Every spec group agreeing on one hit (``lookup_present``). Fills
    ``res`` (the ``R_*`` columns, before the trim); returns the hit and the
    longest hit a finder call found (the what-if's junction)."""
    num_specs = specs.shape[0]
    hbs = params[L_HBS]
    align = params[L_ALIGN]
    before_pop = params[L_ALIGN_BEFORE_POP] != 0
    verify_once = params[L_VERIFY_ONCE] != 0
    for s in range(num_specs):
        res[s, R_CALLED] = 0
        verified[s] = 0
    if params[L_SINGLE_CALL]:
        p, off = spec_presence(specs, members, present, base, stride, u, merged, 0)
        n0, l0, h0, m0 = find(
            specs, 0, p, off, u, hbs, max_length, specs[0, SP_EAGLE] != 0, align, before_pop
        )
        res[0, R_NULLS], res[0, R_LOADED], res[0, R_HIT], res[0, R_MATCHED] = n0, l0, h0, m0
        res[0, R_CALLED] = 1
        return h0, h0
    # Each spec group's presence is merged once per lookup.
    for s in range(num_specs):
        res[s, R_OWN] = specs[s, SP_MEMBERS] == 1
        p, off = spec_presence(specs, members, present, base, stride, u, merged, s)
        res[s, R_OFF] = off
    hit = max_length
    peek_cap = u * hbs if params[L_PEEK_CAP_HASHED] else max_length
    longest = 0
    while True:
        cand = hit
        for s in range(num_specs):
            kind = specs[s, SP_KIND]
            if kind == FA and res[s, R_CALLED]:
                if params[L_FULL_REUSE_OWN]:
                    cand = min(cand, res[s, R_HIT])
                else:  # before 0.26: floored to the block size
                    cand -= cand % specs[s, SP_BS]
                continue
            drop = specs[s, SP_EAGLE] != 0 and (verified[s] == 0 or not verify_once)
            bound = cand
            if drop and verify_once and (kind != MAMBA or params[L_MAMBA_PEEK]):
                bound = min(cand + specs[s, SP_MARGIN], peek_cap)
            off = res[s, R_OFF]
            if res[s, R_OWN]:
                n0, l0, h0, m0 = find(
                    specs, s, present, off, u, hbs, bound, drop, align, before_pop
                )
            else:
                n0, l0, h0, m0 = find(specs, s, merged, off, u, hbs, bound, drop, align, before_pop)
            if drop:
                verified[s] = 1
            elif h0 < cand:
                for t in range(num_specs):
                    verified[t] = 0
            longest = max(longest, h0)
            cand = h0
            res[s, R_NULLS], res[s, R_LOADED], res[s, R_HIT], res[s, R_MATCHED] = n0, l0, h0, m0
            res[s, R_CALLED] = 1
        if cand >= hit:
            break
        hit = cand
        if params[L_SINGLE_PASS]:
            break
    # Full attention keeps the blocks of the converged hit.
    for s in range(num_specs):
        if specs[s, SP_KIND] == FA and (params[L_TRIM_EVERY_FULL] or s == 0):
            bs = specs[s, SP_BS]
            keep = cdiv(hit, bs) if params[L_TRIM_CEIL] else hit // bs
            res[s, R_LOADED] = min(res[s, R_LOADED], keep)
    return hit, longest


@jit(nogil=True)
def first_absent(p: Any, off: int, k: int, nview: int, lo: int, hi: int) -> int:
    """The first absent block in ``[lo, hi)`` (-1: none); blocks past the
    request's own hashes cannot be present."""
    if lo >= hi:
        return -1
    for i in range(lo, min(hi, nview)):
        if p[off + i * k + k - 1] == 0:
            return i
    return max(lo, nview) if hi > nview else -1


@jit(nogil=True)
def group_absent(
    p: Any, off: int, u: int, hbs: int, bs: int, mamba: bool, first: int, stop: int, end: int
) -> int:
    """``FactRules._first_missing``: a block ``end`` lands inside is served
    by any present unit of it at or past ``end`` (-1: none absent)."""
    if stop <= first:
        return -1
    k = bs // hbs
    nview = u // k
    tail = end // bs if end % bs else -1
    if not first <= tail < stop:
        return int(first_absent(p, off, k, nview, first, stop))
    before: int = first_absent(p, off, k, nview, first, tail)
    if before >= 0:
        return before
    lo = cdiv(end, hbs) - 1
    ok = False
    if mamba:
        ok = lo < u and p[off + lo] == 1
    else:
        for x in range(lo, min((tail + 1) * k, u)):
            if p[off + x] == 1:
                ok = True
                break
    return first_absent(p, off, k, nview, tail + 1, stop) if ok else tail


@jit(nogil=True)
def write_facts(
    params: Any,
    groups: Any,
    present: Any,
    base: int,
    stride: int,
    u: int,
    hit: int,
    res: Any,
    out: Any,
    row: int,
) -> None:
    """The answer's per-group outcome and its facts into ``out[row]``."""
    hbs = params[L_HBS]
    covered = -1
    verified = -1
    state = -1
    for g in range(groups.shape[0]):
        s = groups[g, G_SPEC]
        kind, bs = groups[g, G_KIND], groups[g, G_BS]
        loaded = res[s, R_LOADED]
        mask = res[s, R_NULLS] + loaded
        ghit = res[s, R_HIT]
        col = O_GROUPS + O_WIDTH * g
        out[row, col + O_MASK] = mask
        out[row, col + O_LOADED] = loaded
        out[row, col + O_GROUP_HIT] = ghit
        if kind == MAMBA:
            state = max(state, ghit)
            if loaded == 0:
                resumed = 0
            elif groups[g, G_FINE]:
                resumed = ghit
            else:
                resumed = mask * bs
            out[row, col + O_GROUP_STATE] = resumed
            end = resumed
        else:
            verified = ghit if verified < 0 else min(verified, ghit)
            c = mask * bs
            covered = c if covered < 0 else min(covered, c)
            out[row, col + O_GROUP_STATE] = -1
            end = hit
        off = base + g * stride
        out[row, col + O_ABSENT] = group_absent(
            present, off, u, hbs, bs, kind == MAMBA, mask - loaded, mask, end
        )
        if groups[g, G_EAGLE_ATTENTION]:
            unit = hit // hbs if groups[g, G_FINE] else (hit // bs + 1) * (bs // hbs) - 1
            out[row, col + O_EAGLE] = 1 if unit < u and present[off + unit] else 0
        else:
            out[row, col + O_EAGLE] = -1
    out[row, O_HIT] = hit
    out[row, O_ATTENTION] = covered
    out[row, O_VERIFIED] = hit if verified < 0 else verified
    out[row, O_STATE] = state


@jit(nogil=True)
def asked_present(
    params: Any,
    groups: Any,
    present: Any,
    base: int,
    stride: int,
    u: int,
    token_len: int,
    asked: Any,
) -> bool:
    """What the Mooncake store worker learns of the lookup's presence at
    the aligned length ``token_len`` (``Coordinator.asked_present``), written
    into the scratch ``asked`` from 0 with stride ``u`` (no allocation: the
    what-if's pool compiles without numba's runtime); False when it asks
    nothing."""
    hbs = params[L_HBS]
    limit = min(u, token_len // hbs)
    if limit <= 0:
        return False
    num_groups = groups.shape[0]
    asked[: num_groups * u] = 0
    any_asked = False
    for g in range(num_groups):
        src = base + g * stride
        dst = g * u
        if params[L_ASK_ALL]:
            for x in range(limit):
                asked[dst + x] = present[src + x]
            any_asked = True
            continue
        k = groups[g, G_BS] // hbs
        per, need, shift = groups[g, G_ASK_PER], groups[g, G_ASK_NEED], groups[g, G_ASK_SHIFT]
        for c in range(limit // k):
            if per and (c < shift or (c - shift) % per < per - need):
                continue
            x = c * k + k - 1
            asked[dst + x] = present[src + x]
            any_asked = True
    return any_asked


@jit(nogil=True)
def nothing(specs: Any, res: Any) -> None:
    """No spec group loads or hits anything (the worker answered 0)."""
    for s in range(specs.shape[0]):
        res[s, R_NULLS], res[s, R_LOADED], res[s, R_HIT], res[s, R_MATCHED] = 0, 0, 0, 0


@jit(nogil=True)
def worker_point(
    params: Any,
    specs: Any,
    members: Any,
    groups: Any,
    present: Any,
    base: int,
    stride: int,
    u: int,
    num_tokens: int,
    merged: Any,
    res: Any,
    verified: Any,
    asked: Any,
) -> Any:
    """The store worker's ``lookup(num_tokens, block_hashes)``
    (``Coordinator._worker_lookup``): the fixed point at the aligned prompt
    length over what the store answered (in the scratch ``asked``), again
    below the prompt's end after a whole-prompt hit. Returns the hit and
    the longest finder hit."""
    align = params[L_ALIGN]
    token_len = num_tokens // align * align
    if not asked_present(params, groups, present, base, stride, u, token_len, asked):
        nothing(specs, res)
        return 0, 0
    hit, longest = fixed_point(
        params, specs, members, asked, 0, u, u, token_len, merged, res, verified
    )
    if hit < num_tokens:
        return hit, longest
    usable = (num_tokens - 1) // align * align
    if usable <= 0:
        nothing(specs, res)
        return 0, longest
    hit, again = fixed_point(params, specs, members, asked, 0, u, u, usable, merged, res, verified)
    return hit, max(longest, again)


@jit(nogil=True)
def answer(
    params: Any,
    specs: Any,
    members: Any,
    groups: Any,
    present: Any,
    base: int,
    stride: int,
    u: int,
    max_length: int,
    merged: Any,
    res: Any,
    verified: Any,
    asked: Any,
    out: Any,
    row: int,
    want_junction: int,
) -> int:
    """One lookup answered, its outcome and facts in ``out[row]`` (the
    ``O_*`` columns); ``merged``, ``res``, ``verified`` and ``asked`` (at
    least groups x ``u`` entries) are the caller's scratch. With ``want_junction``, returns the shared-prefix
    junction a prefill of it pins (``store_rules.lookup_junction``): the
    longest hit a finder call of the fixed point at ``max_length`` found,
    when above that fixed point's hit (the engine's lookup pins it, also
    where the lookup itself entered through the Mooncake store worker),
    else 0."""
    junction = 0
    if params[L_WORKER]:
        if want_junction:
            fixed, longest = fixed_point(
                params, specs, members, present, base, stride, u, max_length, merged, res,
                verified,
            )  # fmt: skip
            junction = longest if longest > fixed else 0
        hit, longest = worker_point(
            params, specs, members, groups, present, base, stride, u, max_length + 1,
            merged, res, verified, asked,
        )  # fmt: skip
    else:
        hit, longest = fixed_point(
            params, specs, members, present, base, stride, u, max_length, merged, res, verified
        )
        if want_junction and longest > hit:
            junction = longest
    write_facts(params, groups, present, base, stride, u, hit, res, out, row)
    return int(junction)


@jit(nogil=True)
def answer_batch(
    params: Any,
    specs: Any,
    members: Any,
    groups: Any,
    present: Any,
    units: Any,
    max_lengths: Any,
    out: Any,
) -> None:
    """A batch of lookups in the fold's layout (per lookup, per group, its
    ``units[i]`` hash units), one row of ``out`` each."""
    num_groups = groups.shape[0]
    max_u = 0
    for i in range(units.shape[0]):
        max_u = max(max_u, units[i])
    merged = np.zeros(specs.shape[0] * (max_u + 1), dtype=np.uint8)
    res = np.zeros((specs.shape[0], R_LEN), dtype=np.int64)
    verified = np.zeros(specs.shape[0], dtype=np.int64)
    asked = np.zeros(num_groups * (max_u + 1), dtype=np.uint8)
    base = 0
    for i in range(units.shape[0]):
        n = units[i]
        answer(
            params, specs, members, groups, present, base, n, n, max_lengths[i],
            merged, res, verified, asked, out, i, 0,
        )  # fmt: skip
        base += n * num_groups


def new_out(lookups: int, num_groups: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Rows for ``lookups`` answers of ``num_groups`` groups."""
    return np.empty((lookups, out_width(num_groups)), dtype=np.int64)

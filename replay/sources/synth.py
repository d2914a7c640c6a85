"""A production-style synthetic trace generator, reproducible from a seed.

The model is one of ``replay.sources.archetypes`` (the layer mixes vLLM's
hybrid coordinator meets in production).

Workload (``SessionModel``): chat sessions arrive as a Poisson process; each
picks one of a few system prompts with Zipf popularity (the popular shared
prefixes) and runs a geometric number of turns. A turn's prompt is the
previous turn's prompt plus its answer plus a new user message, so a
follow-up's hashes start with every full-block hash of the previous prompt;
the block that straddled the old prompt's end holds new tokens and gets a
new hash. System prompt, user and answer lengths are lognormal; turns are
separated by the answer's decode time plus an exponential think time;
sessions stop before the context limit. The requests of all sessions are
interleaved in arrival order, which is what gives an LRU store its
pressure. Defaults: 64 system prompts (Zipf exponent 1.1), lognormal
medians of 800 / 200 / 250 tokens (system / user message / answer), 3 turns
on average, prompts up to 32k tokens: a mean prompt of about 2.7k tokens,
p99 about 10k. Request ids are ``s{session}-t{turn}``; time starts at
2025-01-01T00:00:00Z. Each request's rows (lookup, evictions, stores) come
from ``replay.sources.workload``; which blocks each kind of group stores,
and why, is ``replay.rules.store_rules`` (vLLM 0.33.0's rules for the chosen
cache, retention interval and token budget).

Hashes: vLLM chains ``hash(parent, token block)``; here every generated
token block is fresh content, so a counter over created hash units already
names each prefix uniquely, and a unit of a follow-up that repeats a
previous prompt reuses that prompt's unit. The digest is a bijective 64-bit
mix of that unit id (salted by the seed) widened to 16 or 32 bytes: equal
digests iff equal prefixes, with no collision possible, computed in bulk.

``inject_overrun=N`` adds N scenarios of vLLM bug #43559, each a request
and its identical resend (a client retry) adjacent in the log: the first
stores its prompt as usual plus the Mamba state at the prompt's aligned end
``k * A`` (as if a prefill chunk ended there), the resend looks up
``max_length = k * A``. Full attention matches all ``k * A`` tokens and
drops one block for EAGLE; under policy ``pre-49502`` the Mamba group's peek
margin reaches the state at ``k * A``, so the hit is ``k * A`` while
attention verified only ``(k - 1) * A``; under ``vllm-0.33`` the hit is
``(k - 1) * A``. A resend (rather than a longer follow-up) also triggers
the bug with three spec groups: the widened Mamba hit reaches
``max_length``, which ends the fixed point before attention can cap it.
The expected hits are computed with the reference coordinator when the
trace is generated (an archetype or block-size mix where the two policies
agree is an error) and recorded in the summary and in the trace's
``source`` metadata, with the resends' ``seq``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from replay.base.errors import ReplayError
from replay.base.spec import GroupKind, TraceConfig
from replay.format.writer import TraceWriter
from replay.rules.coordinator import Coordinator
from replay.rules.store_rules import StoreSettings, with_lookahead
from replay.sources.archetypes import archetype_config
from replay.sources.hashing import Digests, DigestTable, Keys, digest_keys, lane_salts
from replay.sources.workload import WorkloadWriter

#: 2025-01-01T00:00:00Z in microseconds: where synthetic time starts.
BASE_TS_US = 1_735_689_600_000_000


@dataclass(frozen=True, slots=True)
class Lognormal:
    """A length distribution: lognormal with this median and sigma."""

    median: float
    sigma: float

    def draw(
        self, rng: np.random.Generator, size: int, low: int, high: int
    ) -> npt.NDArray[np.int64]:
        x = rng.lognormal(math.log(self.median), self.sigma, size)
        return np.clip(np.rint(x), low, high).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionModel:
    """The workload's distributions (lengths in tokens, times in seconds)."""

    system_prompts: int = 64
    system_zipf: float = 1.1
    system_tokens: Lognormal = Lognormal(800.0, 0.8)
    user_tokens: Lognormal = Lognormal(200.0, 1.0)
    answer_tokens: Lognormal = Lognormal(250.0, 0.8)
    mean_turns: float = 3.0
    think_time_s: float = 40.0
    decode_tokens_per_s: float = 40.0
    sessions_per_s: float = 2.0
    max_model_len: int = 32768

    def __post_init__(self) -> None:
        for name in ("system_prompts", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ReplayError(f"session model: {name} must be positive")
        if self.mean_turns < 1:
            raise ReplayError("session model: mean_turns must be at least 1")

    def as_source(self) -> dict[str, Any]:
        """The model as the trace's ``source`` lists it, one flat key a number."""
        out: dict[str, Any] = {}
        for name, value in asdict(self).items():
            if isinstance(value, dict):
                out.update({f"{name}_{k}": v for k, v in value.items()})
            else:
                out[name] = value
        return out


@dataclass(frozen=True, slots=True)
class _Schedule:
    session: npt.NDArray[np.int64]
    turn: npt.NDArray[np.int64]
    ts_us: npt.NDArray[np.int64]
    num_tokens: npt.NDArray[np.int64]
    last: npt.NDArray[np.bool_]
    system: npt.NDArray[np.int64]  # per session
    system_tokens: npt.NDArray[np.int64]  # per system prompt


def _grouped_cumsum(
    x: npt.NDArray[np.float64] | npt.NDArray[np.int64], counts: npt.NDArray[np.int64]
) -> Any:
    """Inclusive cumulative sums restarting at each group (groups are runs of
    ``counts`` consecutive elements)."""
    c = np.cumsum(x)
    first = np.cumsum(counts) - counts
    return c - np.repeat(c[first] - x[first], counts)


def _schedule(rng: np.random.Generator, sm: SessionModel, n: int) -> _Schedule:
    """The first ``n`` requests, in arrival order, of an open-ended stream of sessions."""
    ranks = np.arange(1, sm.system_prompts + 1, dtype=np.float64)
    popularity = ranks**-sm.system_zipf
    popularity /= popularity.sum()
    system_tokens = sm.system_tokens.draw(rng, sm.system_prompts, 1, sm.max_model_len // 2)
    starts: list[npt.NDArray[np.float64]] = []
    t0 = 0.0
    batch = max(16, int(n / sm.mean_turns * 1.2))
    parts: list[tuple[npt.NDArray[np.int64], ...]] = []
    systems: list[npt.NDArray[np.int64]] = []
    first_session = 0
    while True:
        start = t0 + np.cumsum(rng.exponential(1.0 / sm.sessions_per_s, batch))
        system = rng.choice(sm.system_prompts, size=batch, p=popularity).astype(np.int64)
        turns = rng.geometric(1.0 / sm.mean_turns, batch).astype(np.int64)
        total = int(turns.sum())
        sess = np.repeat(np.arange(batch, dtype=np.int64), turns)
        turn = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(turns) - turns, turns)
        user = sm.user_tokens.draw(rng, total, 1, 16384)
        answer = sm.answer_tokens.draw(rng, total, 1, 8192)
        think = rng.exponential(sm.think_time_s, total)
        prev_answer = np.concatenate(([0], answer[:-1]))
        gap = np.where(turn == 0, 0.0, prev_answer / sm.decode_tokens_per_s + think)
        when = start[sess] + _grouped_cumsum(gap, turns)
        prompt = (
            system_tokens[system[sess]]
            + _grouped_cumsum(user, turns)
            + _grouped_cumsum(answer, turns)
            - answer
        )
        ok = prompt <= sm.max_model_len  # prompts grow, so this keeps a prefix of turns
        kept_turns = np.bincount(sess[ok], minlength=batch)
        last = turn == kept_turns[sess] - 1
        ts = BASE_TS_US + np.rint(when * 1e6).astype(np.int64)
        parts.append((sess[ok] + first_session, turn[ok], ts[ok], prompt[ok], last[ok]))
        systems.append(system)
        starts.append(start)
        first_session += batch
        t0 = float(start[-1])
        # Every request before the last session's start is known: stop once
        # there are enough of them.
        limit = BASE_TS_US + int(t0 * 1e6)
        if sum(int(np.count_nonzero(p[2] <= limit)) for p in parts) >= n:
            break
    sess_all, turn_all, ts_all, prompt_all, last_all = (
        np.concatenate([p[i] for p in parts]) for i in range(5)
    )
    order = np.lexsort((turn_all, sess_all, ts_all))[:n]
    return _Schedule(
        session=sess_all[order],
        turn=turn_all[order],
        ts_us=ts_all[order],
        num_tokens=prompt_all[order].astype(np.int64),
        last=last_all[order].astype(bool),
        system=np.concatenate(systems),
        system_tokens=system_tokens,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Injection:
    index: int  # natural request it precedes
    k: int  # prompt end in alignment units
    request_id: str
    resend_id: str


def _overrun_expectations(
    writer: WorkloadWriter, config: TraceConfig, k: int
) -> tuple[int, int, int, dict[int, list[int]]]:
    """(num_tokens, hit under pre-49502, hit under vllm-0.33, extra Mamba blocks)
    of one injected scenario, from the reference coordinator."""
    align = config.scheduler_block_size
    num_tokens = k * align + 1
    units = np.arange(config.hashed_units(num_tokens), dtype=np.int64)
    extra = {
        gid: [k * align // g.block_size - 1]
        for gid, g in enumerate(config.groups)
        if g.kind is GroupKind.MAMBA
    }
    views = writer.group_views(units)
    present = [
        set(views[gid][idx].tolist())
        for gid, idx in enumerate(writer.stored_indices(num_tokens, extra_blocks=extra))
    ]
    contains = [s.__contains__ for s in present]
    hashes = units.tolist()
    hits = [
        Coordinator(config, policy).lookup(hashes, num_tokens - 1, contains).hit_tokens
        for policy in ("pre-49502", "vllm-0.33")
    ]
    return num_tokens, hits[0], hits[1], extra


def synth_trace(
    path: str | os.PathLike[str],
    *,
    model: str = "full+mamba",
    requests: int = 1000,
    seed: int = 0,
    eagle: bool = False,
    lookahead_tokens: int = 0,
    capacity_blocks: int | None = None,
    block_size: int = 16,
    hash_block_size: int | None = None,
    inject_overrun: int = 0,
    clear_every: int | None = None,
    sliding_window: int | None = None,
    extra_retained_tokens: int = 0,
    attention_chunk_size: int = 8192,
    mamba_block_size: int | None = None,
    retention_interval: int | None = 0,
    max_num_batched_tokens: int = 8192,
    cache: str = "mooncake",
    settings: StoreSettings | None = None,
    hash_bytes: int = 16,
    session_model: SessionModel | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write a synthetic trace to ``path`` (atomically, in row groups) and
    return a summary: event counts, hash entries, bytes, injected scenarios.

    ``requests`` counts the workload's requests; each injected scenario adds
    two more lookups. ``capacity_blocks`` bounds the store (None: unbounded),
    ``clear_every`` emits a ``clear`` row before every that-many-th request.
    ``retention_interval``, ``max_num_batched_tokens`` and ``cache`` choose
    the store rules (``replay.rules.store_rules.StoreSettings``), or
    ``settings`` gives them whole (with the release policy whose stores to
    produce: ``settings.policy``). ``lookahead_tokens`` is vLLM's
    ``num_hash_lookahead_tokens`` (with EAGLE, from 0.33.0): a prompt carries
    the hashes of its units less the lookahead, and a prefix shared up to a
    unit's end shares its key only when it goes on for the lookahead too
    (the system prompts' last units are each request's own). ``progress`` is
    called with the number of requests done since its last call."""
    if requests < 0:
        raise ReplayError(f"requests must be >= 0, got {requests}")
    if inject_overrun < 0:
        raise ReplayError(f"inject_overrun must be >= 0, got {inject_overrun}")
    if hash_bytes not in (16, 32):
        raise ReplayError(f"hash_bytes must be 16 or 32, got {hash_bytes}")
    sm = session_model or SessionModel()
    settings = settings or StoreSettings(
        retention_interval=retention_interval,
        max_num_batched_tokens=max_num_batched_tokens,
        cache=cache,
    )
    config = archetype_config(
        model,
        block_size,
        hash_block_size,
        eagle,
        sliding_window=sliding_window,
        extra_retained_tokens=extra_retained_tokens,
        attention_chunk_size=attention_chunk_size,
        mamba_block_size=mamba_block_size,
    )
    config = with_lookahead(config, lookahead_tokens, settings)
    hbs = config.hash_block_size
    align = config.scheduler_block_size
    rng = np.random.default_rng(seed)
    sched = _schedule(rng, sm, requests)
    salts = lane_salts(seed, hash_bytes // 8)

    def mix(keys: Keys) -> Digests:
        return digest_keys(keys, salts)

    digest = DigestTable(mix)

    # Plan the injected scenarios before writing: their expectations go into
    # the trace's metadata, which the writer puts in the file's schema.
    probe = WorkloadWriter(config, lambda _t: None, digest, settings=settings, background=False)
    injections: list[_Injection] = []
    expected: list[dict[str, Any]] = []
    extras: list[dict[int, list[int]]] = []
    if inject_overrun:
        if not any(g.kind is GroupKind.MAMBA for g in config.groups):
            raise ReplayError(
                f"--inject-overrun needs a model with a Mamba group (#43559), got {model!r}"
            )
        if not eagle:
            raise ReplayError("--inject-overrun needs --eagle (#43559 is an EAGLE margin bug)")
        if lookahead_tokens:
            raise ReplayError(
                "--inject-overrun needs EAGLE's block drop, which lookahead hashes turn off "
                "(#43559 is its margin): use --lookahead-tokens 0"
            )
        positions = np.sort(rng.choice(max(requests, 1), size=inject_overrun, replace=True))
        ks = rng.integers(2, 33, size=inject_overrun)
        for j in range(inject_overrun):
            k = int(ks[j])
            num_tokens, pre, fixed, extra = _overrun_expectations(probe, config, k)
            if pre == fixed:
                raise ReplayError(
                    f"--inject-overrun: #43559 cannot trigger for model {model!r} with these "
                    f"block sizes (both policies give a hit of {fixed} tokens)"
                )
            rid = f"overrun-{j:04d}"
            injections.append(
                _Injection(index=int(positions[j]), k=k, request_id=rid, resend_id=f"{rid}-resend")
            )
            extras.append(extra)
            expected.append(
                {
                    "request_id": f"{rid}-resend",
                    "num_tokens": num_tokens,
                    "max_length": num_tokens - 1,
                    "hit_tokens_pre_49502": pre,
                    "hit_tokens_vllm_033": fixed,
                }
            )
            need = sum(len(idx) for idx in probe.stored_indices(num_tokens, extra_blocks=extra))
            if capacity_blocks is not None and capacity_blocks < need:
                raise ReplayError(
                    f"--capacity-blocks {capacity_blocks} is too small for the injected "
                    f"scenarios (one needs {need} blocks)"
                )

    source: dict[str, Any] = {
        "generator": "replay.sources.synth",
        "model": model,
        "seed": seed,
        "requests": requests,
        "capacity_blocks": capacity_blocks,
        "clear_every": clear_every,
        **settings.as_source(),
        "session_model": sm.as_source(),
        "hash_bytes": hash_bytes,
        "injected_overruns": expected,
    }

    system_keys: list[Keys] = []
    counter = 1
    for tokens in sched.system_tokens.tolist():
        # A unit's lookahead key covers tokens past the system prompt: shared
        # only up to the units the system prompt itself hashes.
        units = config.hashed_units(tokens)
        system_keys.append(np.arange(counter, counter + units, dtype=np.int64))
        counter += units

    with (
        TraceWriter(path, config, hash_width=hash_bytes) as out,
        WorkloadWriter(
            config,
            out.write_table,
            digest,
            capacity_blocks=capacity_blocks,
            settings=settings,
            clear_every=clear_every,
        ) as writer,
    ):
        state: dict[int, Keys] = {}
        sessions = sched.session.tolist()
        turns = sched.turn.tolist()
        stamps = sched.ts_us.tolist()
        lengths = sched.num_tokens.tolist()
        lasts = sched.last.tolist()
        system_of = sched.system.tolist()
        inj = 0
        done = 0
        for i in range(requests + 1):
            while inj < len(injections) and injections[inj].index <= i:
                scenario = injections[inj]
                when = stamps[i] if i < requests else (stamps[-1] if stamps else BASE_TS_US)
                num_tokens = expected[inj]["num_tokens"]
                keys = np.arange(counter, counter + config.hashed_units(num_tokens), dtype=np.int64)
                counter += len(keys)
                writer.add(
                    ts_us=when,
                    request_id=scenario.request_id,
                    num_tokens=num_tokens,
                    unit_keys=keys,
                    extra_blocks=extras[inj],
                )
                # The resend must see the store exactly as the first one left it.
                seq = writer.add(
                    ts_us=when,
                    request_id=scenario.resend_id,
                    num_tokens=num_tokens,
                    unit_keys=keys,
                    allow_clear=False,
                )
                expected[inj]["seq"] = seq
                inj += 1
            if i == requests:
                break
            s = sessions[i]
            prev = state.pop(s, None)
            if prev is None:
                prev = system_keys[system_of[s]]
            n_tokens = lengths[i]
            fresh = config.hashed_units(n_tokens) - len(prev)
            keys = np.concatenate((prev, np.arange(counter, counter + fresh, dtype=np.int64)))
            counter += fresh
            writer.add(
                ts_us=stamps[i],
                request_id=f"s{s}-t{turns[i] + 1}",
                num_tokens=n_tokens,
                unit_keys=keys,
                max_key=counter,
            )
            if not lasts[i]:
                state[s] = keys
            done += 1
            if progress is not None and done == 1000:
                progress(done)
                done = 0
        stats = writer.close()
        # The injected lookups' seqs are known now: the source goes into the
        # file's footer at close.
        out.set_source(source)
        if progress is not None and done:
            progress(done)
    size = Path(path).stat().st_size
    return {
        "path": str(path),
        "model": model,
        "seed": seed,
        "eagle": eagle,
        "lookahead_tokens": lookahead_tokens,
        "requests": requests,
        "capacity_blocks": capacity_blocks,
        **settings.as_source(),
        **stats.as_dict(),
        "distinct_units": counter - 1,
        "bytes": size,
        "injected_overruns": expected,
        "block_size": block_size,
        "hash_block_size": hbs,
        "scheduler_block_size": align,
    }

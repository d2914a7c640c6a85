"""A vLLM plugin that publishes every prefix-cache lookup the scheduler makes.

vLLM's KV events say what the engine's prefix cache stores and evicts, never
what was asked of it. This plugin (entry point ``vllm.general_plugins`` /
``cache_trace_replay``) observes the scheduler and publishes, for each call
of ``KVCacheManager.get_computed_blocks``, the request, its block hashes as
the KV events key them, the hit vLLM found, whether the request was admitted
in that step, and its exact place among the KV events: ``batch`` is the
sequence number of the KV-event batch the step's events go out in (the
number of batches the scheduler published before; vLLM's publisher numbers
batches from 0 in publish order) and ``position`` the number of that batch's
events already queued in the block pool when the lookup ran. A lookup of a
step sees the blocks that requests admitted before it in the same step stored
or evicted, which a timestamp merge cannot reproduce (vLLM stamps the batch
at the end of the step).

It is inert unless ``REPLAY_LOOKUPS`` is set:

- ``REPLAY_LOOKUPS=tcp://HOST:PORT`` binds a ZMQ publisher there (three
  frames per message like vLLM's: topic ``replay.lookups``, 8-byte big-endian
  message number, JSON payload); ``replay record --lookups tcp://HOST:PORT``
  connects to it. The engine facts are sent again to every new subscriber.
- ``REPLAY_LOOKUPS=PATH`` appends the same records to a file, one JSON object
  per line (``replay ingest kv-events DUMP --lookups PATH``).
- Several targets, comma-separated, each get every record.
- With data parallelism each engine's scheduler records to its own target,
  offset like vLLM's publisher: tcp port + rank; otherwise ``_dp{rank}``
  appended (run one recorder per rank, as for the KV events).

It is a neutral observer: it wraps methods, passes their arguments and
results through untouched, and never loads a KV connector (a connector makes
vLLM keep the legacy block hashes, which with EAGLE/MTP turns the EAGLE drop
back on and changes the hits it was meant to record).

Records (JSON objects, ``type`` first):

- ``engine``: once per scheduler, the engine facts the KV events do not
  carry: ``config`` (the trace's ``replay.trace`` metadata object: groups and
  their specs, ``use_eagle`` as the coordinator takes it (the EAGLE drop),
  hash and scheduler block sizes, partial hits) and ``engine`` (speculative
  method, whether vLLM's EAGLE drop is on, lookahead hash tokens, retention
  interval, whether KV events are enabled).
- ``lookup``: ``instance``, ``n`` (running count), ``ts``, ``step``,
  ``batch``, ``position``, ``request_id``, ``block_hashes`` (hex, in the form
  the KV events use: 8 bytes big-endian for vLLM's integer hashes),
  ``num_tokens``, ``num_prompt_tokens``, ``max_length``,
  ``observed_hit_tokens`` and ``admitted``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from replay.adapters.vllm.wire import ENV, FORMAT, TOPIC

_U64 = (1 << 64) - 1


def _hash_hex(value: object) -> str:
    """A hash as the KV events carry it (after vLLM's optional int
    conversion), as hex of the bytes the trace stores."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if isinstance(value, int):
        return (value & _U64).to_bytes(8, "big").hex()
    raise TypeError(f"unexpected block hash type {type(value).__name__}")


# ------------------------------------------------------------------- sinks


class _FileSink:
    """Appends records, one JSON object per line, flushed at every step so
    a killed engine leaves whole lines behind."""

    def __init__(self, path: str) -> None:
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 (lives with the engine)
        self._lock = threading.Lock()

    def send(self, records: list[dict[str, Any]], *, watermark: int, instance: str) -> None:
        if not records:
            return
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        with self._lock:
            self._fh.write(text)
            self._fh.flush()

    def engine(self, record: dict[str, Any]) -> None:
        self.send([record], watermark=0, instance=str(record["instance"]))

    def close(self) -> None:
        self._fh.close()


class _ZmqSink:
    """An XPUB socket owned by one sender thread: the scheduler only puts
    records on a queue (never blocks on the network), and the thread sends
    the engine facts again whenever a subscriber joins (a PUB socket drops
    what was sent before a subscriber connected)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.bind(endpoint)
        self.endpoint = endpoint
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._engines: list[dict[str, Any]] = []
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="replay-lookups", daemon=True)
        self._thread.start()

    def send(self, records: list[dict[str, Any]], *, watermark: int, instance: str) -> None:
        # One message per step even without lookups: its watermark tells the
        # recorder that every batch below it has all its lookups.
        self._queue.put({"instance": instance, "watermark": watermark, "records": records})

    def engine(self, record: dict[str, Any]) -> None:
        self._queue.put({"engine": record, "instance": record["instance"]})

    def _emit(self, payload: dict[str, Any]) -> None:
        frames = [TOPIC, self._seq.to_bytes(8, "big"), json.dumps(payload).encode()]
        self._seq += 1
        self._sock.send_multipart(frames)

    def _emit_engine(self, record: dict[str, Any]) -> None:
        self._emit(
            {
                "format": FORMAT,
                "instance": record["instance"],
                "watermark": None,
                "records": [record],
            }
        )

    def _run(self) -> None:
        zmq = self._zmq
        while True:
            while self._sock.poll(0, zmq.POLLIN):
                msg = self._sock.recv()
                if msg[:1] == b"\x01":  # a subscription: give it the engine facts
                    for rec in self._engines:
                        self._emit_engine(rec)
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            if "engine" in item:
                self._engines.append(item["engine"])
                self._emit_engine(item["engine"])
            else:
                self._emit({"format": FORMAT, **item})

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()


def rank_target(target: str, rank: int) -> str:
    """One target per data-parallel rank, as vLLM offsets its publisher: a
    tcp port + rank; an ipc/inproc endpoint or a file gets ``_dp{rank}``."""
    if rank == 0:
        return target
    if target.startswith("tcp://"):
        base, _, port = target.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{base}:{int(port) + rank}"
        return target
    return f"{target}_dp{rank}"


class _Sinks:
    """Every target of ``REPLAY_LOOKUPS`` (comma-separated) gets every record."""

    def __init__(self, targets: list[str]) -> None:
        self.sinks: list[_FileSink | _ZmqSink] = []
        try:
            for target in targets:
                is_zmq = target.startswith(("tcp://", "ipc://", "inproc://"))
                self.sinks.append(_ZmqSink(target) if is_zmq else _FileSink(target))
        except BaseException:
            self.close()
            raise

    def send(self, records: list[dict[str, Any]], *, watermark: int, instance: str) -> None:
        for sink in self.sinks:
            sink.send(records, watermark=watermark, instance=instance)

    def engine(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.engine(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


Sink = _Sinks


def open_sink(target: str, rank: int = 0) -> Sink:
    return _Sinks([rank_target(t.strip(), rank) for t in target.split(",") if t.strip()])


# ---------------------------------------------------------------- observer


def engine_facts(manager: Any, vllm_config: Any | None) -> dict[str, Any]:
    """The trace config and engine facts from the manager's coordinator (what
    the lookups actually run with) and the ``VllmConfig``."""
    import vllm
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        get_kv_cache_spec_kind,
    )

    from replay.base.spec import GroupKind, GroupSpec, TraceConfig

    # The running release: `replay run` answers as its policy by default.
    version = str(vllm.__version__)
    coordinator = manager.coordinator
    kv_config = manager.kv_cache_config
    groups = []
    unsupported = []
    for gid, group in enumerate(kv_config.kv_cache_groups):
        spec = group.kv_cache_spec
        name = ",".join(group.layer_names[:4]) or None
        common: dict[str, Any] = {
            "block_size": spec.block_size,
            "is_eagle_group": bool(group.is_eagle_group),
            "name": name,
        }
        if isinstance(spec, SlidingWindowSpec):
            groups.append(
                GroupSpec(
                    kind=GroupKind.SLIDING_WINDOW,
                    sliding_window=spec.sliding_window,
                    extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0),
                    **common,
                )
            )
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            groups.append(
                GroupSpec(
                    kind=GroupKind.CHUNKED_LOCAL_ATTENTION,
                    attention_chunk_size=spec.attention_chunk_size,
                    **common,
                )
            )
        elif isinstance(spec, MambaSpec):
            groups.append(GroupSpec(kind=GroupKind.MAMBA, mamba_cache_mode="align", **common))
        else:
            kind = get_kv_cache_spec_kind(spec).value
            if kind not in ("full_attention", "mla_attention", "sink_full_attention"):
                unsupported.append(f"group {gid}: {type(spec).__name__} ({kind})")
            groups.append(GroupSpec(kind=GroupKind.FULL_ATTENTION, **common))
    engine: dict[str, Any] = {
        "pid": os.getpid(),
        "kv_cache_events": bool(manager.enable_kv_cache_events),
        "eagle_group_ids": sorted(coordinator.eagle_group_ids),
        "drop_eagle_group_ids": sorted(coordinator.drop_eagle_group_ids),
        "eagle_drop": bool(manager.use_eagle),
        "prefix_cache_retention_interval": getattr(
            kv_config, "prefix_cache_retention_interval", None
        ),
        "num_blocks": kv_config.num_blocks,
        "unsupported_groups": unsupported,
    }
    if vllm_config is not None:
        spec_config = vllm_config.speculative_config
        engine["speculative_method"] = None if spec_config is None else spec_config.method
        engine["num_speculative_tokens"] = vllm_config.num_speculative_tokens
        engine["num_hash_lookahead_tokens"] = vllm_config.num_hash_lookahead_tokens
        engine["prefix_caching_hash_algo"] = vllm_config.cache_config.prefix_caching_hash_algo
        engine["kv_connector"] = vllm_config.kv_transfer_config is not None
        engine["data_parallel_rank"] = vllm_config.parallel_config.data_parallel_index
    config = TraceConfig(
        groups=tuple(groups),
        hash_block_size=coordinator.block_pool.hash_block_size,
        scheduler_block_size=coordinator.scheduler_block_size,
        # The engine coordinator's use_eagle is the drop flag (the scheduler
        # passes use_eagle_block_drop), which is what the replay's gpu cache
        # takes as use_eagle.
        use_eagle=bool(manager.use_eagle),
        enable_partial_hash_hits=bool(getattr(coordinator, "enable_partial_hash_hits", False)),
        source={"cache": "gpu", "tool": "replay vllm plugin", "vllm_version": version},
    )
    engine["vllm_version"] = version
    return {"config": config.to_json(), "engine": engine}


class LookupObserver:
    """Per ``KVCacheManager``: counts published batches and records lookups."""

    def __init__(self, manager: Any) -> None:
        self.instance = uuid.uuid4().hex[:12]
        self.manager = manager
        # Set when the scheduler that owns the manager is built (it knows
        # the data-parallel rank); a manager without one records nothing.
        self.sink: Sink | None = None
        self.batches = 0
        self.lookups = 0
        self.step = 0
        self.in_step = False
        self.pending: list[dict[str, Any]] = []
        self.engine_sent = False
        self.broken = False

    def send_engine(self, vllm_config: Any | None) -> None:
        if self.engine_sent or self.sink is None:
            return
        self.engine_sent = True
        facts = engine_facts(self.manager, vllm_config)
        self.sink.engine({"type": "engine", "instance": self.instance, "ts": time.time(), **facts})

    def lookup(self, request: Any, max_length: int, position: int, hit: int) -> None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        if self.sink is None:
            return
        self.pending.append(
            {
                "type": "lookup",
                "instance": self.instance,
                "n": self.lookups,
                "ts": time.time(),
                "step": self.step,
                "batch": self.batches,
                "position": position,
                "request_id": str(request.request_id),
                "block_hashes": [
                    _hash_hex(maybe_convert_block_hash(h)) for h in request.block_hashes
                ],
                "num_tokens": int(request.num_tokens),
                "num_prompt_tokens": int(request.num_prompt_tokens),
                "max_length": int(max_length),
                "observed_hit_tokens": int(hit),
                "admitted": None,
            }
        )
        self.lookups += 1
        if not self.in_step:
            self.flush(None)

    def published(self) -> None:
        if self.sink is not None:
            self.sink.send([], watermark=self.batches, instance=self.instance)

    def begin_step(self) -> None:
        self.step += 1
        self.in_step = True

    def flush(self, scheduled: Any | None) -> None:
        self.in_step = False
        if scheduled is not None:
            for rec in self.pending:
                rec["admitted"] = rec["request_id"] in scheduled
        records, self.pending = self.pending, []
        if self.sink is not None:
            self.sink.send(records, watermark=self.batches, instance=self.instance)


# ------------------------------------------------------------ installation

_observers: weakref.WeakKeyDictionary[Any, LookupObserver] = weakref.WeakKeyDictionary()
_saved: list[tuple[Any, str, Any]] = []
#: the open sinks, by data-parallel rank
_sinks: dict[int, Sink] = {}


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, name)
    _saved.append((owner, name, original))
    wrapper = make(original)
    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", name)
    setattr(owner, name, wrapper)


def guarded(obs: LookupObserver, method: Callable[..., None], *args: Any) -> None:
    """Run an observation; if it fails, stop observing this engine (with one
    log line) rather than disturb the scheduler it observes."""
    if obs.broken:
        return
    try:
        method(*args)
    except Exception:
        obs.broken = True
        logging.getLogger(__name__).exception(
            "replay lookup plugin: observation failed; no further lookups are recorded"
        )


def installed() -> bool:
    return bool(_saved)


def install(target: str) -> None:
    """Wrap vLLM's scheduler and KV-cache manager to record lookups to
    ``target`` (a ZMQ endpoint to bind, or a file to append to)."""
    if _saved:
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def sink_for(rank: int) -> Sink:
        if rank not in _sinks:
            _sinks[rank] = open_sink(target, rank)
        return _sinks[rank]

    def manager_init(original: Any) -> Any:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _observers[self] = LookupObserver(self)

        return init

    def get_computed_blocks(original: Any) -> Any:
        def wrapped(self: Any, request: Any, max_cache_hit_length: int | None = None) -> Any:
            obs = _observers.get(self)
            if obs is None or not self.prefix_cache_lookup_enabled(request):
                # No lookup happens (caching off or the request skips reading
                # the cache): nothing to replay.
                return original(self, request, max_cache_hit_length)
            position = len(self.block_pool.kv_event_queue)
            result = original(self, request, max_cache_hit_length)
            max_length = (
                request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
            )
            guarded(obs, obs.lookup, request, max_length, position, int(result[1]))
            return result

        return wrapped

    def scheduler_init(original: Any) -> Any:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            obs = _observers.get(self.kv_cache_manager)
            if obs is None:
                return
            publisher = self.kv_event_publisher
            publish = publisher.publish

            def counted(batch: Any) -> Any:
                # vLLM's publisher numbers batches in publish order from 0.
                obs.batches += 1
                result = publish(batch)
                # Every lookup of this batch was sent before (at the end of
                # its schedule() call): the recorder may write the batch now.
                guarded(obs, obs.published)
                return result

            publisher.publish = counted
            rank = int(self.vllm_config.parallel_config.data_parallel_index or 0)
            obs.sink = sink_for(rank)
            guarded(obs, obs.send_engine, self.vllm_config)

        return init

    def schedule(original: Any) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            obs = _observers.get(self.kv_cache_manager)
            if obs is None:
                return original(self, *args, **kwargs)
            guarded(obs, obs.begin_step)
            try:
                out = original(self, *args, **kwargs)
            except BaseException:
                guarded(obs, obs.flush, None)
                raise
            guarded(obs, obs.flush, out.num_scheduled_tokens)
            return out

        return wrapped

    _patch(KVCacheManager, "__init__", manager_init)
    _patch(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    _patch(Scheduler, "__init__", scheduler_init)
    _patch(Scheduler, "schedule", schedule)


def uninstall() -> None:
    """Undo :func:`install` (tests run vLLM with and without the plugin)."""
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
    while _sinks:
        _sinks.popitem()[1].close()


def register() -> None:
    """vLLM's ``general_plugins`` hook: called in every vLLM process."""
    target = os.environ.get(ENV)
    if target:
        install(target)

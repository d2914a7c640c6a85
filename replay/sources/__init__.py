"""Sources: everything that turns outside data into trace events, one job a module.

Generated and imported workloads: ``archetypes`` (the model configs),
``synth`` (the session generator), ``mooncake_jsonl`` (the Mooncake and
bailian formats), ``prefix_reuse`` (their own reuse ratio), ``mooncake``
(their importer); all write through ``workload`` (requests -> trace rows),
which keeps the Mooncake cache model's dense-key LRU mode
(``replay.rules.mooncake_store``) and hashes with ``hashing``.

vLLM's KV events: ``kv_wire`` (the msgspec Structs and the decoder),
``kv_rows`` (events -> trace rows, copies counted), ``kv_config`` (the
config of a recording), ``stream`` (seq order, gaps, restarts), ``dump``
(the raw dump), ``zmq_client`` (the replay and lookup sockets) and
``record`` (a recording or a dump import, end to end). Lookups:
``lookup_log`` (merged by time) and ``plugin_log`` (the vLLM plugin's,
placed exactly). ``values`` holds what the readers share.
"""

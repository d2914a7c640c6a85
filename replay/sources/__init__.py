"""Sources: everything that turns outside data into trace events.

``kv_events`` decodes vLLM's KV-event batches and folds their copy counts
into trace rows; ``record`` subscribes to a live publisher (and reads the
raw dumps it writes back). Other importers live beside them.
"""

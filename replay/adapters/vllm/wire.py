"""The lookup stream's wire constants, shared by the plugin that publishes
it inside vLLM (``plugin``) and the recorder that subscribes to it
(``replay.sources.zmq_client``). Stdlib only: the plugin loads in every vLLM
process."""

#: the environment variable that turns the plugin on (its targets)
ENV = "REPLAY_LOOKUPS"
#: the ZMQ topic frame of every message
TOPIC = b"replay.lookups"
#: the payload's ``format`` field
FORMAT = "replay.lookups/1"

__all__ = ["ENV", "FORMAT", "TOPIC"]

"""vLLM's own classes the vLLM-marked tests drive, imported on first use (the
module imports without vLLM; the tests that call it are skipped there)."""

from __future__ import annotations

from types import SimpleNamespace


def vllm_modules() -> SimpleNamespace:
    """The KV-cache manager, scheduler, request and spec classes of the vLLM
    in this environment, with the block hasher's seed set as the engine does."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import coordinator
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1 import kv_cache_interface as iface
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    return SimpleNamespace(
        torch=torch,
        iface=iface,
        utils=kv_cache_utils,
        sha256=sha256,
        KVCacheManager=KVCacheManager,
        Scheduler=Scheduler,
        Request=Request,
        SamplingParams=SamplingParams,
        Mooncake=coordinator.MooncakeStoreCoordinator,
    )

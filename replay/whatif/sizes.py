"""Sizes for the what-if: the groups' page sizes (from the trace, ``page_bytes``
or a model's config.json) and the blocks a byte capacity holds. The units
themselves (``64GiB``, ``10k``, ``10%``) are parsed by ``replay.base.units``."""

from __future__ import annotations

import os
from collections.abc import Sequence

from replay.base.errors import ReplayError
from replay.base.spec import TraceConfig
from replay.base.units import model_page_bytes, parse_bytes

#: A model's config.json is a few KB: a larger file is read no further.
_MAX_CONFIG_BYTES = 16 << 20
#: The largest page a group's block may take (1 TiB): a size beyond it is a typo.
MAX_PAGE_BYTES = 1 << 40

__all__ = ["block_bytes", "blocks_for_bytes", "page_sizes", "parse_bytes"]


def page_sizes(
    config: TraceConfig, page_bytes: str | None, model_config: str | None = None
) -> tuple[tuple[int, ...], str] | None:
    """Per group, the bytes of one block (all of its layers), and where they
    came from: ``page_bytes`` (one size for every group, or one per group,
    comma-separated), else ``model_config`` (a Hugging Face config.json),
    else the trace's ``source.page_bytes`` (the vLLM plugin records them);
    None when none says."""
    if page_bytes is not None and model_config is not None:
        raise ReplayError("give at most one of `page_bytes` and `model_config`")
    if page_bytes is not None:
        parts, origin = [p for p in page_bytes.split(",") if p.strip()], "--page-bytes"
    elif model_config is not None:
        import json

        try:
            with open(model_config, "rb") as fh:
                text = fh.read(_MAX_CONFIG_BYTES + 1)
            if len(text) > _MAX_CONFIG_BYTES:
                raise ReplayError(
                    f"`model_config` {model_config}: larger than {_MAX_CONFIG_BYTES:,} bytes, "
                    "not a config.json"
                )
            data = json.loads(text)
        except OSError as exc:
            raise ReplayError(
                f"`model_config` {model_config}: cannot read ({exc.strerror or exc})"
            ) from None
        except (ValueError, RecursionError) as exc:
            raise ReplayError(f"`model_config` {model_config}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ReplayError(f"`model_config` {model_config}: expected a JSON object")
        page = model_page_bytes(data, config.groups[0].block_size, f"`model_config` {model_config}")
        parts, origin = [str(page)], f"--model-config {os.path.basename(model_config)}"
    else:
        given = (config.source or {}).get("page_bytes")
        if given is None:
            return None
        parts = [str(p) for p in given] if isinstance(given, list) else [str(given)]
        origin = "trace"
    option = "`page_bytes`" if origin != "trace" else "source.page_bytes"
    sizes = [parse_bytes(p, option) for p in parts]
    if any(size > MAX_PAGE_BYTES for size in sizes):
        raise ReplayError(f"{option}: a page is at most {MAX_PAGE_BYTES} bytes (1TiB)")
    if len(sizes) == 1:
        sizes *= config.num_groups
    if len(sizes) != config.num_groups:
        raise ReplayError(f"{option}: {len(sizes)} sizes for {config.num_groups} KV-cache groups")
    return tuple(sizes), origin


def blocks_for_bytes(capacity_bytes: int, pages: Sequence[int]) -> int:
    """Blocks of ``capacity_bytes``: the gpu pool gives every group one page
    size, so a block costs the largest page; the mooncake store counts each
    key's own page against the bytes, and this is only its nominal size."""
    blocks = capacity_bytes // max(pages)
    if blocks < 1:
        raise ReplayError(f"{capacity_bytes} bytes hold no block of {max(pages)} bytes")
    return blocks


def block_bytes(pages: Sequence[int]) -> int:
    """What one block of a capacity costs: the largest page (the gpu pool
    gives every group one page size)."""
    return max(pages)

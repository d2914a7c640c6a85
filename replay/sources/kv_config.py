"""The KV-cache config of a recording or an import, from the command line's
``--config FILE`` or ``--block-size N``, and the error of an event that
does not fit it."""

from __future__ import annotations

import os

from replay.base.errors import ConfigError, ReplayError
from replay.base.spec import GroupKind, GroupSpec, TraceConfig
from replay.sources.values import parse_json


class GroupMismatch(ConfigError):
    """An event that does not fit the KV-cache config (a group it does not
    have, or a group of another kind). Fatal: the config is wrong."""


#: A KV-cache config JSON is a few KB: a larger file is read no further.
_MAX_CONFIG_BYTES = 16 << 20


def load_config(path: str | os.PathLike[str] | None, block_size: int | None) -> TraceConfig:
    """The KV-cache config for a recording: a JSON file holding the
    ``replay.trace`` metadata object (or a trace, whose config is taken), or
    one full-attention group of ``block_size`` tokens."""
    if path is not None and block_size is not None:
        raise ConfigError("pass either --config or --block-size, not both")
    if path is not None:
        from replay.format.paths import check_input
        from replay.format.schema import check_config_limits
        from replay.format.trace import TraceReader

        try:
            p = check_input(path, "a KV-cache config JSON")
        except ReplayError as exc:
            raise ConfigError(str(exc)) from None
        try:
            with open(p, "rb") as fh:  # opened once: a trace is read from it as it is
                parquet = fh.read(4) == b"PAR1"
                fh.seek(0)
                data = b"" if parquet else fh.read(_MAX_CONFIG_BYTES + 1)
                config = TraceReader(fh).config if parquet else None
        except OSError as exc:  # a file that is no file (/proc/self/mem) names itself
            raise ConfigError(f"{p}: cannot read ({exc.strerror or exc})") from None
        if len(data) > _MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{p}: larger than {_MAX_CONFIG_BYTES:,} bytes, not a KV-cache config JSON"
            )
        if config is None:
            obj = parse_json(
                data,
                invalid=f"{p}: not valid JSON",
                nested=f"{p}: not a KV-cache config (JSON nested too deeply)",
                error=ConfigError,
            )
            if isinstance(obj, dict):
                # A person writing the config by hand may leave the version out.
                obj = {"version": 1, **obj}
            try:
                config = TraceConfig.from_json(obj)
            except ConfigError as exc:
                raise ConfigError(f"{p}: {exc}") from None
            check_config_limits(config, str(p))
        return TraceConfig.from_json({**config.to_json(), "source": None})
    if block_size is not None:
        return TraceConfig(
            groups=(GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=block_size),),
            hash_block_size=block_size,
            scheduler_block_size=block_size,
        )
    raise ConfigError(
        "no KV-cache config: pass --config kv-config.json (the replay.trace metadata "
        "object) or --block-size N (one full-attention group)"
    )

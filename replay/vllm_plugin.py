"""The name vLLM loads: the `vllm.general_plugins` entry point
`replay.vllm_plugin:register` in a user's deployment. The plugin lives in
replay.adapters.vllm.plugin; this module only keeps the entry point's path."""

from replay.adapters.vllm.plugin import register

__all__ = ["register"]

"""The name vLLM loads: the `vllm.general_plugins` entry point
`replay.vllm_plugin:register` in a user's deployment. The plugin lives in
replay.base.vllm_plugin; this module only keeps the entry point's path."""

from replay.base.vllm_plugin import register

__all__ = ["register"]

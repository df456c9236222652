"""Memory planning from a model's config alone: the model is built on the meta device, so no weights are read."""

from __future__ import annotations

import torch


def meta_model(config):
    """The model's module tree with parameters on the meta device (shapes only; any size builds in seconds)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def no_split_modules(config) -> list[str]:
    """The decoder-layer classes FSDP's transformer auto-wrap policy wraps (empty for many remote-code models)."""
    return list(getattr(meta_model(config), "_no_split_modules", None) or [])

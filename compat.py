"""Every change the recipe makes to a library's internals, each with the version it was written for.

tests/test_compat.py holds a canary for each: it fails when the upstream code a patch relies on changes, so the patch
is looked at again before it silently stops doing what it says.
"""

from __future__ import annotations

import functools

PEFT_VERSION = "0.21"


def peft_keeps_split_experts() -> None:
    """PEFT 0.21 rewrites LoRA configs and adapter state dicts of MoE model types whose layout changed in transformers 5
    (Mixtral, Qwen2/3-MoE, ...): every target named like a transformers 4 expert (`w1`, `gate_proj`, ...) or router
    (`gate`) becomes a fused `target_parameters` entry (peft/utils/transformers_weight_conversion.py, called from
    `BaseTuner.inject_adapter` and `set_peft_model_state_dict`). On a model whose experts moe.split_experts made into
    linear modules those names are real modules, and the rewrite would leave the experts out and adapt the router.
    Skip both rewrites for such models; a stock (fused) model still gets them, which is how an adapter trained here
    loads onto it."""
    from peft.utils import transformers_weight_conversion as conversion

    if getattr(conversion, "_recipe_keeps_split_experts", False):
        return

    def unless_split(rewrite, passthrough):
        @functools.wraps(rewrite)
        def wrapper(*args, **kwargs):
            position = 1 if rewrite.__name__.startswith("convert_peft_config") else 0
            model = kwargs["model"] if "model" in kwargs else args[position]
            if has_split_experts(model):
                return passthrough(*args, **kwargs)
            return rewrite(*args, **kwargs)
        return wrapper

    conversion.convert_peft_config_for_transformers = unless_split(
        conversion.convert_peft_config_for_transformers, lambda *args, **kwargs: None)
    conversion.convert_peft_adapter_state_dict_for_transformers = unless_split(
        conversion.convert_peft_adapter_state_dict_for_transformers,
        lambda *args, **kwargs: kwargs["adapter_state_dict"] if "adapter_state_dict" in kwargs else args[2])
    conversion._recipe_keeps_split_experts = True


def has_split_experts(model) -> bool:
    from moe import ExpertLinears

    return any(isinstance(module, ExpertLinears) for module in model.modules())

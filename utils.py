"""Builders: the base model as settled (LoRA / QLoRA, experts split, weights from rank 0 where sharded) and the LoRA
config. The tokenizer and its chat template are in recipe/model/tokenizer.py, the data in recipe/data/, where weights
come from in recipe/model/model_files.py, what the machine can do in recipe/platform/hardware.py.

Every function here takes what it needs as arguments: no printing, no argument parsing, no reading of the launch
environment; `configuration.settle` decides what they are given.
"""

from __future__ import annotations

import torch

from recipe.model.fast_paths import PACKED_ATTENTIONS, register_attention
from recipe.model.model_files import load_causal_lm

# ----------------------------------------------------------------------------------------------------------------
# Model


def build_quantization_config(model_args):
    from transformers import BitsAndBytesConfig

    if model_args.use_4bit_quantization:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=getattr(torch, model_args.bnb_4bit_compute_dtype),
            bnb_4bit_use_double_quant=model_args.use_nested_quant,
            bnb_4bit_quant_storage=getattr(torch, model_args.bnb_4bit_quant_storage_dtype),
        )
    if model_args.use_8bit_quantization:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def build_model(model_args, tokenizer, added_token_ids: list[int], *, dtype: torch.dtype, attention: str,
                device_map: dict | None = None, weights_from_rank0: bool = False, rank0: bool = True,
                device: torch.device | None = None, trust_remote_code: bool = False, token: str | None = None,
                place_on: str | None = None):
    """The base model as the configuration says (configuration.settle decides dtype, attention and placement).

    `weights_from_rank0`: a sharded run in which rank 0 (`rank0`: this process) alone reads the checkpoint (device_map
    cpu) and the other ranks build on the meta device (device_map meta); sharding.receive_from_rank0 then sends what
    no engine carries, with the quantization state placed on `device`, the training device. `place_on`: where the
    model moves once loaded and its experts split on the host (a 4-bit mixture of experts on one GPU)."""
    if attention in PACKED_ATTENTIONS:
        register_attention(attention)
    quantization_config = build_quantization_config(model_args)
    from recipe.compat import keep_4bit_layers_trainable, splitting_experts_as_loaded, transformers_zero3_hidden
    from recipe.model import moe

    with transformers_zero3_hidden(weights_from_rank0), splitting_experts_as_loaded(moe.split_as_loaded):
        model = load_causal_lm(
            model_args.model_name_or_path,
            dtype=dtype,
            quantization_config=quantization_config,
            attn_implementation=attention,
            trust_remote_code=trust_remote_code,  # off unless asked: it runs the Hub repo's code
            device_map=device_map,
            token=token,
        )
    if added_token_ids:
        # Mean-resizing reads the existing rows: not on the meta device (rank 0's rows are broadcast over them anyway)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=device_map != {"": "meta"})
    if moe.fused_experts(model):  # left fused by the load (a meta-device model); before the 4-bit state is sent
        moe.split_experts(model, quantization_config)
    if place_on is not None:  # loaded (and quantized) on the host first
        model.to(place_on)
    if weights_from_rank0:
        from recipe.engines.sharding import receive_from_rank0

        receive_from_rank0(model, device or torch.device("cpu"), rank0)
    keep_4bit_layers_trainable(model)  # else an evaluation on an AVX512-BF16 CPU repacks them for inference only
    model.config.use_cache = False  # the cache is useless in training and warns under checkpointing
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_peft_config(model_args, added_token_ids: list[int], model=None):
    """LoRA as the arguments say; with --lora_router, each MoE router's weight of `model` too (a parameter, not a
    linear module: PEFT's target_parameters)."""
    from peft import LoraConfig

    from recipe.model import moe

    if not model_args.use_peft_lora:
        return None
    routers = moe.router_weights(model) if model is not None and model_args.lora_router else []
    return LoraConfig(
        target_parameters=routers or None,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_targets,
        bias="none",
        task_type="CAUSAL_LM",
        # Rows of tokens the template added are trained and saved with the adapter (a few KB, not the whole matrix).
        trainable_token_indices=list(added_token_ids) or None,
    )

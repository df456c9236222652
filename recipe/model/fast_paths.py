"""Waste the recipe removes from each training step, each kept because bench/benchmark.py measured it.

- Attention within each packed example. Padding-free batches (the recipe's default, and bfd packing) flatten a batch
  into one row and mark where each example starts with `cu_seq_lens_q`. Plain sdpa then builds a block-diagonal mask
  over the whole row and computes every score of it: a 1024-token row of 60-token examples costs 1024 x 1024 scores
  for 16 x 60 x 60 useful ones. Four ways skip them, each registered as an attention implementation:
  - `sdpa_varlen`: causal sdpa once per example (CPU, where bench/benchmark.py measured it fastest; the CUDA default
    until the GPU check has shown the kernel equal to it there);
  - `eager_varlen`: the same loop through the family's own eager attention (Gemma-2's softcapping, gpt-oss's sinks);
  - `kernel_varlen`: one FlashAttention-2 varlen kernel for the whole row (CUDA): flash-attn's where that package is
    installed, else the one torch ships (`torch.nn.attention.varlen.varlen_attn`);
  - `flex_varlen`: one FlexAttention call with a per-example block mask, for what the kernel cannot compute
    (softcapping, sinks).
  Batches without `cu_seq_lens_q` (padded eval batches, generation) go to plain sdpa, with sdpa's own mask.
- Fused layers (`--use_liger_kernels`, CUDA): Liger Kernel's RMSNorm, SwiGLU and RoPE through its own function for the
  model's family.
- No host read of the boundaries in a step. The collator knows each example's length on the host; the recipe's
  trainer keeps them beside the batch (`WithExampleLengths`, `packed_rows`) so neither the attention in every layer
  nor transformers' mask preparation reads them back from the GPU (each read waits for the GPU to catch up).
- LM head only where the loss is. TRL's fused LM head projects just the positions that have a label on Triton
  devices, and every position elsewhere (fixed shapes for graph compilers); in eager mode on CPU the fixed shape
  buys nothing, and a chat example supervises only its answers.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

ATTENTION = "sdpa_varlen"
# The same function under a name without "sdpa" in it: transformers refuses any "*sdpa*" implementation for the
# families that declare `_supports_sdpa = False` (Gemma-2: softcapping; gpt-oss: sinks), which this one computes
EAGER_ATTENTION = "eager_varlen"
KERNEL_ATTENTION = "kernel_varlen"  # one FlashAttention-2 varlen kernel per packed row (CUDA)
FLEX_ATTENTION = "flex_varlen"  # one FlexAttention call per packed row: softcapping and sinks too
# Names without "sdpa", "flash" or "flex_attention" in them: transformers runs its own dispatch checks and mask
# shortcuts for any implementation whose name holds one of those
PACKED_ATTENTIONS = (ATTENTION, EAGER_ATTENTION, KERNEL_ATTENTION, FLEX_ATTENTION)
EXAMPLE_LENGTHS = "example_lengths"  # the batch key WithExampleLengths adds: each example's length, on the host
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
    if not is_packed_row(query, key, cu_seq_lens_q, module):
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
    lengths = example_lengths(query.shape[2], cu_seq_lens_q)
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


@dataclass
class PackedRows:
    """The packed row in flight: each example's length, read on the host when the batch was collated."""

    lengths: tuple[int, ...]
    block_masks: dict = field(default_factory=dict)  # flex_varlen's, built once per row and window for every layer

    @property
    def total(self) -> int:
        return sum(self.lengths)


# Process-wide, not a ContextVar: on CUDA the backward (and the recomputation of checkpointed layers in it) runs in
# autograd's device thread, which sees no context variable of the thread that started it
_in_flight: list[PackedRows | None] = [None]


class WithExampleLengths:
    """TRL's padding-free collator, adding each example's length as a tuple of ints (`EXAMPLE_LENGTHS`): the
    boundaries are on the host here, and stay there when the batch moves to the GPU."""

    def __init__(self, collator):
        self.collator = collator

    def __getattr__(self, name):  # TRL and the Trainer read the collator's settings (padding_free, ...)
        if name == "collator":  # unpickling (dataloader workers): not set yet
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples):
        batch = self.collator(examples)
        bounds = batch.get("cu_seq_lens_q")
        if bounds is not None and bounds.device.type == "cpu":
            batch[EXAMPLE_LENGTHS] = tuple(bounds.diff().tolist())
        return batch


@contextmanager
def packed_rows(batch: Mapping):
    """While a step runs on `batch` (forward, and the backward's recomputation under activation checkpointing): its
    example lengths, taken out of the batch so the model never sees them."""
    lengths = batch.pop(EXAMPLE_LENGTHS, None) if isinstance(batch, dict) else None
    outer, _in_flight[0] = _in_flight[0], PackedRows(tuple(lengths)) if lengths else None
    try:
        yield
    finally:
        _in_flight[0] = outer


def rows_in_flight(tokens: int) -> PackedRows | None:
    """The packed row in flight, if its examples cover `tokens` (else the call is not for that row)."""
    rows = _in_flight[0]
    return rows if rows is not None and rows.total == tokens else None


def example_lengths(tokens: int, cu_seq_lens: torch.Tensor) -> list[int]:
    """Each example's length in a packed row of `tokens`: from the host when the trainer passed them, else read
    from `cu_seq_lens` (a wait for the GPU when it is there)."""
    rows = rows_in_flight(tokens)
    if rows is not None and len(rows.lengths) + 1 == cu_seq_lens.shape[0]:
        return list(rows.lengths)
    return cu_seq_lens.diff().tolist()


def is_packed_row(query: torch.Tensor, key: torch.Tensor, cu_seq_lens_q, module) -> bool:
    """One flattened row of causal self-attention with its boundaries (TRL gives keys the same ones)."""
    return (cu_seq_lens_q is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
            and getattr(module, "is_causal", True))


def _varlen_parameters() -> set[str] | None:
    """The parameters of the running torch's `varlen_attn`, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return set(inspect.signature(varlen_attn).parameters)


def torch_varlen_windows() -> bool:
    """torch's varlen_attn takes causal windows and grouped heads (torch 2.13's does): torch_varlen_attn calls it
    with both; an older one is called with is_causal only."""
    parameters = _varlen_parameters()
    return parameters is not None and {"window_size", "enable_gqa"} <= parameters


def torch_varlen_attn():
    """torch's FlashAttention-2 varlen kernel as `(kernel, None)`, or `(None, why not)`; `kernel(q, k, v, bounds,
    longest, scale, window)` takes (tokens, heads, dim) tensors. torch 2.13's `varlen_attn` takes causal windows and
    grouped heads; an older torch's (a GPU machine's may be older than the pin) takes `is_causal` only: there the
    key/value heads are repeated for grouped heads, and a sliding window is refused (torch_varlen_windows)."""
    parameters = _varlen_parameters()
    if parameters is None:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    from torch.nn.attention.varlen import varlen_attn

    if torch_varlen_windows():
        def kernel(q, k, v, bounds, longest, scale, window):
            return varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=scale, window_size=window,
                               enable_gqa=q.shape[1] != k.shape[1])
        return kernel, None
    if "is_causal" not in parameters:
        return None, f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal"

    def causal_kernel(q, k, v, bounds, longest, scale, window):
        if window != (-1, 0):
            raise ValueError(f"torch {torch.__version__}'s varlen_attn has no sliding window")
        if k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        if "scale" in parameters:
            return varlen_attn(q, k, v, bounds, bounds, longest, longest, is_causal=True, scale=scale)
        if scale is not None:  # the kernel scales by dim^-0.5
            q = q * (scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, bounds, bounds, longest, longest, is_causal=True)
    return causal_kernel, None


@functools.cache
def varlen_kernel():
    """The varlen kernel kernel_varlen runs, as `(function, source)`: flash-attn's where it is installed, else torch's.
    Both run on CUDA only."""
    from recipe.platform.hardware import is_flash_attn_installed

    if is_flash_attn_installed():
        from flash_attn import flash_attn_varlen_func

        def flash_attn_kernel(q, k, v, bounds, longest, scale, window):
            return flash_attn_varlen_func(q, k, v, bounds, bounds, longest, longest, softmax_scale=scale, causal=True,
                                          window_size=window)
        return flash_attn_kernel, "flash-attn's flash_attn_varlen_func"
    kernel, why_not = torch_varlen_attn()
    if kernel is None:
        return None, why_not + " and flash-attn is not installed"
    return kernel, f"torch {torch.__version__}'s varlen_attn"


def kernel_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                          sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """One varlen kernel for a packed row: query (1, heads, tokens, dim) -> (1, tokens, heads, dim). The longest
    example comes from the collator (`max_length_q`, an int on the host): nothing is read back from the GPU."""
    if not is_packed_row(query, key, cu_seq_lens_q, module):
        return sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   cu_seq_lens_q=cu_seq_lens_q, sliding_window=sliding_window, **kwargs)
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{KERNEL_ATTENTION} computes no attention dropout, softcapping or sinks; "
                         f"configuration.attention picks {FLEX_ATTENTION} or the per-example loop for them")
    kernel, why = varlen_kernel() if query.is_cuda else (None, "the FlashAttention kernels run on CUDA only")
    if kernel is None:
        raise RuntimeError(f"{KERNEL_ATTENTION}: {why}")
    if max_length_q is None:
        max_length_q = max(example_lengths(query.shape[2], cu_seq_lens_q))
    # transformers' window admits keys with q - k < window: (window - 1) to the left, none to the right
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (tokens, heads, dim)
    out = kernel(q, k, v, cu_seq_lens_q.to(torch.int32), max_length_q, scaling, window)
    return out[None], None


def document_ids(bounds: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each token's example index in a packed row, on the boundaries' device (no host read)."""
    return torch.searchsorted(bounds[1:].contiguous(), torch.arange(tokens, dtype=bounds.dtype, device=bounds.device),
                              right=True)


def packed_block_mask(bounds: torch.Tensor, tokens: int, sliding_window: int | None):
    """FlexAttention's block mask of a packed row: causal within each example, inside the sliding window."""
    from torch.nn.attention.flex_attention import create_block_mask

    documents = document_ids(bounds, tokens)

    def within_example(batch, head, q, k):
        allowed = (documents[q] == documents[k]) & (k <= q)
        return allowed if sliding_window is None else allowed & (q - k < sliding_window)

    return create_block_mask(within_example, None, None, tokens, tokens, device=bounds.device)


@functools.cache
def flex_attention_function(device_type: str):
    """torch's flex_attention: compiled on CUDA (eager, it materializes every score), for any length (a packed row's
    changes every step); eager elsewhere (the CPU tests' forward)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def flex_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        cu_seq_lens_q: torch.Tensor | None = None, sliding_window: int | None = None,
                        softcap: float | None = None, s_aux: torch.Tensor | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """One FlexAttention call for a packed row, with the family's softcapping (Gemma-2) and sinks (gpt-oss): a sink
    adds exp(sink) to each row's softmax denominator, so the output scales by sigmoid(lse - sink)."""
    if not is_packed_row(query, key, cu_seq_lens_q, module):
        return sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   cu_seq_lens_q=cu_seq_lens_q, sliding_window=sliding_window, softcap=softcap,
                                   s_aux=s_aux, **kwargs)
    if dropout:
        raise ValueError(f"{FLEX_ATTENTION} computes no attention dropout; configuration.attention keeps the "
                         "per-example loop for it")
    from torch.nn.attention.flex_attention import AuxRequest

    tokens = query.shape[2]
    rows = rows_in_flight(tokens)
    masks = rows.block_masks if rows is not None else {}
    if (sliding_window, query.device) not in masks:
        masks[sliding_window, query.device] = packed_block_mask(cu_seq_lens_q.to(torch.int32), tokens, sliding_window)

    def capped(score, batch, head, q, k):
        return softcap * torch.tanh(score / softcap)

    out, aux = flex_attention_function(query.device.type)(
        query, key, value, score_mod=capped if softcap is not None else None,
        block_mask=masks[sliding_window, query.device], scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
        return_aux=AuxRequest(lse=True))
    if s_aux is not None:
        out = out * torch.sigmoid(aux.lse - s_aux.float()[None, :, None]).to(out.dtype)[..., None]
    return out.transpose(1, 2).contiguous(), None


# Liger Kernel's fused layers: the norm, the gated MLP's activation and the rotary embedding. Not its losses: TRL 1.16
# refuses its fused linear cross-entropy, whose work TRL's chunked loss and the labelled-positions head already do.
LIGER_LAYERS = dict(rms_norm=True, swiglu=True, geglu=True, rope=True, cross_entropy=False,
                    fused_linear_cross_entropy=False)


def liger_families() -> dict:
    """model_type -> Liger's own function that patches a model of that family (liger-kernel installed)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def apply_liger_kernels(model) -> list[str]:
    """Liger's per-family function on the loaded base model (before LoRA wraps its projections: the fused MLP calls
    them as modules, so their adapters run); returns the layers it replaced."""
    apply = liger_families()[model.config.model_type]
    accepted = inspect.signature(apply).parameters
    layers = {name: on for name, on in LIGER_LAYERS.items() if name in accepted}
    apply(model=model, **layers)
    return [name for name, on in layers.items() if on]


FORWARDS = {ATTENTION: sdpa_varlen_forward, EAGER_ATTENTION: sdpa_varlen_forward,
            KERNEL_ATTENTION: kernel_varlen_forward, FLEX_ATTENTION: flex_varlen_forward}


def register_attention(name: str = ATTENTION) -> str:
    """Make `attn_implementation=name` (one of PACKED_ATTENTIONS) loadable (idempotent); padded batches keep the mask
    transformers builds for sdpa, packed rows skip it (compat.TRANSFORMERS_SKIPS_PACKED_ROW_MASKS)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from recipe.compat import skip_masks_where

    AttentionInterface.register(name, FORWARDS[name])
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    skip_masks_where(packed_row_in_flight)
    return name


def packed_row_in_flight(config, inputs_embeds) -> bool:
    """The forward is of the packed row in flight (packed_rows) under one of PACKED_ATTENTIONS, which reads no mask."""
    return (config._attn_implementation in PACKED_ATTENTIONS and inputs_embeds.shape[0] == 1
            and rows_in_flight(inputs_embeds.shape[1]) is not None)


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


# --torch_compile left unset on one CPU process: each decoder layer is compiled once the first eager steps show that
# the steps left repay it. bench/compile_payback.py on a 2-core AMX Xeon (SmolLM2-135M, the demo's batches, inductor;
# bench/compile_payback.json): a compiled step took 0.76 and 0.88 of an eager one, compiling 36.5 and 29.7 s; the
# medians below. The cost is counted twice (REPAY_MARGIN): a slower CPU compiles slower too. No GPU figure yet.
COMPILED_STEP_RATIO = {"cpu": 0.82}
COMPILE_SECONDS = {"cpu": 33.0}
REPAY_MARGIN = 2.0
EAGER_STEPS_MEASURED = 3  # after the first, which carries the warm-up


def compile_repays(eager_step_seconds: float, steps_left: int, device: str) -> tuple[bool, float, float]:
    """Whether compiling now repays itself over `steps_left` steps, with the seconds it would save and cost (the
    cost with its margin)."""
    saved = steps_left * eager_step_seconds * (1 - COMPILED_STEP_RATIO[device])
    cost = COMPILE_SECONDS[device] * REPAY_MARGIN
    return saved > cost, saved, cost


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: its modules of the classes it names as never to be split (_no_split_modules)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [module for module in base.modules() if type(module).__name__ in names]


def compile_each_layer(model, backend: str = "inductor") -> int:
    """Compile each decoder layer in place for any length, as --torch_compile's regional compilation does; the
    embedding's output then needs grad, so the first layer shares the others' graph. Returns the layers compiled."""
    model.enable_input_require_grads()
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


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

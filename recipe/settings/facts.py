"""The facts of a run: what is true before anything is decided, read once from the launch, the machine and the model
(its config.json and tokenizer), never chosen. `gather` reads them; configuration.settle decides from them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import psutil
import torch

from recipe.settings.arguments import ConfigError, Request
from recipe.model.fast_paths import torch_varlen_attn, torch_varlen_windows
from recipe.platform.hardware import (is_flash_attn_installed, is_liger_kernel_installed, native_bf16_supported,
                                      usable_cores)
from recipe.platform.launch import Launch, launch_environment
from recipe.planning.memory import ASSUMED_LOAD_RATES, GIB, LoadRates
from recipe.model.model_files import DEFAULT_MODEL_DIR, convert_default_model, gguf_source
from recipe.model.tokenizer import build_tokenizer


# Any of these in a model folder is a tokenizer to load (fast, sentencepiece, BPE vocabularies)
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass
class Facts:
    """What is true of a run before anything is decided: read from the machine, the launch and the model, not chosen."""

    launch: Launch = field(default_factory=Launch)
    # False when checking a launch meant for other machines (--check --accelerate_config on a laptop): the rules about
    # this machine's hardware are skipped, and the launch's GPUs are assumed to have CUDA and native bf16.
    here: bool = True
    cuda: bool = False  # the run's GPUs have CUDA
    native_bf16: bool = False  # bf16 matmuls run natively (hardware.native_bf16_supported)
    flash_attn: bool = False  # the flash-attn package is installed
    torch_varlen: bool = False  # torch ships FlashAttention-2's varlen kernel (fast_paths.torch_varlen_attn)
    torch_varlen_windows: bool = False  # ... with sliding windows (torch 2.13's does)
    liger: bool = False  # the liger-kernel package is installed
    gpu_gib: float | None = None  # memory of each GPU: this machine's, or --gpu_gib
    host_gib: float | None = None  # host RAM available when the run starts
    threads: int = 1  # torch's intra-op threads
    cores: int = 1  # the CPU cores this process may use (hardware.usable_cores)
    hub_offline: bool = False  # HF_HUB_OFFLINE in this process: Hub ids must be in the local cache
    model_config: Any = None  # the model's transformers config, when it could be read without weights
    tokenizer: Any = None  # the tokenizer with the chosen chat template, when it could be loaded
    added_token_ids: list[int] = field(default_factory=list)  # tokens that template added to the vocabulary
    tokenizer_problem: str | None = None  # why the tokenizer could not be built
    tokenizer_absent: bool = False  # --check of a model folder without tokenizer files (a config.json alone)
    load_rates: LoadRates | None = None  # how fast rank 0 reads and quantizes here (multi-process runs: load_rates)

    @cached_property
    def meta_model(self):
        """The model's module tree on the meta device (memory.meta_model), built once for every rule that reads it."""
        from recipe.planning.memory import meta_model

        return meta_model(self.model_config)

    @cached_property
    def shapes(self):
        """The model's parameter counts from its meta-device module tree (memory.Shapes), built once."""
        from recipe.planning.memory import Shapes

        return Shapes.of(self.model_config, self.meta_model)

    @property
    def gpu_here(self) -> bool:
        return self.cuda and self.here


def read_model_config(name_or_path: str, trust_remote_code: bool = False, token: str | None = None,
                      offline: bool = False):
    """The model's config.json (no weights), or None when it cannot be read here."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, token=token,
                                          local_files_only=offline)
    except Exception:
        return None


def launch_of(accelerate_config: str) -> tuple[Launch, bool]:
    """The settings `accelerate launch --config_file FILE` would give a process, and whether they are for this
    machine (a CPU config) rather than GPU machines elsewhere."""
    import yaml

    if not os.path.isfile(accelerate_config):
        raise ConfigError(f"--accelerate_config {accelerate_config}: no such file; pass one of configs/*.yaml")
    settings = yaml.safe_load(Path(accelerate_config).read_text())
    env = launch_environment(["--config_file", accelerate_config, "train.py"])
    return Launch(env, settings.get("num_processes", 1)), bool(settings.get("use_cpu", False))


def gather(request: Request, this_process: Launch | None = None) -> Facts:
    """Read everything the configuration depends on. `this_process`: the environment this process was started with
    (read here where not given): the launch itself, unless --accelerate_config names one to check, and the Hub's
    settings. The offline default model is converted here once (about 20 s), so its config and tokenizer are facts
    like any other model's."""
    this_process = this_process or Launch.current()
    launch, here = launch_of(request.accelerate_config) if request.accelerate_config else (this_process, True)
    model, trust = request.model, bool(request.training.get("trust_remote_code", False))
    token = request.training.get("hub_token")
    if here and model.model_name_or_path == DEFAULT_MODEL_DIR and gguf_source() is not None:
        convert_default_model()
    cuda = torch.cuda.is_available() or not here
    gpu_gib = request.gpu_gib
    if gpu_gib is None and here and cuda:
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    try:
        native_bf16 = native_bf16_supported() if here else True
    except ValueError as err:  # a RECIPE_NATIVE_BF16 value it does not know
        raise ConfigError(str(err)) from None
    facts = Facts(launch=launch, here=here, cuda=cuda, native_bf16=native_bf16, flash_attn=is_flash_attn_installed(),
                  torch_varlen=torch_varlen_attn()[0] is not None, torch_varlen_windows=torch_varlen_windows(),
                  liger=is_liger_kernel_installed(),
                  gpu_gib=gpu_gib, host_gib=psutil.virtual_memory().available / GIB, threads=torch.get_num_threads(),
                  cores=usable_cores(),
                  hub_offline=this_process.hub_offline,
                  model_config=read_model_config(model.model_name_or_path, trust, token, this_process.hub_offline))
    if launch.num_processes > 1 and facts.model_config is not None:
        facts.load_rates = load_rates(launch, model, here)
    folder = Path(model.model_name_or_path)
    if request.check and folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_SOURCES):
        facts.tokenizer_absent = True  # a config.json alone: everything but the tokenizer can still be checked
    elif facts.model_config is not None:
        try:
            facts.tokenizer, facts.added_token_ids = build_tokenizer(model, trust, token)
        except Exception as err:  # a template the tokenizer cannot take, or tokenizer files that do not load
            facts.tokenizer_problem = str(err)
    return facts


def load_rates(launch: Launch, model, here: bool) -> LoadRates:
    """Rank 0's read and quantization rates, measured by rank 0 on its machine and sent to every rank through the
    launch's rendezvous store before the process group starts (hardware.py's probes: a quarter GiB read cold, a 16 MiB
    matrix quantized); the assumed rates for a launch checked elsewhere."""
    if not here:
        return ASSUMED_LOAD_RATES
    store = launch.store() if launch.store_address else None
    key = f"recipe/load-rates/{launch.restart}"
    if launch.rank != 0 and store is not None:
        return LoadRates(**json.loads(store.get(key)))
    from recipe.platform.hardware import cold_read_gib_per_s, quantize_gib_per_s

    folder = Path(model.model_name_or_path)
    read = cold_read_gib_per_s(list(folder.glob("*.safetensors"))) if folder.is_dir() else None
    quantize = quantize_gib_per_s() if model.use_4bit_quantization else ASSUMED_LOAD_RATES.quantize
    rates = LoadRates(read=read or ASSUMED_LOAD_RATES.read, quantize=quantize,
                      source="measured on rank 0's machine" if read else "the read rate assumed (the checkpoint is "
                      "not a local folder), quantization measured on rank 0's machine")
    if store is not None:
        store.set(key, json.dumps(asdict(rates)))
    return rates

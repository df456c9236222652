"""Every change the recipe makes to a library's internals, and every private name it relies on, in one place.

Each patch is a `Patch`: applied once per process (idempotent), undoable, usable as a context manager, and written for
the pinned version it names. tests/test_compat.py holds a canary for each, and for the private names listed in
PRIVATE_NAMES: it fails when the upstream code a patch relies on changes, so the patch is looked at again before it
silently stops doing what it says.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

PEFT_VERSION = "0.21"
TRL_VERSION = "1.16"
TORCH_VERSION = "2.13"
DEEPSPEED_VERSION = "0.19"
TRANSFORMERS_VERSION = "5.23"
BITSANDBYTES_VERSION = "0.50"
ACCELERATE_VERSION = "1.15"
GGUF_VERSION = "0.19"


@dataclass
class Patch:
    """`owner.name` (an attribute, or a key when `item` is set) replaced by `make(original)` while applied."""

    owner: str  # the module that holds it, imported when the patch is applied
    name: str
    make: Callable[[Any], Any]
    why: str
    written_for: str  # package and version
    item: bool = False  # `owner.<mapping>[name]`: the owner path ends with the mapping's attribute
    _original: Any = field(default=None, init=False, repr=False)
    _applied: bool = field(default=False, init=False, repr=False)

    def _target(self):
        module, _, attribute = self.owner.rpartition(".") if self.item else (self.owner, "", "")
        holder = importlib.import_module(module if self.item else self.owner)
        return getattr(holder, attribute) if self.item else holder

    def apply(self) -> None:
        if self._applied:
            return
        target = self._target()
        get = target.get if self.item else functools.partial(getattr, target)
        self._original = get(self.name)
        self._set(target, self.make(self._original))
        self._applied = True

    def undo(self) -> None:
        if not self._applied:
            return
        self._set(self._target(), self._original)
        self._applied = False

    def _set(self, target, value) -> None:
        if not self.item:
            setattr(target, self.name, value)
        elif value is None:  # an item that was absent (an unset environment variable) is absent again
            target.pop(self.name, None)
        else:
            target[self.name] = value

    def __enter__(self):
        self.apply()
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _labelled_only(use_triton):
    def decide(device) -> bool:
        return device.type == "cpu" or use_triton(device)
    return decide


# TRL's fused LM head projects only the labelled positions where `_use_triton(device)` says its Triton kernels run; on
# CPU it would project every position. `trl.trainer.utils` calls that name for this choice alone (the kernels module
# keeps its own for the kernel itself), so answering yes for CPU there sends CPU runs down the compact path too.
TRL_SCORES_LABELLED_POSITIONS_ON_CPU = Patch(
    "trl.trainer.utils", "_use_triton", _labelled_only,
    "TRL's fused LM head scores the labelled positions only on Triton devices; CPU runs do the same",
    f"trl {TRL_VERSION}")


_MASKLESS_ROWS: list = []  # (config, inputs_embeds) -> bool: the rows whose mask nothing reads (skip_masks_where)


def _packed_rows_unmasked(preprocess):
    @functools.wraps(preprocess)
    def preprocess_unless_packed(config, inputs_embeds, attention_mask, past_key_values, position_ids, *args,
                                 **kwargs):
        if (attention_mask is None and past_key_values is None and position_ids is not None
                and any(maskless(config, inputs_embeds) for maskless in _MASKLESS_ROWS)):
            return True, None, None, None, None, None, None  # early exit: no mask
        return preprocess(config, inputs_embeds, attention_mask, past_key_values, position_ids, *args, **kwargs)
    return preprocess_unless_packed


# transformers 5.23 builds a (tokens x tokens) block-diagonal mask for every packed row, after finding the row's
# examples from position_ids with a host read (`(packed_sequence_mask[:, -1] == 0).all()`, a wait for the GPU each
# forward). The recipe's packed attentions never read that mask: each computes its examples from the boundaries. While
# the trainer has a packed row in flight (fast_paths.packed_rows), mask preparation for it stops early, as it does for
# an implementation with no mask function.
TRANSFORMERS_SKIPS_PACKED_ROW_MASKS = Patch(
    "transformers.masking_utils", "_preprocess_mask_arguments", _packed_rows_unmasked,
    "no block-diagonal mask (and no host read) for packed rows the recipe's attention splits itself",
    f"transformers {TRANSFORMERS_VERSION}")


def skip_masks_where(maskless) -> None:
    """TRANSFORMERS_SKIPS_PACKED_ROW_MASKS applied, for the rows `maskless(config, inputs_embeds)` picks (handed in by
    fast_paths: a packed row in flight under one of its attentions; this module imports nothing of the recipe)."""
    if maskless not in _MASKLESS_ROWS:
        _MASKLESS_ROWS.append(maskless)
    TRANSFORMERS_SKIPS_PACKED_ROW_MASKS.apply()

# torch refuses FSDP1's sync_module_states for CPU tensors (NCCL cannot send host memory); gloo can, and the recipe's
# CPU engine (trainers.cpu_fsdp_plugin) broadcasts rank 0's weights with it.
TORCH_FSDP1_SYNCS_CPU_TENSORS = Patch(
    "torch.distributed.fsdp._init_utils", "_check_module_states_for_sync_module_states", lambda _: lambda states: None,
    "FSDP1's 'CPU tensors need a GPU' guard lifted for gloo", f"torch {TORCH_VERSION}")

# DeepSpeed builds its shared-memory all-reduce (CPU inference) on the first collective of a CPU run: minutes of
# compiling for nothing the recipe uses.
DEEPSPEED_SKIPS_SHM_COMM = Patch(
    "deepspeed.ops.__compatible_ops__", "deepspeed_shm_comm", lambda _: False,
    "DeepSpeed's shared-memory all-reduce is not built on CPU hosts", f"deepspeed {DEEPSPEED_VERSION}", item=True)


def _once_imported(is_deepspeed_available):
    def available() -> bool:
        return "deepspeed" in sys.modules and is_deepspeed_available()
    return available


# accelerate's extract_model_from_parallel, which the Trainer calls around every save and evaluation, imports deepspeed
# whenever it is installed, only to ask whether the model is a DeepSpeedEngine: 0.8 s of every FSDP or one-process
# run's start on a 2 GHz CPU (measured). No model is a DeepSpeedEngine before deepspeed has been imported.
ACCELERATE_ASKS_DEEPSPEED_ONLY_ONCE_IMPORTED = Patch(
    "accelerate.utils.other", "is_deepspeed_available", _once_imported,
    "accelerate's unwrapping imports deepspeed only where a run has imported it", f"accelerate {ACCELERATE_VERSION}")


_AFTER_EACH_LOADED_PARAMETER: list = []  # (model, module name, quantization config) -> None, while the patch is applied


def _splitting_experts_as_loaded(set_param_for_module):
    @functools.wraps(set_param_for_module)
    def set_and_split(model, target_name, param_value, loading_info, hf_quantizer):
        set_param_for_module(model, target_name, param_value, loading_info, hf_quantizer)
        config = hf_quantizer.quantization_config if hf_quantizer is not None else None
        for hook in _AFTER_EACH_LOADED_PARAMETER:
            hook(model, target_name.rpartition(".")[0], config)
    return set_and_split


# transformers 5.23 loads a mixture of experts' checkpoint one target parameter at a time
# (core_model_loading.convert_and_load_state_dict_in_model, each through set_param_for_module): per-expert tensors of
# a transformers 4 checkpoint are stacked into one layer's fused 16-bit parameter first (MergeModulelist), a fused
# checkpoint's are read as they are. Left there, every layer's experts sit in 16 bits until the load ends (Mixtral-8x7B:
# 87 GiB). As soon as a layer's fused experts are all set, moe.split_as_loaded makes them one Linear4bit (QLoRA) or
# nn.Linear (LoRA) per expert and the 16-bit tensors go: a load holds one layer's experts in 16 bits at a time.
TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED = Patch(
    "transformers.core_model_loading", "set_param_for_module", _splitting_experts_as_loaded,
    "each layer's fused experts split (and quantized) as soon as they are loaded",
    f"transformers {TRANSFORMERS_VERSION}")


@contextlib.contextmanager
def splitting_experts_as_loaded(split):
    """TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED applied for the duration, calling `split` (moe.split_as_loaded) after each
    parameter is set (handed in: this module imports nothing of the recipe)."""
    _AFTER_EACH_LOADED_PARAMETER.append(split)
    try:
        with TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED:
            yield
    finally:
        _AFTER_EACH_LOADED_PARAMETER.remove(split)


class _ReleasedAsRead(dict):
    """A state dict that lets go of each tensor as it is read: accelerate reads each exactly once."""

    def __getitem__(self, key):
        return self.pop(key)


def _releasing_each_tensor_once_sent(load_full_state_dict):
    @functools.wraps(load_full_state_dict)
    def load(accelerator, model, full_sd, *args, **kwargs):
        if accelerator.is_main_process:  # the test of the function it wraps: rank 0 sends
            released = _ReleasedAsRead(full_sd)
            full_sd.clear()  # the caller's own reference to the same dict (fsdp2_prepare_model's original_sd)
            full_sd = released
        return load_full_state_dict(accelerator, model, full_sd, *args, **kwargs)
    return load


# accelerate 1.15's FSDP2 load from rank 0 (fsdp_utils.fsdp2_prepare_model -> fsdp2_load_full_state_dict): rank 0 takes
# model.state_dict(), moves the model to the meta device, then broadcasts one tensor at a time and keeps its slice;
# the state dict holds every whole tensor until the last is sent, beside the slices: two bases on the host with offload
# (the slices are the shards). Released as each is read, rank 0 holds about one base throughout, as under FSDP1.
ACCELERATE_FSDP2_RELEASES_EACH_SENT_TENSOR = Patch(
    "accelerate.utils.fsdp_utils", "fsdp2_load_full_state_dict", _releasing_each_tensor_once_sent,
    "rank 0 lets go of each whole tensor once FSDP2's load has sent it", f"accelerate {ACCELERATE_VERSION}")


def _unless_split(rewrite, position: int, passthrough):
    @functools.wraps(rewrite)
    def wrapper(*args, **kwargs):
        model = kwargs["model"] if "model" in kwargs else args[position]
        return passthrough(*args, **kwargs) if has_split_experts(model) else rewrite(*args, **kwargs)
    return wrapper


# PEFT 0.21, on transformers 5, rewrites the LoRA config and adapter state dicts of MoE model types whose layout changed
# (Mixtral, Qwen2/3-MoE, ...): targets named like a transformers 4 expert (`w1`, `gate_proj`) or router (`gate`) become
# fused `target_parameters` (peft/utils/transformers_weight_conversion.py, called from `BaseTuner.inject_adapter` and
# `set_peft_model_state_dict`). On a model whose experts moe.split_experts made into linear modules those names are
# real modules; the rewrite would leave the experts out and adapt the router. A stock (fused) model still gets them,
# which is how an adapter trained here loads onto it.
PEFT_KEEPS_SPLIT_EXPERTS = [
    Patch("peft.utils.transformers_weight_conversion", "convert_peft_config_for_transformers",
          lambda rewrite: _unless_split(rewrite, 1, lambda *args, **kwargs: None),
          "PEFT's MoE config rewrite skipped on split experts", f"peft {PEFT_VERSION}"),
    Patch("peft.utils.transformers_weight_conversion", "convert_peft_adapter_state_dict_for_transformers",
          lambda rewrite: _unless_split(rewrite, 0, lambda *args, **kwargs: kwargs.get("adapter_state_dict",
                                                                                         args[2] if len(args) > 2
                                                                                         else None)),
          "PEFT's MoE adapter rewrite skipped on split experts", f"peft {PEFT_VERSION}"),
]


def peft_keeps_split_experts() -> None:
    for patch in PEFT_KEEPS_SPLIT_EXPERTS:
        patch.apply()


SPLIT_EXPERTS_MARK = "_recipe_split_experts"  # a class attribute of moe.ExpertLinears


def has_split_experts(model) -> bool:
    return any(getattr(module, SPLIT_EXPERTS_MARK, False) for module in model.modules())


@contextlib.contextmanager
def transformers_zero3_hidden(hide: bool):
    """transformers' global ZeRO-3 switch (`integrations.deepspeed._hf_deepspeed_config_weak_ref`) off for the
    duration: with it on, transformers refuses a device_map and builds the model inside zero.Init, where every rank
    reads the checkpoint (measured on 2 CPU processes: each grew 2.7 times the model's bytes). Rank 0 / meta loading
    needs both off; sharding.partition_from_rank0 partitions the model afterwards."""
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref
    if not (hide and hf_deepspeed.is_deepspeed_zero3_enabled()):
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(reference())


def _around_prepare_model(accelerator, before: Callable[[], Any], after: Callable[[], Any]) -> None:
    prepare_model = accelerator.prepare_model

    @functools.wraps(prepare_model)
    def prepared(*args, **kwargs):
        before()
        try:
            return prepare_model(*args, **kwargs)
        finally:
            after()

    accelerator.prepare_model = prepared


def before_each_model_wrap(accelerator, adjust: Callable[[], Any]) -> None:
    """`adjust()` each time `accelerator` is about to wrap a model, the last moment the FSDP plugin can still change.
    transformers 5.23's Trainer (`_prepare_for_training`) calls `update_fsdp_plugin_peft` just before
    `accelerator.prepare(model)`, and for a 4-bit model with float storage that sets the plugin's mixed precision to the
    storage dtype with `override=True`, buffers included: a change made when the accelerator was built is gone by then.
    accelerate 1.15's `prepare` reaches the wrap through the instance's `prepare_model`."""
    _around_prepare_model(accelerator, adjust, lambda: None)


def fsdp_param_init_fn_released_after_wrap(accelerator) -> None:
    """The FSDP plugin's own `param_init_fn` back once `accelerator` has wrapped a model. accelerate 1.15's
    `prepare_model` replaces it for FSDP1 with `ensure_weights_retied`'s closure, which keeps every parameter named in
    the model's `_tied_weights_keys` as `param_init_fn` materialized it, for as long as the plugin lives. With weights
    from rank 0 (sync_module_states), each other rank materializes them: it kept a whole `lm_head` (transformers names
    it for Llama, tied or not) beside its shard for the whole run, on the GPU where accelerate materializes there
    (measured on 2 CPU processes: 0.49 GiB, a 128k x 2048 bf16 head, on rank 1; tests/test_distributed.py)."""
    own = {}

    def remember() -> None:
        own["plugin"] = plugin = getattr(accelerator.state, "fsdp_plugin", None)
        own["fn"] = getattr(plugin, "param_init_fn", None)

    def give_back() -> None:
        if own["plugin"] is not None:
            own["plugin"].param_init_fn = own["fn"]

    _around_prepare_model(accelerator, remember, give_back)


def _compile_on_first_call(compile_now):
    """torch.compile that compiles a function when it is first called rather than when it is decorated."""
    def compile_later(function=None, **options):
        if function is None:  # used as @torch.compile(...)
            return lambda decorated: compile_later(decorated, **options)
        compiled = None

        @functools.wraps(function)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                try:
                    compiled = compile_now(function, **options)
                except Exception:  # refused at once (as bitsandbytes' own wrapper allows): the function as written
                    compiled = function
            return compiled(*args, **kwargs)
        return call
    return compile_later


# Two libraries pass functions to torch.compile while they are imported, and torch.compile imports torch's inductor:
# - bitsandbytes, about ten of its fallback kernels (backends/default/ops.py, `_try_torch_compile`): 1.6 s of every
#   process's start on a 2 GHz CPU (`import train`: 9.8-10.3 s against 7.8-9.1 s, measured), for kernels that CPU runs
#   with the native library and GPU runs never call. peft and transformers import bitsandbytes whenever it is
#   installed, so it is imported here first.
# - DeepSpeed, whose engine checks that the optimizer is one ZeRO supports (`runtime.zero.utils.
#   is_zero_supported_optimizer`) and first imports its Muon optimizer to list it there; that module compiles three
#   functions: 0.72 s of each DeepSpeed rank's start on an AVX512 CPU (measured), for an optimizer the recipe never
#   builds. train.build_trainer imports it first in DeepSpeed runs.
# Each is imported with the compilation deferred to each function's first call, where it happens as before.
TORCH_COMPILES_ON_FIRST_CALL = Patch(
    "torch", "compile", _compile_on_first_call,
    "import-time torch.compile calls deferred to first use (no inductor import at start)",
    f"bitsandbytes {BITSANDBYTES_VERSION}, deepspeed {DEEPSPEED_VERSION}")
DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_compiling_later(module: str) -> None:
    """Import `module`, if installed, with TORCH_COMPILES_ON_FIRST_CALL applied for the import alone."""
    import importlib.util

    if module in sys.modules:
        return
    try:
        if importlib.util.find_spec(module) is None:
            return
    except ImportError:  # a parent package is missing
        return
    with TORCH_COMPILES_ON_FIRST_CALL:
        importlib.import_module(module)


# Library messages a user of the recipe can do nothing about, each silenced alone (a logger's level, or a warning
# filter on its own text and category, and the module that raises it), with why. tests/test_compat.py checks that each
# is still raised upstream.
SILENCED_LOGGERS = {  # logger: the message
    # bitsandbytes 0.50, at import: its CPU backend looks for the optional `kernels` package's gemm kernel and, absent,
    # uses its own (what every CPU run here computes with); nothing to install for the recipe
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}
SILENCED_WARNINGS = [
    # TRL 1.16 reads the model's `is_gradient_checkpointing` (trl/models/utils.py), which transformers 5.23 renamed and
    # warns about
    (FutureWarning, "`is_gradient_checkpointing` is deprecated", "transformers.modeling_utils"),
]


def silence_unactionable_messages() -> None:
    import logging
    import warnings

    for logger in SILENCED_LOGGERS:
        logging.getLogger(logger).setLevel(logging.ERROR)
    for category, text, _ in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=category)


silence_unactionable_messages()  # before bitsandbytes is imported below
import_compiling_later("bitsandbytes")  # on import: train.py imports this module before transformers and peft


def _models_scanned_once(define):
    """define_import_structure that answers transformers/models/__init__.py from the scan of the same folder that
    transformers/__init__.py made a moment before (kept by define_import_structure's own cache)."""
    from pathlib import Path

    import transformers

    models = Path(transformers.__file__).parent / "models"

    @functools.wraps(define)
    def define_once(module_path, prefix=None):
        if prefix is not None or Path(module_path) != models / "__init__.py":
            return define(module_path, prefix)
        scanned = define(models, prefix="models")  # transformers/__init__.py's own call, so its cache answers
        # that call's result also holds the top-level modules transformers/__init__.py added to it: not under models.
        return {backends: {name.removeprefix("models."): set(objects) for name, objects in modules.items()
                           if name.startswith("models.")}
                for backends, modules in scanned.items()}
    return define_once


# transformers builds the lazy import table of its ~550 model folders by reading every file in them, twice per process:
# in transformers/__init__.py and again in transformers/models/__init__.py, because the per-folder cache between the
# two (`create_import_structure_from_path`, an lru_cache of 128) is smaller than the folders it walks. The second
# walk is 0.64 s of every process that uses a model on a 2 GHz CPU (measured); its table is the first one's without the
# "models." prefix. Applied when this module is imported: after `import transformers`, before transformers.models.
TRANSFORMERS_SCANS_ITS_MODELS_ONCE = Patch(
    "transformers.utils.import_utils", "define_import_structure", _models_scanned_once,
    "transformers' model folders read once per process, not twice", f"transformers {TRANSFORMERS_VERSION}")
TRANSFORMERS_SCANS_ITS_MODELS_ONCE.apply()


def _parsed_once(reader_class):
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]
    return reader


# transformers reads a GGUF file three times to load a model and its tokenizer (the config, the weights, the
# tokenizer: each `gguf.GGUFReader(path)` parses every metadata field in Python, the 49k-token vocabulary included,
# 7 s each on a 2 GHz CPU), and builds gguf's TensorNameMap again for each of the model's ~400 submodules
# (`get_gguf_hf_weights_map`, 8 s). Both are read-only, so for model_files.convert_default_model one parse and one map
# serve every call: the conversion at install took 47-49 s, 25-27 s with these (measured), to the same bytes.
GGUF_READ_ONCE = [
    Patch("gguf", "GGUFReader", _parsed_once, "one parse of a GGUF file per conversion", f"gguf {GGUF_VERSION}"),
    Patch("gguf", "get_tensor_name_map", functools.cache, "one TensorNameMap per architecture and depth",
          f"gguf {GGUF_VERSION}"),
]


@contextlib.contextmanager
def gguf_read_once():
    """GGUF_READ_ONCE applied for the duration (transformers imports both names from gguf when it reads a file)."""
    with contextlib.ExitStack() as stack:
        for patch in GGUF_READ_ONCE:
            stack.enter_context(patch)
        yield


# accelerate 1.15's FullyShardedDataParallelPlugin reads FSDP_SYNC_MODULE_STATES and FSDP_CPU_RAM_EFFICIENT_LOADING from
# the environment and, for FSDP1, builds sync_module_states' param_init_fn for the current GPU, raising without one;
# the Accelerator builds that plugin from the environment even on CPU. Both read as off while a plugin is built on a
# host without an accelerator (trainers.cpu_fsdp_plugin then gives their meaning back, for the CPU).
FSDP1_PLUGIN_WITHOUT_AN_ACCELERATOR = [
    Patch("os.environ", name, lambda _: "false", "an FSDP1 plugin built on CPU without its GPU-only settings",
          f"accelerate {ACCELERATE_VERSION}", item=True)
    for name in ("FSDP_SYNC_MODULE_STATES", "FSDP_CPU_RAM_EFFICIENT_LOADING")]


@contextlib.contextmanager
def fsdp1_plugin_without_an_accelerator(applies: bool = True):
    """FSDP1_PLUGIN_WITHOUT_AN_ACCELERATOR applied for the duration (where `applies`: an FSDP1 launch)."""
    with contextlib.ExitStack() as stack:
        for patch in FSDP1_PLUGIN_WITHOUT_AN_ACCELERATOR if applies else []:
            stack.enter_context(patch)
        yield


def dynamo_settings_for_accelerate(values: dict[str, str]) -> None:
    """`values` (ACCELERATE_DYNAMO_* variables) put in this process's environment for the rest of the run: transformers
    5.23 builds accelerate's `TorchDynamoPlugin` with the backend and mode only, and accelerate 1.15's plugin reads
    regional compilation and dynamic shapes from the environment when the Trainer builds its Accelerator."""
    for name, value in values.items():
        Patch("os.environ", name, lambda _, value=value: value, "torch.compile's settings for accelerate's plugin",
              f"accelerate {ACCELERATE_VERSION}", item=True).apply()


def record_engine(state, distributed_type, fsdp_plugin=None, deepspeed_plugin=None, device=None) -> None:
    """The engine recorded in accelerate's state as accelerate 1.15 records it on an accelerator: on the Accelerator's
    `AcceleratorState` and in `PartialState._shared_state`, which every later AcceleratorState() re-reads. On a host
    without an accelerator accelerate records none (trainers.CpuEngineSFTTrainer puts it back)."""
    from accelerate.state import PartialState

    if fsdp_plugin is not None:
        state.fsdp_plugin = fsdp_plugin
    if deepspeed_plugin is not None:
        state.deepspeed_plugins = deepspeed_plugin
    if device is not None:
        state.device = PartialState._shared_state["device"] = device
    state.distributed_type = PartialState._shared_state["distributed_type"] = distributed_type


def keep_4bit_layers_trainable(model) -> None:
    """bitsandbytes 0.50 repacks a 4-bit weight into an inference-only layout the first time an AVX512-BF16 CPU runs its
    layer in eval mode without grad (`Linear4bit.support_avx512bf16_for_cpu`, set when the layer is built), and never
    unpacks it: every evaluation during or before training would then silently drop the input gradients of each 4-bit
    layer. Each layer keeps the trainable layout."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# Private names the recipe reads, writes or overrides without replacing them, each checked by tests/test_compat.py:
# (module, dotted name, where the recipe uses it and why)
PRIVATE_NAMES = [
    ("accelerate.state", "PartialState._shared_state", "trainers.CpuEngineSFTTrainer: every AcceleratorState "
     "re-reads the process-level state, so the engine kept on CPU is recorded there as accelerate records it"),
    ("accelerate.commands.launch", "_validate_launch_command", "launch.launch_environment: the environment "
     "`accelerate launch` would export, for --check and the tests"),
    ("transformers.trainer", "Trainer._save_checkpoint", "checkpoints.CompleteCheckpointsMixin: a completion marker "
     "after every rank has written the checkpoint"),
    ("torch.distributed.fsdp._flat_param", "FlatParameter._fqns", "sharding.gather_fsdp1_adapter: each FSDP1 unit's "
     "own parameter names"),
    ("transformers.integrations.deepspeed", "_hf_deepspeed_config_weak_ref", "compat.transformers_zero3_hidden"),
    ("accelerate.state", "AcceleratorState.distributed_type", "compat.record_engine: the engine a CPU run keeps"),
    ("torch.nn", "Module._parameters", "sharding.py: parameters swapped in place (materialized, converted to 4-bit) "
     "without registration checks or hooks"),
    ("torch.nn", "Module._buffers", "sharding.receive_from_rank0: rank 0's non-persistent buffers put in place"),
    ("torch.nn", "Module._non_persistent_buffers_set", "sharding.receive_from_rank0: the buffers no checkpoint "
     "holds, which rank 0 sends"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel._handle", "sharding.gather_fsdp1_adapter: each FSDP1 unit's "
     "flat parameter"),
    ("transformers", "AutoModelForCausalLM._model_mapping", "fast_paths: the model class a config builds, to read "
     "whether it supports SDPA before loading"),
    ("transformers", "PreTrainedModel._supports_sdpa", "fast_paths: whether the model class runs SDPA"),
    ("transformers", "PreTrainedModel._no_split_modules", "fast_paths and checks: the decoder-layer classes FSDP "
     "wraps"),
    ("transformers", "PretrainedConfig._attn_implementation", "fast_paths.packed_row_in_flight: the attention a "
     "forward runs"),
    ("transformers.modeling_utils", "_is_hf_initialized", "moe.split_as_loaded marks the split experts' parameters "
     "initialized, or transformers' init after the load overwrites them"),
    ("argparse", "_ActionsContainer._actions", "arguments.py: every flag of the parser, with its type and default"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "compat.set_collective_timeout: the shorter training "
     "timeout once the weights are in place (the load's longer one is the process group's from its start)"),
]


def set_collective_timeout(seconds: float) -> None:
    """The default process group's timeout from now on (torch's own setter, private in torch 2.13: every backend)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds))

"""Canaries for compat.py: each fails when the upstream code a patch or a private name relies on changes (then the
patch is looked at again before it silently stops doing what it says)."""

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch

from recipe import compat


@pytest.mark.parametrize("package, version", [("peft", compat.PEFT_VERSION), ("trl", compat.TRL_VERSION),
                                              ("torch", compat.TORCH_VERSION), ("deepspeed", compat.DEEPSPEED_VERSION),
                                              ("transformers", compat.TRANSFORMERS_VERSION),
                                              ("bitsandbytes", compat.BITSANDBYTES_VERSION)])
def test_the_pinned_versions_are_the_ones_the_patches_were_written_for(package, version):
    assert importlib.import_module(package).__version__.startswith(version)


def test_a_patch_applies_once_and_undoes():
    import trl.trainer.utils as trl_utils

    patch, original = compat.TRL_SCORES_LABELLED_POSITIONS_ON_CPU, trl_utils._use_triton
    was_applied = patch._applied
    patch.undo()
    original = trl_utils._use_triton
    with patch:
        patched = trl_utils._use_triton
        patch.apply()  # idempotent: not wrapped twice
        assert trl_utils._use_triton is patched and patched(torch.device("cpu"))
    assert trl_utils._use_triton is original
    if was_applied:
        patch.apply()


def test_trl_decides_the_compact_lm_head_with_use_triton_alone():
    """`trl.trainer.utils` calls `_use_triton` once, to choose the compact (labelled positions only) head; the kernel
    module keeps its own function for the kernel choice, which the patch leaves alone."""
    import trl.trainer.utils as trl_utils
    from trl.kernels import chunked_logprob

    assert inspect.getsource(trl_utils).count("_use_triton(") == 1
    assert "_use_triton" in vars(chunked_logprob)


def test_torch_fsdp1_guard_is_where_the_patch_lifts_it():
    from torch.distributed.fsdp import _init_utils

    guard = inspect.getsource(_init_utils._check_module_states_for_sync_module_states)
    assert "cpu" in guard.lower()
    check = "_check_module_states_for_sync_module_states("
    assert check in inspect.getsource(_init_utils._sync_module_params_and_buffers) \
        or check in inspect.getsource(_init_utils)


def test_bitsandbytes_compiles_its_kernels_when_it_is_imported():
    """The deferral is worth keeping while bitsandbytes calls torch.compile on its kernels at import."""
    from bitsandbytes.backends.default import ops

    assert "torch.compile(fn" in inspect.getsource(ops._try_torch_compile)
    assert inspect.getsource(ops).count("@_try_torch_compile") >= 4


def test_deepspeeds_optimizer_check_imports_its_muon_optimizer_which_compiles_when_imported():
    """The deferral is worth keeping while DeepSpeed's engine imports its Muon optimizer to check the optimizer, and
    that module decorates functions with torch.compile (through `runtime.compiler.compile()`, torch.compile itself)."""
    from deepspeed.runtime import compiler
    from deepspeed.runtime.zero import utils

    assert f"from {compat.DEEPSPEED_MUON} import MuonWithAuxAdam" in inspect.getsource(
        utils.is_zero_supported_optimizer)
    assert "return torch.compile\n" in inspect.getsource(compiler.compile)
    # read, not imported: importing it is what loads the inductor
    source = Path(importlib.util.find_spec("deepspeed.runtime.zero.muon.original_muon").origin).read_text()
    assert source.count("@compiler.compile()") >= 3


def test_a_deferred_compile_compiles_once_on_the_first_call_or_runs_the_function_as_written():
    calls = []

    def compile_now(function, **options):
        calls.append(options)
        return lambda x: function(x) + 100

    compile_later = compat._compile_on_first_call(compile_now)
    doubled = compile_later(lambda x: 2 * x, dynamic=False)
    assert calls == []  # not at decoration
    assert doubled(1) == 102 and doubled(2) == 104 and calls == [{"dynamic": False}]  # once, with its options
    assert compile_later(dynamic=True)(lambda x: 3 * x)(1) == 103  # as @torch.compile(...)

    def refuse(function, **options):
        raise RuntimeError("not supported here")

    assert compat._compile_on_first_call(refuse)(lambda x: 2 * x)(1) == 2


@pytest.mark.e2e
def test_the_recipe_starts_without_importing_torchs_inductor_or_deepspeed():
    """What the deferrals save: nothing the recipe imports loads the inductor, and accelerate's unwrapping of a model
    (patched) does not load deepspeed (a subprocess: this one may have both). And the libraries' objects are frozen
    out of the collector once imported (train.py), which is on again. In a DeepSpeed run, what the engine's optimizer
    check imports does not load the inductor either."""
    import subprocess
    import sys

    from recipe.model.model_files import REPO_DIR

    probe = ("import gc, sys, torch, train; from recipe import compat; "
             "from accelerate.utils import extract_model_from_parallel; "
             "compat.ACCELERATE_ASKS_DEEPSPEED_ONLY_ONCE_IMPORTED.apply(); "
             "extract_model_from_parallel(torch.nn.Linear(2, 2)); "
             "print(sorted(m for m in sys.modules if m.startswith(('torch._inductor.compile_fx', 'deepspeed'))),"
             " gc.get_freeze_count() > 10**5, gc.isenabled()); "
             f"compat.import_compiling_later(compat.DEEPSPEED_MUON); from {compat.DEEPSPEED_MUON} import "
             "MuonWithAuxAdam; print(MuonWithAuxAdam.__name__, 'torch._inductor.compile_fx' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_DIR, capture_output=True, text=True, check=True)
    lines = result.stdout.strip().splitlines()  # deepspeed logs to stdout between the two
    assert (lines[0], lines[-1]) == ("[] True True", "MuonWithAuxAdam False"), result.stdout


def test_accelerate_imports_deepspeed_only_to_recognise_its_engine():
    """accelerate.utils.other asks `is_deepspeed_available()` once, in extract_model_from_parallel, to import
    DeepSpeedEngine: what the patch answers for that module alone."""
    from accelerate.utils import other

    source = inspect.getsource(other)
    assert source.count("is_deepspeed_available()") == 1
    unwrap = inspect.getsource(other.extract_model_from_parallel)
    assert "if is_deepspeed_available():\n        from deepspeed import DeepSpeedEngine" in unwrap


def test_the_trainer_sets_fsdps_policy_just_before_accelerate_wraps_through_prepare_model():
    """compat.before_each_model_wrap: transformers' Trainer sets a PEFT model's FSDP plugin (a 4-bit model's mixed
    precision, with override) right before `accelerator.prepare(model)`, and accelerate's prepare wraps a model through
    the instance's `prepare_model`, so an adjustment made there has the last word."""
    from accelerate import Accelerator
    from transformers import Trainer
    from transformers.distributed import fsdp as hf_fsdp

    loop = inspect.getsource(Trainer._prepare_for_training)
    assert loop.index("update_fsdp_plugin_peft(self.model, self.accelerator)") \
        < loop.index("model = self.accelerator.prepare(self.model)")
    update = inspect.getsource(hf_fsdp.update_fsdp_plugin_peft)
    assert "set_mixed_precision(" in update and "override=True" in update
    assert "self.prepare_model(obj" in inspect.getsource(Accelerator._prepare_one)


def test_accelerate_keeps_each_retied_parameter_in_the_param_init_fn_it_leaves_on_the_plugin():
    """compat.fsdp_param_init_fn_released_after_wrap: accelerate's FSDP1 `prepare_model` swaps the plugin's
    param_init_fn for ensure_weights_retied's closure, which stores each tied parameter as param_init_fn made it."""
    from accelerate import Accelerator
    from accelerate.utils import fsdp_utils

    assert "fsdp_plugin.param_init_fn = ensure_weights_retied(" in inspect.getsource(Accelerator.prepare_model)
    assert "_tied_params[id_key] = getattr(module, param_name)" in inspect.getsource(fsdp_utils.ensure_weights_retied)


def test_the_plugin_gets_its_own_param_init_fn_back_once_the_model_is_wrapped():
    from types import SimpleNamespace

    def own(module):
        return module

    class Accelerator:  # what accelerate 1.15's prepare_model does to the plugin (the canary above)
        state = SimpleNamespace(fsdp_plugin=SimpleNamespace(param_init_fn=own))

        def prepare_model(self, model):
            self.state.fsdp_plugin.param_init_fn = lambda module: module  # keeps what it re-tied
            return model

    accelerator, model = Accelerator(), object()
    compat.fsdp_param_init_fn_released_after_wrap(accelerator)
    assert accelerator.prepare_model(model) is model and accelerator.state.fsdp_plugin.param_init_fn is own


def test_deepspeed_lists_its_shm_comm_op_among_the_compatible_ops():
    import deepspeed.ops

    assert "deepspeed_shm_comm" in deepspeed.ops.__compatible_ops__


def test_peft_rewrites_moe_targets_where_the_patch_expects():
    """The PEFT patch replaces two attributes of peft.utils.transformers_weight_conversion; PEFT imports both from that
    module at call time, so the replacement is what runs."""
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils import save_and_load

    inject = inspect.getsource(BaseTuner.inject_adapter)
    assert "from peft.utils.transformers_weight_conversion import" in inject
    assert "convert_peft_config_for_transformers(" in inject
    load = inspect.getsource(save_and_load.set_peft_model_state_dict)
    assert "from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers" \
        in load
    compat.peft_keeps_split_experts()
    compat.peft_keeps_split_experts()  # once only, however often it is asked
    from peft.utils import transformers_weight_conversion as conversion

    assert not hasattr(conversion.convert_peft_config_for_transformers.__wrapped__, "__wrapped__")


@pytest.mark.parametrize("module, name, use", compat.PRIVATE_NAMES, ids=[n for _, n, _ in compat.PRIVATE_NAMES])
def test_each_private_name_the_recipe_uses_is_still_there(module, name, use):
    holder = importlib.import_module(module)
    owner, _, attribute = name.rpartition(".")
    if owner:
        holder = getattr(holder, owner)
    # an attribute of the class or module, or one of its instances' (set or read in its own code)
    assert hasattr(holder, attribute) or attribute in inspect.getsource(holder), use


def test_writing_a_modules_parameters_dict_replaces_the_parameter():
    """sharding.py swaps parameters through `module._parameters[name]` (no registration checks, no hooks)."""
    layer = torch.nn.Linear(2, 2)
    replacement = torch.nn.Parameter(torch.zeros(2, 2))
    layer._parameters["weight"] = replacement
    assert dict(layer.named_parameters())["weight"] is replacement


def test_transformers_models_table_is_what_its_own_walk_of_the_folder_makes():
    """TRANSFORMERS_SCANS_ITS_MODELS_ONCE answers transformers/models/__init__.py from transformers/__init__.py's scan
    of the same folder: the table equals upstream's own walk, comes from that scan's cache, and upstream still walks
    the folder twice (the two calls below, a folder cache smaller than the folders) for the patch to be worth
    keeping."""
    import os

    import transformers
    from transformers.utils import import_utils

    patch = compat.TRANSFORMERS_SCANS_ITS_MODELS_ONCE
    assert patch._applied and import_utils.define_import_structure is not patch._original
    models = Path(transformers.__file__).parent / "models"
    assert 'define_import_structure(Path(__file__).parent / "models", prefix="models")' in inspect.getsource(
        transformers)
    assert "define_import_structure(_file)" in (models / "__init__.py").read_text()
    folders = sum(len([d for d in dirs if d != "__pycache__"]) for _, dirs, _ in os.walk(models))  # as upstream walks
    assert import_utils.create_import_structure_from_path.cache_info().maxsize < folders

    define = patch._original
    hits = define.cache_info().hits
    table = import_utils.define_import_structure(str(models / "__init__.py"))
    assert define.cache_info().hits == hits + 1  # transformers/__init__.py's scan, not a second walk
    assert table == define.__wrapped__(str(models / "__init__.py"))  # upstream's walk, uncached
    assert "llama.modeling_llama" in table[frozenset({"torch"})]


def test_gguf_read_once_serves_transformers_one_parse_and_one_name_map(tmp_path):
    """GGUF_READ_ONCE: transformers imports GGUFReader and get_tensor_name_map from gguf inside the functions that read
    a file (so the patched names reach it), and within gguf_read_once a file is parsed once and a map built once; both
    names are gguf's own again afterwards. (The default model's conversion with and without it: byte-identical
    files.)"""
    import gguf
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    assert importlib.metadata.version("gguf").startswith(compat.GGUF_VERSION)
    assert "reader = GGUFReader(gguf_checkpoint_path)" in inspect.getsource(hf_gguf.load_gguf_checkpoint)
    assert "name_map = get_tensor_name_map(arch, num_layers)" in inspect.getsource(hf_gguf.get_gguf_hf_weights_map)
    source = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_tensor("token_embd.weight", np.ones((4, 2), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with compat.gguf_read_once():
        first = gguf.GGUFReader(source)
        assert gguf.GGUFReader(str(source)) is first and isinstance(first, reader_class)
        assert hf_gguf.read_field(first, "general.architecture") == ["llama"]
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(source) is not first


def test_transformers_prepares_masks_where_the_packed_row_patch_stops_it():
    """`_preprocess_mask_arguments` takes (config, inputs_embeds, attention_mask, past_key_values, position_ids, ...)
    and answers a 7-tuple led by "stop early"; the packed check it runs reads the device (the reason for the patch).
    tests/test_model_families.py shows the read gone with the patch and present without it."""
    from transformers import masking_utils

    parameters = list(inspect.signature(masking_utils._preprocess_mask_arguments).parameters)
    assert parameters[:5] == ["config", "inputs_embeds", "attention_mask", "past_key_values", "position_ids"]
    source = inspect.getsource(masking_utils._preprocess_mask_arguments)
    assert "return True, None, None, None, None, None, None" in source
    assert "find_packed_sequence_indices(position_ids)" in source
    assert ".all()" in inspect.getsource(masking_utils.find_packed_sequence_indices)


def test_transformers_sets_each_loaded_parameter_where_the_expert_split_hooks_in():
    """compat.TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED: the load calls the module-level set_param_for_module (model,
    target name, value, loading info, quantizer) once per target, after the converters have merged a layer's experts,
    and loads lazily (each mapping's tensors read as it converts). tests/test_moe.py shows each layer split as it
    loads, on both checkpoint layouts."""
    from transformers import core_model_loading

    parameters = list(inspect.signature(core_model_loading.set_param_for_module).parameters)
    assert parameters == ["model", "target_name", "param_value", "loading_info", "hf_quantizer"]
    load = inspect.getsource(core_model_loading.convert_and_load_state_dict_in_model)
    assert "set_param_for_module(\n" in load and "realized_value = mapping.convert(" in load
    assert "return _job" in inspect.getsource(core_model_loading.spawn_materialize)  # lazy without a thread pool


def test_accelerates_fsdp2_load_reads_each_tensor_of_rank0s_state_dict_once():
    """compat.ACCELERATE_FSDP2_RELEASES_EACH_SENT_TENSOR: fsdp2_load_full_state_dict reads `full_sd[name]` once per
    name on rank 0, and fsdp2_prepare_model's own state dict (the same dict) is not read after the load."""
    from accelerate.utils import fsdp_utils

    load = inspect.getsource(fsdp_utils.fsdp2_load_full_state_dict)
    assert load.count("full_sd[") == 1 and "full_param = full_sd[param_name]" in load
    prepare = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    after = prepare.split("fsdp2_load_full_state_dict(", 1)[1].split(")", 1)[1]
    assert "original_sd" not in after

    released = compat._ReleasedAsRead({"a": torch.zeros(1), "b": torch.ones(1)})
    assert "a" in released and released["a"].item() == 0 and "a" not in released and list(released) == ["b"]


def test_each_silenced_library_message_is_still_raised_where_the_recipe_silences_it():
    """compat.SILENCED_LOGGERS and SILENCED_WARNINGS: each message is still in the module that says it; once one goes
    upstream, its silence goes too."""
    for logger, text in compat.SILENCED_LOGGERS.items():
        assert text in inspect.getsource(importlib.import_module(logger)), logger
    for _, text, module in compat.SILENCED_WARNINGS:
        assert text in inspect.getsource(importlib.import_module(module)), module


def test_an_fsdp1_plugin_built_on_cpu_needs_its_gpu_only_settings_off(monkeypatch):
    """accelerate builds sync_module_states' param_init_fn for the current GPU: on CPU it raises, unless the FSDP1
    settings read as off while the plugin is built (compat.FSDP1_PLUGIN_WITHOUT_AN_ACCELERATOR); unset variables are
    unset again afterwards."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_VERSION", "1")
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "true")
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    with pytest.raises(Exception):
        FullyShardedDataParallelPlugin()
    with compat.fsdp1_plugin_without_an_accelerator():
        assert not FullyShardedDataParallelPlugin().sync_module_states
    assert os.environ["FSDP_SYNC_MODULE_STATES"] == "true" and "FSDP_CPU_RAM_EFFICIENT_LOADING" not in os.environ


def test_bitsandbytes_repacks_4bit_weights_only_where_its_cpu_switch_says():
    """compat.keep_4bit_layers_trainable turns off the switch Linear4bit's forward reads before repacking."""
    from bitsandbytes.nn import Linear4bit

    source = inspect.getsource(Linear4bit)
    assert "self.support_avx512bf16_for_cpu = " in source and "and self.support_avx512bf16_for_cpu" in source
    model = torch.nn.Sequential(Linear4bit(64, 64))
    compat.keep_4bit_layers_trainable(model)
    assert model[0].support_avx512bf16_for_cpu is False


def test_accelerates_dynamo_plugin_reads_the_settings_the_recipe_exports(monkeypatch):
    """compat.dynamo_settings_for_accelerate: TorchDynamoPlugin takes regional compilation and dynamic shapes from the
    environment (transformers passes it neither)."""
    from accelerate.utils import TorchDynamoPlugin

    for name in ("USE_REGIONAL_COMPILATION", "USE_DYNAMIC"):
        monkeypatch.delenv(f"ACCELERATE_DYNAMO_{name}", raising=False)
    assert not TorchDynamoPlugin(backend="inductor").use_regional_compilation
    compat.dynamo_settings_for_accelerate({"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true",
                                           "ACCELERATE_DYNAMO_USE_DYNAMIC": "true"})
    try:
        plugin = TorchDynamoPlugin(backend="inductor")
        assert plugin.use_regional_compilation and plugin.dynamic
    finally:
        for name in ("USE_REGIONAL_COMPILATION", "USE_DYNAMIC"):
            os.environ.pop(f"ACCELERATE_DYNAMO_{name}", None)

"""The recipe's trainer: TRL's SFTTrainer with complete checkpoints and save-and-stop on a signal (checkpoints.py),
told its signal handler and resume point when it is built; on a host without an accelerator, the same trainer keeping
FSDP or DeepSpeed instead of the fallback accelerate picks there.
"""

from __future__ import annotations

import functools

import torch
from trl import SFTTrainer

from recipe.engines.checkpoints import CompleteCheckpointsMixin
from recipe.model.fast_paths import WithExampleLengths, packed_rows
from recipe.platform.launch import Launch


class CpuEngineSFTTrainer(SFTTrainer):
    """SFTTrainer that keeps FSDP or DeepSpeed on a host without an accelerator.

    accelerate honours an FSDP plugin or a DeepSpeed launch only on accelerator devices: on CPU it silently falls back
    to DDP over gloo (FSDP with `use_cpu`), or to one process that believes it is alone (DeepSpeed without it), so the
    sharding code users run on GPUs would never be exercised. FSDP1, FSDP2 and DeepSpeed ZeRO-3 all run on CPU over
    gloo. So let the Trainer build its CPU Accelerator (which sets up the gloo process group), then put back the
    decision accelerate dropped: the FSDP plugin read from the same FSDP_* environment `accelerate launch` exports
    (`cpu_fsdp_plugin`), or the DeepSpeed plugin the training arguments built from it; then the same
    `accelerator.prepare` path runs as on GPUs. Set `engine` ("fsdp" or "deepspeed") in a subclass."""

    launch: Launch  # the settled launch, set by CompleteCheckpointsMixin before the Trainer builds its Accelerator

    def __init__(self, *args, engine: str = "fsdp", **kwargs):
        self.engine = engine
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.utils import DistributedType

        from recipe.compat import fsdp1_plugin_without_an_accelerator, record_engine

        launch = self.launch
        # the Accelerator builds an FSDP plugin from the environment, even on CPU
        with fsdp1_plugin_without_an_accelerator(launch.fsdp_version == 1):
            super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if self.engine == "deepspeed":
            from deepspeed import comm

            from recipe.compat import DEEPSPEED_SKIPS_SHM_COMM
            from transformers.integrations.deepspeed import propagate_args_to_deepspeed

            DEEPSPEED_SKIPS_SHM_COMM.apply()  # DeepSpeed's CPU-inference all-reduce: minutes to build on first use
            comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # over accelerate's process group
            plugin = self.args.deepspeed_plugin  # TrainingArguments built it from the launch environment
            plugin.select(_from_accelerator_state=True)
            record_engine(state, DistributedType.DEEPSPEED, deepspeed_plugin=plugin)
            self.accelerator.deepspeed_engine_wrapped = None
            self.is_deepspeed_enabled = True
            propagate_args_to_deepspeed(self.accelerator, self.args)  # batch size, accumulation, clipping, optimizer
        else:
            plugin = cpu_fsdp_plugin(launch)
            if state.mixed_precision != "no":  # as accelerate does on GPUs: FSDP's own mixed-precision policy
                plugin.set_mixed_precision(state.mixed_precision)
            # FSDP1 compares device_id with torch.cpu.current_device(): "cpu", not "cpu:0"
            record_engine(state, DistributedType.FSDP, fsdp_plugin=plugin,
                          device=torch.device("cpu") if launch.fsdp_version == 1 else None)
            self.is_fsdp_enabled = True


# What FSDP does differently on a host without an accelerator (cpu_fsdp_plugin), per accelerate setting in effect:
# the FSDP versions it applies to, the value and why; settle() records each as a decision.
CPU_FSDP_OVERRIDES = {
    "OFFLOAD_PARAMS": ((1, 2), "off", "the parameters already live in host RAM, and FSDP's parameter offload moves "
                       "them to and from an accelerator"),
    "SYNC_MODULE_STATES": ((1,), "over gloo", "torch's own broadcast from rank 0, once its 'CPU tensors need a GPU' "
                           "guard is lifted (it guards NCCL, which cannot send host memory)"),
}


def cpu_fsdp_overrides(launch: Launch) -> dict[str, tuple[str, str]]:
    """The CPU_FSDP_OVERRIDES this launch's FSDP settings call for: {setting: (value, why)}."""
    return {setting: (value, why) for setting, (versions, value, why) in CPU_FSDP_OVERRIDES.items()
            if launch.fsdp_version in versions and launch.fsdp_setting(setting)}


def cpu_fsdp_plugin(launch: Launch):
    """The FSDP plugin of this launch, built on a host without an accelerator (the changes: CPU_FSDP_OVERRIDES).

    Parameter offload, which moves parameters between host RAM and an accelerator, is off under either version
    (accelerate's FSDP2 load asks for the accelerator and raises). FSDP1 differs further: accelerate builds
    `sync_module_states`' param_init_fn for the current GPU and raises without one, so the plugin is built without it
    and given the same function for the CPU; torch refuses to sync CPU tensors (NCCL cannot send them), a guard this
    process lifts since gloo can."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if launch.fsdp_version != 1:
        from torch.distributed.fsdp import OffloadPolicy

        plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_AUTO_WRAP_POLICY, ... from the env
        plugin.cpu_offload = OffloadPolicy()  # FSDP2's "no offload"
        return plugin
    from torch.distributed.fsdp import CPUOffload

    from recipe.compat import TORCH_FSDP1_SYNCS_CPU_TENSORS, fsdp1_plugin_without_an_accelerator

    with fsdp1_plugin_without_an_accelerator():
        plugin = FullyShardedDataParallelPlugin()
    plugin.cpu_ram_efficient_loading = launch.fsdp_setting("CPU_RAM_EFFICIENT_LOADING")
    if launch.fsdp_setting("SYNC_MODULE_STATES") or plugin.cpu_ram_efficient_loading:
        plugin.sync_module_states = True
        plugin.param_init_fn = lambda module: module.to_empty(device="cpu", recurse=False)
        TORCH_FSDP1_SYNCS_CPU_TENSORS.apply()
    plugin.cpu_offload = CPUOffload(offload_params=False)
    return plugin


def keep_fsdp1_buffers_in_fp32(plugin) -> bool:
    """Give an FSDP1 plugin's bf16/fp16 mixed-precision policy fp32 buffers; True if it changed the policy.

    accelerate 1.15's `set_mixed_precision` gives FSDP1 `buffer_dtype` = the compute dtype (and transformers 5.23 sets a
    4-bit model's policy to its float storage dtype the same way, bf16 flag or not), and torch 2.13's FSDP1 casts
    every buffer to it before the first forward (tests/test_distributed.py shows it). The rotary embedding's inverse
    frequencies are a buffer: in bf16 they keep 8 bits, and each position's phase drifts in proportion to its index
    (at 2048 tokens the fastest-turning pairs are 2.5 rad off with RoPE base 10^4, 3.7 with 5 x 10^5), so the adapter
    would train on positions that inference, which keeps them fp32, never shows it. FSDP2 and ZeRO-3 leave buffers as
    loaded."""
    policy = getattr(plugin, "mixed_precision_policy", None)
    if plugin is None or plugin.fsdp_version != 1 or policy is None or policy.buffer_dtype in (None, torch.float32):
        return False
    plugin.set_mixed_precision(policy.param_dtype, buffer_autocast=True, override=True)
    return True


class Fsdp1WrapMixin:
    """FSDP1's wrap as the recipe wants it: mixed precision with fp32 buffers (keep_fsdp1_buffers_in_fp32), set as the
    model is wrapped, since the Trainer sets a 4-bit model's policy again just before (compat.before_each_model_wrap);
    and no parameter kept past the wrap by accelerate's re-tying (compat.fsdp_param_init_fn_released_after_wrap)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from recipe.compat import before_each_model_wrap, fsdp_param_init_fn_released_after_wrap

        accelerator = self.accelerator
        before_each_model_wrap(accelerator,
                               lambda: keep_fsdp1_buffers_in_fp32(getattr(accelerator.state, "fsdp_plugin", None)))
        fsdp_param_init_fn_released_after_wrap(accelerator)


class PackedRowsMixin:
    """Each packed row's example lengths kept on the host from the collator to the attention (fast_paths.packed_rows):
    a step reads nothing back from the GPU to find its examples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if getattr(self.data_collator, "padding_free", False):
            self.data_collator = WithExampleLengths(self.data_collator)

    def training_step(self, model, inputs, *args, **kwargs):
        with packed_rows(inputs):  # the backward too: activation checkpointing runs the layers again there
            return super().training_step(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        with packed_rows(inputs):
            return super().prediction_step(model, inputs, *args, **kwargs)


class RecipeSFTTrainer(CompleteCheckpointsMixin, Fsdp1WrapMixin, PackedRowsMixin, SFTTrainer):
    """SFTTrainer with the recipe's checkpoint handling (checkpoints.py), FSDP1's wrap (Fsdp1WrapMixin) and host-side
    example lengths (PackedRowsMixin)."""


class RecipeCpuEngineSFTTrainer(CompleteCheckpointsMixin, Fsdp1WrapMixin, PackedRowsMixin, CpuEngineSFTTrainer):
    """The same, keeping FSDP or DeepSpeed on a host without an accelerator."""


def trainer_class(cpu_engine: str | None, launch: Launch):
    """The trainer to build for the settled launch: RecipeSFTTrainer, or RecipeCpuEngineSFTTrainer with the engine
    (`cpu_engine`: "fsdp" or "deepspeed")."""
    if cpu_engine is None:
        return functools.partial(RecipeSFTTrainer, launch=launch)
    return functools.partial(RecipeCpuEngineSFTTrainer, engine=cpu_engine, launch=launch)

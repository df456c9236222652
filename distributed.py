"""What the launchers need at run time: the real FSDP path on CPU hosts, and the FSDP <-> DeepSpeed mapping.

    python distributed.py translate configs/fsdp_config.yaml            # the equivalent DeepSpeed accelerate config
    python distributed.py translate configs/deepspeed_config.yaml -o x.yaml
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from trl import SFTTrainer

from checkpoints import CompleteCheckpointsMixin


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    return env.get(name, str(default)).lower() in ("1", "true", "yes")


@dataclass
class Launch:
    """The distributed settings in effect, read from the environment `accelerate launch` gives each process (or
    would give it, for `train.py --check --accelerate_config`). The one place that reads those variables."""

    env: Mapping[str, str] = field(default_factory=dict)
    num_processes: int = 1

    @classmethod
    def current(cls) -> Launch:
        return cls(dict(os.environ), int(os.environ.get("WORLD_SIZE", 1)))

    @property
    def fsdp(self) -> bool:
        return _flag(self.env, "ACCELERATE_USE_FSDP")

    @property
    def deepspeed(self) -> bool:
        return _flag(self.env, "ACCELERATE_USE_DEEPSPEED")

    @property
    def fsdp_version(self) -> int:
        return int(self.env.get("FSDP_VERSION", "1"))

    @property
    def zero_stage(self) -> int | None:
        """From the accelerate config, or from the DeepSpeed JSON it points to."""
        if not self.deepspeed:
            return None
        if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in self.env:
            return int(self.env["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
        json_file = self.env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if json_file != "none" and Path(json_file).is_file():
            import json

            return json.loads(Path(json_file).read_text()).get("zero_optimization", {}).get("stage")
        return None

    @property
    def sharded(self) -> bool:
        """Parameters are flattened and split across ranks (FSDP, or ZeRO-3)."""
        return self.fsdp or self.zero_stage == 3

    def fsdp_setting(self, name: str, default: bool = False) -> bool:
        return _flag(self.env, f"FSDP_{name}", default)

    @property
    def mixed_precision(self) -> str:
        return self.env.get("ACCELERATE_MIXED_PRECISION", "no")

    @property
    def fsdp_sharding_strategy(self) -> str:
        """FSDP1's strategy: accelerate's launcher always exports one (FULL_SHARD unless the config says)."""
        return self.env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()

    @property
    def fsdp_reshard_after_forward(self) -> str:
        """FSDP2's setting as written ("" when the config has none; FSDP1 configs may carry a strategy name here)."""
        return self.env.get("FSDP_RESHARD_AFTER_FORWARD", "").upper()

    @property
    def fsdp_shards_gradients_only(self) -> bool:
        """SHARD_GRAD_OP (FSDP1) or reshard_after_forward false (FSDP2): parameters stay gathered between forward and
        backward."""
        if self.fsdp_version == 1:
            return self.fsdp_sharding_strategy == "SHARD_GRAD_OP"
        return self.fsdp_reshard_after_forward == "FALSE"

    @property
    def fsdp_wrap_policy(self) -> str:
        return self.env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")

    @property
    def fsdp_layer_classes(self) -> list[str]:
        """The decoder-layer classes the config names for FSDP to wrap (empty: the model's own _no_split_modules)."""
        return [name.strip() for name in self.env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if name.strip()]

    @property
    def deepspeed_offload(self) -> bool:
        return self.env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", "")

    def deepspeed_setting(self, name: str) -> str:
        """A DeepSpeed value the accelerate config wrote (ACCELERATE_<NAME>), "auto" where it wrote none."""
        return self.env.get(f"ACCELERATE_{name}", "auto")

    @property
    def local_rank(self) -> int:
        return int(self.env.get("LOCAL_RANK", 0))

    @property
    def rank(self) -> int:
        return int(self.env.get("RANK", 0))

    @property
    def weights_from_rank0(self) -> bool:
        """FSDP's RAM-efficient loading, or ZeRO-3's partitioning at load (zero3_init_flag): rank 0 reads the
        checkpoint, the others receive their shards (sharding.py)."""
        if self.fsdp:
            return self.fsdp_setting("CPU_RAM_EFFICIENT_LOADING")
        return self.zero_stage == 3 and _flag(self.env, "ACCELERATE_DEEPSPEED_ZERO3_INIT")


class CpuEngineSFTTrainer(SFTTrainer):
    """SFTTrainer that keeps FSDP or DeepSpeed on a host without an accelerator.

    accelerate honours an FSDP plugin or a DeepSpeed launch only on accelerator devices: on CPU it silently falls back
    to DDP over gloo (FSDP with `use_cpu`), or to one process that believes it is alone (DeepSpeed without it), so the
    sharding code users run on GPUs would never be exercised. FSDP1, FSDP2 and DeepSpeed ZeRO-3 all run on CPU over
    gloo. So let the Trainer build its CPU Accelerator (which sets up the gloo process group), then put back the
    decision accelerate dropped: the FSDP plugin read from the same FSDP_* environment `accelerate launch` exports
    (`cpu_fsdp_plugin`), or the DeepSpeed plugin the training arguments built from it; then the same
    `accelerator.prepare` path runs as on GPUs. Set `engine` ("fsdp" or "deepspeed") in a subclass."""

    def __init__(self, *args, engine: str = "fsdp", launch: Launch | None = None, **kwargs):
        self.engine, self.launch = engine, launch or Launch.current()  # read while the Trainer builds its Accelerator
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        launch = self.launch
        with without_fsdp1_device_settings(launch):  # the Accelerator builds an FSDP plugin from the env, even on CPU
            super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if self.engine == "deepspeed":
            from deepspeed import comm

            from compat import DEEPSPEED_SKIPS_SHM_COMM
            from transformers.integrations.deepspeed import propagate_args_to_deepspeed

            DEEPSPEED_SKIPS_SHM_COMM.apply()  # DeepSpeed's CPU-inference all-reduce: minutes to build on first use
            comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # over accelerate's process group
            plugin = self.args.deepspeed_plugin  # TrainingArguments built it from the launch environment
            plugin.select(_from_accelerator_state=True)
            state.deepspeed_plugins, state.distributed_type = plugin, DistributedType.DEEPSPEED
            self.accelerator.deepspeed_engine_wrapped = None
            self.is_deepspeed_enabled = True
            propagate_args_to_deepspeed(self.accelerator, self.args)  # batch size, accumulation, clipping, optimizer
        else:
            state.fsdp_plugin, state.distributed_type = cpu_fsdp_plugin(launch), DistributedType.FSDP
            if state.mixed_precision != "no":  # as accelerate does on GPUs: FSDP's own mixed-precision policy
                state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
            self.is_fsdp_enabled = True
            if launch.fsdp_version == 1:  # FSDP1 compares device_id with torch.cpu.current_device(): "cpu", not "cpu:0"
                state.device = PartialState._shared_state["device"] = torch.device("cpu")
        # Every later AcceleratorState() re-reads the process-level state: record the engine there too, as accelerate
        PartialState._shared_state["distributed_type"] = state.distributed_type


# What FSDP1 does differently on a host without an accelerator (cpu_fsdp_plugin), per accelerate setting in effect:
# the value and why; settle() records each as a decision.
CPU_FSDP1_OVERRIDES = {
    "OFFLOAD_PARAMS": ("off", "the parameters already live in host RAM, and FSDP1's CPUOffload needs an accelerator"),
    "SYNC_MODULE_STATES": ("over gloo", "torch's own broadcast from rank 0, once its 'CPU tensors need a GPU' guard "
                           "is lifted (it guards NCCL, which cannot send host memory)"),
}


def cpu_fsdp_plugin(launch: Launch):
    """The FSDP plugin of this launch, built on a host without an accelerator.

    FSDP2 builds as it is. FSDP1 differs where a CPU forces it (CPU_FSDP1_OVERRIDES): accelerate builds
    `sync_module_states`' param_init_fn for the current GPU and raises without one, so the plugin is built without it
    and given the same function for the CPU; torch refuses to sync CPU tensors (NCCL cannot send them), a guard this
    process lifts since gloo can; and parameter offload, which needs an accelerator, is off (nothing to move)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if launch.fsdp_version != 1:
        return FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_AUTO_WRAP_POLICY, ... from the env
    from torch.distributed.fsdp import CPUOffload

    from compat import TORCH_FSDP1_SYNCS_CPU_TENSORS

    with without_fsdp1_device_settings(launch):
        plugin = FullyShardedDataParallelPlugin()
    plugin.cpu_ram_efficient_loading = launch.fsdp_setting("CPU_RAM_EFFICIENT_LOADING")
    if launch.fsdp_setting("SYNC_MODULE_STATES") or plugin.cpu_ram_efficient_loading:
        plugin.sync_module_states = True
        plugin.param_init_fn = lambda module: module.to_empty(device="cpu", recurse=False)
        TORCH_FSDP1_SYNCS_CPU_TENSORS.apply()
    plugin.cpu_offload = CPUOffload(offload_params=False)
    return plugin


@contextmanager
def without_fsdp1_device_settings(launch: Launch):
    """The FSDP1 settings whose plugin construction needs an accelerator switched off in this process's environment
    (the environment is restored afterwards; cpu_fsdp_plugin puts their meaning back)."""
    names = ("FSDP_SYNC_MODULE_STATES", "FSDP_CPU_RAM_EFFICIENT_LOADING")
    saved = {name: os.environ.get(name) for name in names}
    if launch.fsdp_version == 1:
        os.environ.update(dict.fromkeys(names, "false"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RecipeSFTTrainer(CompleteCheckpointsMixin, SFTTrainer):
    """SFTTrainer with the recipe's checkpoint handling (checkpoints.py)."""


class RecipeCpuEngineSFTTrainer(CompleteCheckpointsMixin, CpuEngineSFTTrainer):
    """The same, keeping FSDP or DeepSpeed on a host without an accelerator."""


def trainer_class(cpu_engine: str | None, launch: Launch | None = None):
    """The trainer to build: RecipeSFTTrainer, or RecipeCpuEngineSFTTrainer with the engine (`cpu_engine`: "fsdp" or
    "deepspeed") and the settled launch."""
    if cpu_engine is None:
        return RecipeSFTTrainer
    return functools.partial(RecipeCpuEngineSFTTrainer, engine=cpu_engine, launch=launch)


def launch_environment(launch_args: list[str]) -> dict[str, str]:
    """The environment `accelerate launch <launch_args>` gives each training process, computed by accelerate's own
    launcher code without starting anything: what FullyShardedDataParallelPlugin / DeepSpeedPlugin then read."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(launch_args))
    if args.use_deepspeed:  # as accelerate's launch_command does before starting DeepSpeed
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
        return prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return prepare_multi_gpu_env(args)
    return {}


# ----------------------------------------------------------------------------------------------------------------
# FSDP <-> DeepSpeed: the accelerate config keys that mean the same thing, in one place.

# FSDP sharding (FSDP1 strategy name or FSDP2 reshard_after_forward) <-> ZeRO stage
SHARDING_TO_ZERO_STAGE = {"FULL_SHARD": 3, True: 3, "SHARD_GRAD_OP": 2, False: 2, "NO_SHARD": 0,
                          "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2}
ZERO_STAGE_TO_SHARDING = {1: {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 1: "SHARD_GRAD_OP", 0: "NO_SHARD"},
                          2: {3: True, 2: False, 1: False}}
# Keys that mean the same on both sides and are copied as they are.
SHARED_KEYS = ("compute_environment", "debug", "downcast_bf16", "machine_rank", "main_process_ip", "main_process_port",
               "main_training_function", "mixed_precision", "num_machines", "num_processes", "rdzv_backend",
               "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu")
# FSDP settings DeepSpeed takes care of by itself (or that have no DeepSpeed key), with what happens instead.
FSDP_ONLY = {
    "fsdp_auto_wrap_policy": "DeepSpeed partitions parameters without wrap units",
    "fsdp_transformer_layer_cls_to_wrap": "DeepSpeed partitions parameters without wrap units",
    "fsdp_backward_prefetch": "DeepSpeed prefetches by itself (stage3_prefetch_bucket_size in a DeepSpeed JSON)",
    "fsdp_forward_prefetch": "DeepSpeed prefetches by itself (stage3_prefetch_bucket_size in a DeepSpeed JSON)",
    "fsdp_use_orig_params": "DeepSpeed keeps the original parameters visible",
    "fsdp_sync_module_states": "zero.Init partitions at load, nothing to broadcast",
    "fsdp_activation_checkpointing": "no accelerate key on the DeepSpeed side: use --activation_checkpointing in train.py",
}
PRECISION_NOTE = ("precision differs: DeepSpeed keeps fp32 master weights of the trainable parameters and steps the "
                  "optimizer in fp32 whatever the load dtype; FSDP flattens and steps in the load dtype (bf16 here) "
                  "unless accelerate mixed precision upcasts them.")


def fsdp_to_deepspeed(config: dict) -> tuple[dict, list[str]]:
    """An accelerate FSDP config -> the equivalent accelerate DeepSpeed config, and what did not carry over."""
    fsdp = dict(config.get("fsdp_config", {}))
    notes = [PRECISION_NOTE]
    sharding = fsdp.pop("fsdp_sharding_strategy", None)
    sharding = fsdp.pop("fsdp_reshard_after_forward", "FULL_SHARD") if sharding is None else sharding
    stage = SHARDING_TO_ZERO_STAGE[sharding]
    if str(sharding).startswith(("HYBRID", "_HYBRID")):
        notes.append(f"{sharding} shards within a node and replicates across nodes; ZeRO-{stage} shards across all "
                     "ranks (ZeRO++ hpZ, in a DeepSpeed JSON, is the closest).")
    offload = fsdp.pop("fsdp_offload_params", False)
    if offload and stage < 3:
        notes.append("ZeRO-2 offloads the optimizer state only; FSDP offloaded parameters too.")
    ds = {
        "deepspeed_multinode_launcher": "standard",
        "offload_optimizer_device": "cpu" if offload else "none",
        "offload_param_device": "cpu" if offload and stage == 3 else "none",
        "zero3_init_flag": bool(fsdp.pop("fsdp_cpu_ram_efficient_loading", False)) and stage == 3,
        "zero3_save_16bit_model": stage == 3,
        "zero_stage": stage,
    }
    state_dict_type = fsdp.pop("fsdp_state_dict_type", "SHARDED_STATE_DICT")
    notes.append(f"fsdp_state_dict_type {state_dict_type}: DeepSpeed checkpoints are always partitioned; "
                 "zero3_save_16bit_model gathers the final adapter, as train.py does under FSDP.")
    fsdp.pop("fsdp_version", None)
    for key in list(fsdp):
        if key in FSDP_ONLY:
            fsdp.pop(key)
            notes.append(f"{key}: {FSDP_ONLY[key]}.")
    notes += [f"{key}: no DeepSpeed equivalent, dropped." for key in fsdp]
    out = {key: config[key] for key in SHARED_KEYS if key in config}
    out.update(distributed_type="DEEPSPEED", deepspeed_config=ds)
    return out, notes


def deepspeed_to_fsdp(config: dict, fsdp_version: int = 2) -> tuple[dict, list[str]]:
    """An accelerate DeepSpeed config -> the equivalent accelerate FSDP config, and what did not carry over."""
    ds = dict(config.get("deepspeed_config", {}))
    notes = [PRECISION_NOTE]
    if "deepspeed_config_file" in ds:
        raise ValueError("this config points to a DeepSpeed JSON (deepspeed_config_file); translate the settings "
                         "written in the accelerate YAML instead, or copy them into it first.")
    stage = int(ds.pop("zero_stage", 3))
    if stage not in ZERO_STAGE_TO_SHARDING[fsdp_version]:
        raise ValueError(f"ZeRO stage {stage} has no FSDP{fsdp_version} equivalent; use fsdp_version 1 (NO_SHARD).")
    if stage == 1:
        notes.append("ZeRO-1 shards the optimizer state only; FSDP has no such mode, SHARD_GRAD_OP also shards "
                     "gradients.")
    param_device = ds.pop("offload_param_device", "none")
    optimizer_device = ds.pop("offload_optimizer_device", "none")
    offload = "cpu" in (param_device, optimizer_device) or "nvme" in (param_device, optimizer_device)
    if "nvme" in (param_device, optimizer_device):
        notes.append("FSDP cannot offload to NVMe; offloading to CPU memory instead (plan host RAM for it).")
    if param_device != optimizer_device and offload:
        notes.append(f"DeepSpeed offloaded parameters to {param_device} and optimizer state to {optimizer_device}; "
                     "FSDP offloads all or nothing, so everything is offloaded.")
    init = bool(ds.pop("zero3_init_flag", False))
    fsdp = {"fsdp_version": fsdp_version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if fsdp_version == 1:
        fsdp.update(fsdp_backward_prefetch="BACKWARD_PRE", fsdp_forward_prefetch=False)
    # accelerate's launcher always exports an FSDP1 sharding strategy, which wins over reshard_after_forward there
    sharding_key = "fsdp_sharding_strategy" if fsdp_version == 1 else "fsdp_reshard_after_forward"
    fsdp[sharding_key] = ZERO_STAGE_TO_SHARDING[fsdp_version][stage]
    fsdp["fsdp_cpu_ram_efficient_loading"] = init
    if fsdp_version == 1:
        fsdp["fsdp_sync_module_states"] = init  # RAM-efficient loading needs rank 0 to broadcast on FSDP1
    fsdp["fsdp_offload_params"] = offload
    fsdp["fsdp_state_dict_type"] = "SHARDED_STATE_DICT"
    if not ds.pop("zero3_save_16bit_model", False):
        notes.append("zero3_save_16bit_model was off; under FSDP train.py gathers the final adapter regardless.")
    if fsdp_version == 1:
        fsdp["fsdp_use_orig_params"] = False
    fsdp["fsdp_activation_checkpointing"] = False
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        value = ds.pop(key, None)
        if value not in (None, "auto"):
            flag = "--gradient_accumulation_steps" if key == "gradient_accumulation_steps" else "--max_grad_norm"
            notes.append(f"{key} {value} was set in the config; pass it to train.py as {flag} {value}.")
    ds.pop("deepspeed_multinode_launcher", None)
    notes += [f"{key}: no FSDP equivalent, dropped." for key in ds]
    out = {key: config[key] for key in SHARED_KEYS if key in config}
    out.update(distributed_type="FSDP", fsdp_config=fsdp)
    return out, notes


def translate(config: dict, fsdp_version: int = 2) -> tuple[dict, list[str]]:
    kind = config.get("distributed_type")
    if kind == "FSDP":
        return fsdp_to_deepspeed(config)
    if kind == "DEEPSPEED":
        return deepspeed_to_fsdp(config, fsdp_version)
    raise ValueError(f"distributed_type {kind!r}: only FSDP and DEEPSPEED configs translate.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to = commands.add_parser("translate", help="an accelerate FSDP config to DeepSpeed, or back")
    to.add_argument("config", help="an accelerate config YAML with distributed_type FSDP or DEEPSPEED")
    to.add_argument("--fsdp_version", type=int, choices=(1, 2), default=2, help="for DeepSpeed -> FSDP")
    to.add_argument("-o", "--output", help="write the YAML here instead of printing it")
    args = parser.parse_args(argv)
    source = Path(args.config)
    try:
        translated, notes = translate(yaml.safe_load(source.read_text()), args.fsdp_version)
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"error: {source}: {err}")
    text = f"# Translated from {source.name} by `python distributed.py translate`; review the notes it printed.\n"
    text += yaml.safe_dump(translated, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


if __name__ == "__main__":
    main()

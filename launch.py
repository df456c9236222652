"""The launch in effect: what `accelerate launch` gives each process (or would give it, for `train.py --check
--accelerate_config`). `Launch` is the one reader of those variables; everyone else is handed the settled one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


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

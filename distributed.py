"""What the launchers need at run time: the real FSDP path on CPU hosts, and the FSDP <-> DeepSpeed mapping.

    python distributed.py translate configs/fsdp_config.yaml            # the equivalent DeepSpeed accelerate config
    python distributed.py translate configs/deepspeed_config.yaml -o x.yaml
"""

from __future__ import annotations

import os

import torch
from trl import SFTTrainer


def fsdp_requested() -> bool:
    """accelerate launch with an FSDP config exports ACCELERATE_USE_FSDP; the training flags can also ask for it."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


def fsdp_version() -> int:
    return int(os.environ.get("FSDP_VERSION", "1"))


def needs_cpu_fsdp() -> bool:
    return fsdp_requested() and not torch.cuda.is_available()


class CpuFsdpSFTTrainer(SFTTrainer):
    """SFTTrainer that keeps FSDP on a host without an accelerator.

    accelerate honours an FSDP plugin only on accelerator devices: on CPU it silently falls back to DDP over gloo (or,
    without `use_cpu`, to N independent single-process runs), so the sharding code users run on GPUs would never be
    exercised. FSDP2 itself (`fully_shard`) runs on CPU over gloo. So let the Trainer build its CPU Accelerator (which
    sets up the gloo process group), then put back the FSDP decision accelerate dropped: the same plugin, read from
    the same FSDP_* environment `accelerate launch` exports, and the same `accelerator.prepare` path as on GPUs.
    FSDP1 cannot run this way (its module-state sync needs a device); checks.py refuses it on CPU."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        # TrainingArguments sets up its devices lazily and resets accelerate's shared state when it does; do it now,
        # or the FSDP state set below would be wiped before the final save.
        _ = self.args.device
        super().create_accelerator_and_postprocess()
        plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_AUTO_WRAP_POLICY, ... from the env
        state = self.accelerator.state
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        # Every later AcceleratorState() re-reads the process-level state: record FSDP there too, as accelerate does
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # On CPU the gathered full-state-dict tensors share storage with FSDP's own buffers (no device-to-host copy
        # happens), and safetensors cannot address that storage: give it plain copies.
        if state_dict is not None:
            state_dict = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
        super()._save(output_dir, state_dict=state_dict)


def trainer_class() -> type[SFTTrainer]:
    return CpuFsdpSFTTrainer if needs_cpu_fsdp() else SFTTrainer

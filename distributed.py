"""FSDP <-> DeepSpeed: the accelerate config keys that mean the same thing, in one place, and the command that turns
one engine's config into the other's.

    python distributed.py translate configs/fsdp_config.yaml            # the equivalent DeepSpeed accelerate config
    python distributed.py translate configs/deepspeed_config.yaml -o x.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml



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
    "fsdp_activation_checkpointing": "no accelerate key on the DeepSpeed side: use --activation_checkpointing in "
                                     "train.py",
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

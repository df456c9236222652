"""How the weights of a sharded run reach the ranks, and how the trained adapter leaves them.

Load (FSDP with `fsdp_cpu_ram_efficient_loading: true`, ZeRO-3 with `zero3_init_flag: true` or a 4-bit model;
configuration.settle decides, utils.build_model loads):
- global rank 0 reads the checkpoint into host RAM; a 4-bit model is quantized there too, on bitsandbytes' CPU
  backend, so the whole quantized model never sits on one GPU;
- every other rank builds the same module tree on the meta device and reads nothing;
- the engine delivers the weights: accelerate's FSDP2 broadcast of rank 0's full state dict into the shards, FSDP1's
  `sync_module_states`, or DeepSpeed's conversion of a built module (`partition_from_rank0`). Rank 0 alone
  broadcasts, so reading on one rank per machine would only waste host RAM.
Two things no engine carries are sent from rank 0 here (`receive_from_rank0`): each 4-bit layer's quantization state
(absmax, code, nested statistics: 1/32 of the 4-bit bytes with nested quantization, 1/8 without; replicated, as
bitsandbytes needs it whole), and the non-persistent buffers (rotary frequencies), which are in no state dict.

Save: `gather_adapter` gathers the trainable parameters alone onto rank 0's host RAM, never the frozen base (FSDP1,
FSDP2 and ZeRO-3); `write_adapter` writes the adapter folder from them, or from the model of an unsharded run.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def is_4bit_layer(module: torch.nn.Module) -> bool:
    from bitsandbytes.nn import Linear4bit

    return isinstance(module, Linear4bit)  # the bitsandbytes layer, not PEFT's LoRA wrapper of the same name


def packed_4bit(data: torch.Tensor, state, module: torch.nn.Module):
    """A bitsandbytes Params4bit holding already-quantized `data` (packed, in the float storage dtype) with `state`."""
    from bitsandbytes.nn import Params4bit

    return Params4bit(data, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                      compress_statistics=state.nested, quant_type=state.quant_type, quant_storage=data.dtype,
                      module=module, bnb_quantized=True)


def receive_from_rank0(model: torch.nn.Module, device: torch.device, rank0: bool) -> None:
    """Rank 0 (`rank0`: this process) holds the loaded model, the other ranks its meta-device twin. Afterwards every
    rank has each 4-bit layer's quantization state (on `device`) and the non-persistent buffers; a 4-bit weight on the
    meta device takes the packed shape of rank 0's, as a bitsandbytes Params4bit (PEFT reads its quantization
    settings)."""
    for module in model.modules():
        if is_4bit_layer(module):
            weight = module.weight
            message = [(weight.shape, weight.dtype, weight.quant_state)] if rank0 else [None]
            dist.broadcast_object_list(message, src=0)
            shape, dtype, state = message[0]
            state.to(device)  # moves absmax, code and the nested statistics in place
            if not rank0:
                module.weight = packed_4bit(torch.empty(shape, dtype=dtype, device="meta"), state, module)
            module.weight.quant_state = module.quant_state = state
        names = sorted(module._non_persistent_buffers_set)
        if names:
            message = [{name: module._buffers[name] for name in names}] if rank0 else [None]
            dist.broadcast_object_list(message, src=0)
            for name, value in message[0].items():
                module._buffers[name] = value.to(device)


def zero3_config() -> dict:
    """The DeepSpeed config the Trainer registered with transformers (what zero.Init uses when transformers builds)."""
    from transformers.integrations.deepspeed import deepspeed_config

    return deepspeed_config()


def hand_to_the_engine(model: torch.nn.Module, zero3: dict | None = None, device: torch.device | None = None) -> None:
    """Ready the PEFT-wrapped model for the engine's broadcast from rank 0. Call after PEFT has wrapped the layers and
    before the engine prepares the model. ZeRO-3 (`zero3`: its config): partition_from_rank0, onto `device`.

    - Each 4-bit weight becomes a plain frozen parameter (real on rank 0, meta elsewhere) that the engine broadcasts
      and shards like any other; its quantization state stays on the module, where bitsandbytes finds it when the
      weight comes back from FSDP without one (fix_4bit_weight_quant_state_from_module). accelerate gives up its
      RAM-efficient FSDP2 broadcast as soon as it sees a Params4bit, and every rank would load the whole model.
    - Trainable parameters still on the meta device get real (uninitialised) CPU storage; rank 0's values arrive with
      the broadcast. The Trainer builds the FSDP2 optimizer before sharding and accelerate then finds each parameter's
      sharded version by its data pointer: on the meta device they all point to 0, every optimizer slot would map to
      one parameter, and the other ranks would silently train the wrong weights (seen: losses off from step 2).
      These are the adapter's parameters only, a few MB."""
    if zero3 is not None:
        partition_from_rank0(model, zero3, device or torch.device("cpu"))
        return
    for module in model.modules():
        if is_4bit_layer(module) and type(module.weight).__name__ == "Params4bit":
            module.weight = torch.nn.Parameter(module.weight.data, requires_grad=False)
    materialized: dict[int, torch.nn.Parameter] = {}  # a parameter shared by two modules stays shared
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.requires_grad and param.device.type == "meta":
                if id(param) not in materialized:
                    materialized[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"))
                module._parameters[name] = materialized[id(param)]


def partition_from_rank0(model: torch.nn.Module, zero3_config: dict, device: torch.device) -> None:
    """ZeRO-3: DeepSpeed's own conversion (zero.Init on a built module) broadcasts each parameter from rank 0 and keeps
    this rank's partition, but it first moves the parameter to the device, which a meta tensor cannot do. So convert
    one module at a time: its meta parameters get real (uninitialised) storage on the device, then DeepSpeed
    broadcasts and partitions them; a rank > 0 never holds more than one module's weights. 4-bit weights stay
    bitsandbytes Params4bit objects, with their quantization state, as bitsandbytes needs them under ZeRO-3."""
    import deepspeed
    from bitsandbytes.nn import Params4bit
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    converted: dict[int, torch.nn.Parameter] = {}  # a parameter shared by two modules is converted once
    first = None
    for module in reversed(list(model.modules())):  # children before their parents
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in converted:
                module._parameters[name] = converted[id(param)]
                continue
            if param.device.type == "meta":
                storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                if isinstance(param, Params4bit):
                    real = packed_4bit(storage, param.quant_state, module)
                else:
                    real = torch.nn.Parameter(storage, requires_grad=param.requires_grad)
                converted[id(param)] = module._parameters[name] = real
        params = [p for p in module._parameters.values() if p is not None and not is_zero_param(p)]
        if not params:
            continue
        if first is None:
            deepspeed.zero.Init(module=module, config_dict_or_path=zero3_config)
            first = params[0]
        else:
            first.convert_to_zero_parameters(param_list=params)


def gather_adapter(model: torch.nn.Module, rank0: bool) -> dict[str, torch.Tensor] | None:
    """The trainable parameters of a sharded model, whole, in host RAM on rank 0 (None on the other ranks): every rank
    takes part in each gather, and the frozen base is never gathered. FSDP2 parameters are DTensors and ZeRO-3
    parameters partitioned tensors, gathered one at a time; FSDP1 units holding trainable parameters are gathered one
    unit at a time (PEFT's wrap policy gives each LoRA layer its own unit). The Trainer's own ZeRO-3 save gathers each
    module whole, frozen weights included, before it drops them (measured: 1.7 times the base in host RAM)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDP):
        return gather_fsdp1_adapter(model, rank0)
    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if hasattr(param, "ds_numel"):  # ZeRO-3
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                if rank0:
                    state[name] = param.detach().cpu().clone()
            continue
        whole = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if rank0:
            state[name] = whole.cpu().clone()
    return state if rank0 else None


def gather_fsdp1_adapter(model, rank0: bool) -> dict[str, torch.Tensor] | None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state = {}
    for prefix, unit in model.named_modules():
        handle = getattr(unit, "_handle", None)
        if not isinstance(unit, FSDP) or handle is None or not handle.flat_param.requires_grad:
            continue
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            for name in handle.flat_param._fqns:  # the unit's own parameters, relative to the module it wraps
                param = unit.module.get_parameter(name)
                if rank0 and param.requires_grad:
                    state[f"{prefix}.{name}".removeprefix(FSDP1_WRAPPER)] = param.detach().cpu().clone()
    return state if rank0 else None


FSDP1_WRAPPER = "_fsdp_wrapped_module."


def write_adapter(peft_model, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The run's adapter folder, written once, by every engine: adapter_model.safetensors, adapter_config.json and
    PEFT's model card. `state`: gather_adapter's trained tensors (a sharded run), or None for the model's own.

    PEFT (0.21) picks an adapter's weights by the module names of the model it saves, removing only a leading
    `_fsdp_wrapped_module.`; FSDP1 wraps every decoder layer and LoRA leaf inside the PEFT model too, so its
    `save_pretrained` given FSDP1's state would write the wrappers into the names (an adapter that loads nothing) and
    given names without them it writes an empty adapter, silently. So PEFT selects and renames the weights under its
    own tree's names, and the wrappers are dropped here; what `save_pretrained` adds is done the same way: the config in
    inference mode, with the base model's name."""
    import copy

    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from peft.tuners.lora import Embedding as LoraEmbedding

    # PEFT's "auto" asks the base's config (on the Hub, warning offline that it could not) whether the vocabulary
    # changed: only where the template added tokens can it have, or where LoRA adapts an embedding; elsewhere the
    # embeddings are left out, as "auto" would leave them
    config = peft_model.peft_config["default"]
    resized_or_adapted = (getattr(config, "trainable_token_indices", None)
                          or any(isinstance(m, LoraEmbedding) for m in peft_model.modules()))
    embeddings = "auto" if resized_or_adapted else False
    weights = get_peft_model_state_dict(peft_model, state_dict=state, save_embedding_layers=embeddings)
    if state is not None and len(weights) != len(state):
        raise RuntimeError(f"PEFT took {len(weights)} of the {len(state)} trained tensors as the adapter's: "
                           f"{sorted(set(state) - set(weights))[:3]} ...")
    folder.mkdir(parents=True, exist_ok=True)
    peft_model.create_or_update_model_card(str(folder))
    weights = {name.replace(FSDP1_WRAPPER, ""): tensor.detach().cpu().contiguous() for name, tensor in weights.items()}
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(config)
    config.base_model_name_or_path = (config.base_model_name_or_path
                                      or peft_model.base_model.model.__dict__.get("name_or_path") or None)
    config.inference_mode = True
    config.save_pretrained(str(folder))

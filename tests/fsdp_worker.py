"""Runs train.py's recipe in each process of a launch, then records what the tests (and bench/gpu_check.py, one process
per shipped config on a GPU) check: how the model was sharded, the loss history, the logits of the trained sharded model
and the dtypes its buffers computed in, how far its final save is from the weights it holds, and its 4-bit layers. Not a
copy of the recipe: `train.run`, then `process.finish`, as `python train.py` does. Works under every engine
the launchers use: FSDP1, FSDP2, DeepSpeed ZeRO-3."""

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402  (before any library, as `python train.py` starts: its exit handler runs last)
from recipe.platform import process  # noqa: E402

import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from conftest import PROBE  # noqa: E402


def main() -> None:
    report_file, report = record()  # the trained model is left behind with record's frame, as with train.run's
    process.finish()  # as `python train.py` ends
    report["gloo_threads_after_finish"] = gloo_threads()
    report_file.write_text(json.dumps(report))


def record() -> tuple[Path, dict]:
    reached = record_routing()
    trainer, _ = train.run(sys.argv[1:])
    model, rank = trainer.model, int(os.environ["RANK"])  # ZeRO-3: the module inside DeepSpeed's engine
    out = Path(trainer.args.output_dir)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    fsdp1_units = {id(m.module) for m in model.modules() if isinstance(m, FSDP1)}
    report = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "world_size": torch.distributed.get_world_size(),
        "root_is_fsdp": isinstance(model, FSDPModule | FSDP1),
        "layers_are_fsdp": [isinstance(layer, FSDPModule) or id(layer) in fsdp1_units for layer in layers],
        "params": shard_sizes(model),
        "fsdp2_param_dtype": str(model._get_fsdp_state()._mp_policy.param_dtype) if isinstance(model, FSDPModule)
        else None,  # what FSDP2 casts each gathered parameter to (None: kept as stored)
        "log_history": trainer.state.log_history,
        "experts_reached": reached,
    }
    batch = trainer.processing_class([PROBE], return_tensors="pt").to(trainer.accelerator.device)
    with torch.no_grad():
        logits = model.eval()(**batch).logits  # every rank takes part in the sharded forward
    # as the forward left them: FSDP1 casts buffers to its policy's buffer dtype before it (the rotary frequencies)
    report["buffer_dtypes"] = sorted({str(buffer.dtype) for buffer in model.buffers()})
    trained = adapter_weights(model)  # every rank takes part in the gather
    if rank == 0:
        torch.save(logits.float().cpu(), out / "sharded_logits.pt")
        from safetensors.torch import load_file

        saved = load_file(out / "adapter_model.safetensors")
        report["adapter_saved_keys_match"] = sorted(saved) == sorted(trained)
        report["adapter_saved_max_abs_difference"] = max(
            ((saved[key].float() - trained[key]).abs().max().item() for key in saved if key in trained), default=None)
    report["live_tensor_bytes"] = live_tensor_bytes()
    report["inductor_imported"] = "torch._inductor.compile_fx" in sys.modules  # nothing compiles in these runs
    torch.save(four_bit_layers(model), out / f"rank{rank}_4bit.pt")
    return out / f"rank{rank}.json", report


def gloo_threads() -> int:
    """Threads of gloo's process groups still running in this process (Linux names them)."""
    names = [(task / "comm").read_text() for task in Path("/proc/self/task").iterdir()]
    return sum(name.startswith(("gloo", "pt_gloo")) for name in names)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage this process still holds (a parameter kept beside the sharded model shows here)."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a tensor whose storage FSDP has freed
                continue
    return sum(storages.values())


def record_routing() -> dict[int, list[list[int]]]:
    """For each MoE layer of this rank (moe.ExpertLinears, in order of first call), the experts each training forward
    routed tokens to."""
    from recipe.model import moe

    reached: dict[int, list[list[int]]] = {}
    order: dict[int, int] = {}
    original = moe.ExpertLinears.forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.training:
            layer = order.setdefault(id(self), len(order))
            reached.setdefault(layer, []).append(sorted(set(top_k_index.flatten().tolist())))
        return original(self, hidden_states, top_k_index, top_k_weights)

    moe.ExpertLinears.forward = forward
    return reached


def shard_sizes(model) -> dict:
    """Each parameter the engine manages (FSDP1: its flat parameters, with the names of the parameters each holds) with
    its whole and its local size."""
    sizes = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):  # FSDP2
            whole, local = p.numel(), p.to_local().numel()
        elif hasattr(p, "ds_numel"):  # ZeRO-3
            whole, local = p.ds_numel, p.ds_tensor.numel()
        elif hasattr(p, "_unpadded_unsharded_size"):  # FSDP1 flat parameter
            whole, local = p._unpadded_unsharded_size.numel(), p.numel()
        else:
            whole = local = p.numel()
        sizes[name] = {"trainable": p.requires_grad, "numel": whole, "local_numel": local,
                       **({"holds": list(p._fqns)} if hasattr(p, "_fqns") else {})}
    return sizes


def whole_parameters(model):
    """A context in which every parameter of the sharded model is whole on every rank."""
    if isinstance(model, FSDP1):
        return FSDP1.summon_full_params(model, writeback=False)
    if any(hasattr(p, "ds_numel") for p in model.parameters()):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()))
    return nullcontext()


def adapter_weights(model) -> dict:
    """The LoRA weights as the trained sharded model holds them (gathered whole), named as PEFT saves them."""
    weights = {}
    with whole_parameters(model):
        for name, p in model.named_parameters():
            if "lora_" in name:
                weight = p.full_tensor() if isinstance(p, DTensor) else p
                for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
                    name = name.replace(wrapper, "")
                weights[name.replace(".default", "")] = weight.detach().float().cpu().clone()
    return weights


def four_bit_layers(model) -> dict:
    """Each 4-bit layer's whole packed weight (gathered from the shards: every rank takes part) and this rank's copy of
    its quantization state."""
    from bitsandbytes.nn import Linear4bit

    layers = {}
    with whole_parameters(model):
        for name, module in model.named_modules():
            if isinstance(module, Linear4bit):
                weight = module.weight.full_tensor() if isinstance(module.weight, DTensor) else module.weight
                state = module.quant_state
                name = name.replace("_fsdp_wrapped_module.", "")
                layers[name.replace("base_model.model.", "", 1).replace(".base_layer", "")] = {
                    "weight": weight.detach().cpu().clone(), "absmax": state.absmax.cpu(), "code": state.code.cpu(),
                    "shape": tuple(state.shape), "nested": state.nested}
    return layers


if __name__ == "__main__":
    main()

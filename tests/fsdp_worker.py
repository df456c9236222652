"""Runs train.py's recipe in each process of a launch, then records what the tests (and bench/gpu_check.py, one process
per shipped config on a GPU) check: how the model was sharded, the loss history, and the logits of the trained sharded
model. Not a copy of the recipe: `train.run` is the same call `python train.py` makes."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import train  # noqa: E402
from conftest import PROBE  # noqa: E402


def main() -> None:
    trainer, _ = train.run(sys.argv[1:])
    model, rank = trainer.model, int(os.environ["RANK"])
    out = Path(trainer.args.output_dir)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    report = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "world_size": torch.distributed.get_world_size(),
        "root_is_fsdp": isinstance(model, FSDPModule),
        "layers_are_fsdp": [isinstance(layer, FSDPModule) for layer in layers],
        "params": {name: {"dtensor": isinstance(p, DTensor), "trainable": p.requires_grad, "numel": p.numel(),
                          "local_numel": p.to_local().numel() if isinstance(p, DTensor) else p.numel()}
                   for name, p in model.named_parameters()},
        "log_history": trainer.state.log_history,
    }
    batch = trainer.processing_class([PROBE], return_tensors="pt").to(trainer.accelerator.device)
    with torch.no_grad():
        logits = model.eval()(**batch).logits  # every rank takes part in the sharded forward
    if rank == 0:
        torch.save(logits.float().cpu(), out / "sharded_logits.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.save(four_bit_layers(model), out / f"rank{rank}_4bit.pt")


def four_bit_layers(model) -> dict:
    """Each 4-bit layer's whole packed weight (gathered from the shards: every rank takes part) and this rank's copy of
    its quantization state."""
    from bitsandbytes.nn import Linear4bit

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear4bit):
            weight = module.weight.full_tensor() if isinstance(module.weight, DTensor) else module.weight
            state = module.quant_state
            layers[name.replace("base_model.model.", "", 1).replace(".base_layer", "")] = {
                "weight": weight.detach().cpu(), "absmax": state.absmax.cpu(), "code": state.code.cpu(),
                "shape": tuple(state.shape), "nested": state.nested}
    return layers


if __name__ == "__main__":
    main()

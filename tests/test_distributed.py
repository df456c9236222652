"""The FSDP path on 2 processes over gloo, through the shipped FSDP2 config: it shards what it should, agrees with a
single-process run on the same global batch, and its final save reloads in one process to the same logits."""

import json

import pytest
import torch
from conftest import PROBE, base_model, launch_two_processes, tiny_run_args
from peft import PeftModel
from safetensors.torch import load_file

import train
from utils import REPO_DIR

pytestmark = pytest.mark.multiprocess
WORKER = REPO_DIR / "tests" / "fsdp_worker.py"


def recipe_args(model_dir, data_dir, out, batch_size, quantized):
    # SGD and no LoRA dropout: the comparison with one process is then exact up to float rounding (AdamW would hide a
    # gradient scaled by the world size, and dropout masks differ per rank).
    return tiny_run_args(model_dir, data_dir, out, "--max_steps", "3", "--per_device_train_batch_size", str(batch_size),
                         "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type", "constant",
                         "--lora_dropout", "0", "--splits", "train", "--save_strategy", "steps", "--save_steps", "3",
                         *(["--use_4bit_quantization", "true"] if quantized else []))


def losses(history):
    return [(entry["loss"], entry["grad_norm"]) for entry in history if "loss" in entry]


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora-4bit-bf16-storage"])
def test_fsdp_on_two_processes_matches_one_process(tiny_model_dir, wide_model_dir, chat_dir, tmp_path, quantized):
    # LoRA on the wide model, whose loading and saving memory is large enough to measure against the plan
    model_dir = tiny_model_dir if quantized else wide_model_dir
    config = REPO_DIR / "configs" / "fsdp2_config.yaml"
    launch_two_processes(WORKER, recipe_args(model_dir, chat_dir, tmp_path / "fsdp", 2, quantized), config)
    ranks = [json.loads((tmp_path / "fsdp" / f"rank{r}.json").read_text()) for r in (0, 1)]

    # The real FSDP path ran, not the DDP fallback accelerate picks on CPU by itself.
    for report in ranks:
        assert report["distributed_type"] == "DistributedType.FSDP" and report["world_size"] == 2
        assert report["root_is_fsdp"] and report["layers_are_fsdp"] == [True, True]  # one unit per decoder layer
        lora = {n: p for n, p in report["params"].items() if "lora_" in n}
        assert lora and all(p["trainable"] and p["dtensor"] for p in lora.values())
        assert all(p["local_numel"] * 2 == p["numel"] for p in lora.values())  # each rank holds half
        frozen = {n: p for n, p in report["params"].items() if "lora_" not in n}
        assert all(p["dtensor"] and not p["trainable"] for p in frozen.values())  # 4-bit weights too: bf16 storage
        assert sum(p["local_numel"] for p in frozen.values()) < 0.6 * sum(p["numel"] for p in frozen.values())

    single, _ = train.run(recipe_args(model_dir, chat_dir, tmp_path / "single", 4, quantized))
    two, one = losses(ranks[0]["log_history"]), losses(single.state.log_history)
    assert len(two) == len(one) == 3
    # gloo has been reported to sum FSDP2 gradients instead of averaging them: the grad norm would double
    tolerance = dict(rtol=1e-2, atol=0) if quantized else dict(rtol=1e-5, atol=0)  # bf16 compute for 4-bit
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), **tolerance)

    sharded_adapter = load_file(tmp_path / "fsdp" / "adapter_model.safetensors")
    single_adapter = load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert sharded_adapter.keys() == single_adapter.keys()
    for name in single_adapter:  # every shard came back: rank 1's half is not left at its initial value
        reference = single_adapter[name].float()
        # bf16 (4-bit runs): the two runs reduce gradients in a different order; at learning rate 0.5 that moves
        # weights by up to ~3% of their largest value after 3 steps (measured). fp32: rounding only.
        atol = 0.05 * reference.abs().max().item() if quantized else 1e-6
        torch.testing.assert_close(sharded_adapter[name].float(), reference, rtol=0, atol=atol)
        if "lora_B" in name:
            half = sharded_adapter[name].shape[0] // 2
            assert sharded_adapter[name][half:].abs().sum() > 0

    if quantized:  # every rank got rank 0's quantization: the same packed weights and state as one process's load
        from bitsandbytes.nn import Linear4bit

        single_layers = {name: module for name, module in base_model(recipe_args(
            model_dir, chat_dir, tmp_path / "unused", 4, True)).named_modules() if isinstance(module, Linear4bit)}
        for rank in (0, 1):
            layers = torch.load(tmp_path / "fsdp" / f"rank{rank}_4bit.pt")
            assert layers.keys() == single_layers.keys() and layers
            for name, layer in layers.items():
                reference = single_layers[name].weight
                assert torch.equal(layer["weight"].view(torch.uint8), reference.data.view(torch.uint8)), name
                assert torch.equal(layer["absmax"], reference.quant_state.absmax), name
                assert torch.equal(layer["code"], reference.quant_state.code), name
                assert layer["shape"] == tuple(reference.quant_state.shape), name

    # The final save is a plain adapter: one process reloads it to the sharded model's logits.
    base = base_model(recipe_args(model_dir, chat_dir, tmp_path / "unused", 4, quantized))
    reloaded = PeftModel.from_pretrained(base, tmp_path / "fsdp", autocast_adapter_dtype=not quantized).eval()
    batch = single.processing_class([PROBE], return_tensors="pt")
    with torch.no_grad():
        logits = reloaded(**batch).logits.float()
    torch.testing.assert_close(logits, torch.load(tmp_path / "fsdp" / "sharded_logits.pt"),
                               **(dict(rtol=0, atol=0) if quantized else dict(rtol=0, atol=1e-5)))

    if not quantized:  # what each rank held while loading and saving, against the plan
        from test_sharding import assert_phases_as_planned

        summary = json.loads((tmp_path / "fsdp" / "run_summary.json").read_text())
        assert_phases_as_planned(summary["results"]["memory_by_rank"], model_dir, "lora")

    if not quantized:  # the intermediate FSDP checkpoint (DCP shards) becomes the adapter the final save wrote
        from export import consolidate

        checkpoint = tmp_path / "fsdp" / "checkpoint-3"
        assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
        assert not (checkpoint / "adapter_model.safetensors").exists()  # sharded: not loadable as it is
        consolidated = load_file(consolidate(checkpoint) / "adapter_model.safetensors")
        assert consolidated.keys() == sharded_adapter.keys()
        for name in sharded_adapter:
            assert torch.equal(consolidated[name], sharded_adapter[name])

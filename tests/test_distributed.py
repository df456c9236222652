"""Every sharded launcher on 2 processes over gloo, through its shipped accelerate config and train.py: FSDP1, FSDP2
and DeepSpeed ZeRO-3, each with LoRA and QLoRA. Each run shards what it should, agrees with a one-process run on the
same global batch, loads as the plan says (rank 1 reads nothing of the base), saves only the adapter, and its final
save reloads in one process to the same logits."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import PROBE, base_model, launch_two_processes, losses, tiny_run_args
from peft import PeftModel
from safetensors.torch import load_file

import train
from recipe.planning.memory import Run, Shapes, load_config, plan
from recipe.model.model_files import REPO_DIR

pytestmark = pytest.mark.multiprocess
WORKER = REPO_DIR / "tests" / "fsdp_worker.py"
# id: (shipped accelerate config, engine, FSDP version, 4-bit, machines). On a CPU the recipe changes only what a CPU
# cannot do (trainers.CPU_FSDP_OVERRIDES); the launch changes only the process count and precision (no mixed
# precision, except FSDP2 QLoRA: the configs' bf16 policy, which emulated bf16 makes slow, in one case). The
# multi-machine configs run as two machines of one process each on this host, each its own `accelerate launch` with
# its machine rank, found through the rendezvous on 127.0.0.1 (the single-machine FSDP2 and ZeRO-3 configs run with
# 2 processes in tests/test_reliability.py).
CASES = {
    "fsdp2-lora-2-machines": ("fsdp2_config_multinode.yaml", "fsdp", 2, False, 2),
    "fsdp2-qlora-bf16-mixed-precision-2-machines": ("fsdp2_config_multinode.yaml", "fsdp", 2, True, 2),
    "fsdp1-lora": ("fsdp_config.yaml", "fsdp", 1, False, 1),
    "fsdp1-qlora": ("fsdp_config_qlora.yaml", "fsdp", 1, True, 1),  # its offload is off on CPU (CPU_FSDP_OVERRIDES)
    "zero3-lora-2-machines": ("deepspeed_config_multinode.yaml", "deepspeed", 2, False, 2),
    "zero3-qlora": ("deepspeed_config_z3_qlora.yaml", "deepspeed", 2, True, 1),
}


def recipe_args(model_dir, data_dir, out, batch_size, quantized, checkpoint=False):
    # SGD and no LoRA dropout: the comparison with one process is then exact up to float rounding (AdamW would hide a
    # gradient scaled by the world size, and dropout masks differ per rank). 4-bit layers compute in fp32: bf16 is
    # emulated, many times slower, on CPUs without it; the weights stay stored in bf16, as the launchers store them.
    return tiny_run_args(model_dir, data_dir, out, "--max_steps", "3", "--per_device_train_batch_size", str(batch_size),
                         "--optim", "sgd", "--learning_rate", "0.5", "--lr_scheduler_type", "constant",
                         "--lora_dropout", "0", "--splits", "train", "--save_strategy", "steps" if checkpoint else "no",
                         "--save_steps", "3",
                         *(["--use_4bit_quantization", "true", "--bnb_4bit_compute_dtype", "float32"]
                           if quantized else []))


_single_runs = {}


def one_process_run(model_dir, data_dir, out, quantized):
    """The same run on one process with the whole global batch (once per test worker and method)."""
    if quantized not in _single_runs:
        trainer, _ = train.run(recipe_args(model_dir, data_dir, out, 4, quantized))
        _single_runs[quantized] = (losses(trainer.state.log_history, with_grad_norm=True),
                                   load_file(out / "adapter_model.safetensors"), trainer.processing_class)
    return _single_runs[quantized]


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one_process_and_load_and_save_as_planned(wide_model_dir, chat_dir, tmp_path_factory,
                                                                      case):
    config, engine, fsdp_version, quantized, machines = CASES[case]
    out = tmp_path_factory.mktemp(case)
    mixed_precision = "bf16" if "mixed-precision" in case else "no"
    checkpoint = case == "fsdp2-lora-2-machines"  # an intermediate (sharded) checkpoint, consolidated below
    launch_two_processes(WORKER, recipe_args(wide_model_dir, chat_dir, out, 2, quantized, checkpoint),
                         REPO_DIR / "configs" / config, mixed_precision, machines)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    # The real engine ran, not the DDP (or lone-process) fallback accelerate picks on a CPU by itself, and sharded.
    for report in ranks:
        assert report["distributed_type"] == f"DistributedType.{engine.upper()}" and report["world_size"] == 2
        if engine == "fsdp":
            assert report["root_is_fsdp"] and report["layers_are_fsdp"] == [True, True]  # one unit per decoder layer
        if fsdp_version == 2 and engine == "fsdp":  # FSDP2's bf16 policy is active where launched with it: it does
            # not touch the 4-bit payload stored in bf16 (the payloads below are bit-identical to one process's)
            assert report["fsdp2_param_dtype"] == ("torch.bfloat16" if mixed_precision == "bf16" else "None")
        # the trained model computed from fp32 buffers (the rotary frequencies), as a reloaded one does; FSDP1 casts
        # them to its policy's buffer dtype, which transformers sets to a 4-bit model's bf16 storage
        assert report["buffer_dtypes"] == ["torch.float32"]
        # nothing imported torch's inductor on the way: not DeepSpeed's optimizer check (compat.import_compiling_later)
        assert not report["inductor_imported"]
        if engine == "deepspeed" or fsdp_version == 2:  # why a finished rank leaves without the interpreter's
            # teardown (process.finish): gloo's threads outlive the destroyed group, kept by DTensor's caches and
            # DeepSpeed's lists of groups (under FSDP1 by the trainer's reference cycles, until a collection)
            assert report["gloo_threads_after_finish"] > 0
        for trainable in (True, False):  # each rank holds half of the adapter and half of the base (4-bit included)
            params = [p for p in report["params"].values() if p["trainable"] == trainable]
            assert params and sum(p["local_numel"] for p in params) <= 0.55 * sum(p["numel"] for p in params)
        assert all(0 < p["local_numel"] < p["numel"] for p in report["params"].values() if p["trainable"])

    if engine == "fsdp":  # rank 1 keeps nothing beside its shard that rank 0 does not: accelerate's FSDP1 re-tying
        # kept the lm_head rank 1 had materialized for the broadcast, 0.6x more bytes than rank 0's
        # (compat.fsdp_param_init_fn_released_after_wrap). ZeRO-3's parameters in flight vary by rank (100 MB seen).
        assert ranks[1]["live_tensor_bytes"] <= 1.01 * ranks[0]["live_tensor_bytes"]
    one_losses, one_adapter, tokenizer = one_process_run(wide_model_dir, chat_dir, tmp_path_factory.mktemp("one"),
                                                         quantized)
    two = losses(ranks[0]["log_history"], with_grad_norm=True)
    assert len(two) == len(one_losses) == 3
    # gloo has been reported to sum FSDP2 gradients instead of averaging them: the grad norm would double
    tolerance = dict(rtol=1e-2, atol=0) if quantized else dict(rtol=1e-5, atol=0)  # 4-bit: bf16-stored weights
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one_losses), **tolerance)

    sharded_adapter = load_file(out / "adapter_model.safetensors")
    assert sharded_adapter.keys() == one_adapter.keys()
    # The save wrote what the trained model holds, exactly (its weights gathered whole after training)
    assert ranks[0]["adapter_saved_keys_match"] and ranks[0]["adapter_saved_max_abs_difference"] == 0.0
    for name in one_adapter:  # every shard came back: rank 1's half is not left at its initial value
        reference = one_adapter[name].float()
        # 4-bit: the two runs reduce gradients in a different order over bf16-stored weights; at learning rate 0.5
        # that moves weights by up to ~3% of their largest value after 3 steps (measured). fp32: rounding only.
        atol = 0.05 * reference.abs().max().item() if quantized else 1e-6
        torch.testing.assert_close(sharded_adapter[name].float(), reference, rtol=0, atol=atol)
        if "lora_B" in name:
            half = sharded_adapter[name].shape[0] // 2
            assert sharded_adapter[name][half:].abs().sum() > 0

    base_args = recipe_args(wide_model_dir, chat_dir, tmp_path_factory.mktemp("unused"), 4, quantized)
    if quantized:  # every rank got rank 0's quantization: the same packed weights and state as one process's load
        from bitsandbytes.nn import Linear4bit

        single_layers = {name: module for name, module in base_model(base_args).named_modules()
                         if isinstance(module, Linear4bit)}
        for rank in (0, 1):
            layers = torch.load(out / f"rank{rank}_4bit.pt")
            assert layers.keys() == single_layers.keys() and layers
            for name, layer in layers.items():
                reference = single_layers[name].weight
                assert torch.equal(layer["weight"].view(torch.uint8), reference.data.view(torch.uint8)), name
                assert torch.equal(layer["absmax"], reference.quant_state.absmax), name
                assert torch.equal(layer["code"], reference.quant_state.code), name
                assert layer["shape"] == tuple(reference.quant_state.shape), name

    # The final save is a plain adapter: one process reloads it to the sharded model's logits.
    reloaded = PeftModel.from_pretrained(base_model(base_args), out, autocast_adapter_dtype=not quantized).eval()
    with torch.no_grad():
        logits = reloaded(**tokenizer([PROBE], return_tensors="pt")).logits.float()
    # 4-bit: the bf16 head rounds hidden states that differ in the last fp32 bits: one bf16 step at most
    atol = 2 ** -7 * logits.abs().max().item() if quantized else 1e-5
    torch.testing.assert_close(logits, torch.load(out / "sharded_logits.pt"), rtol=0, atol=atol)

    # What each rank held while loading and saving, against the plan
    summary = json.loads((out / "run_summary.json").read_text())
    assert_phases_as_planned(summary["results"]["memory_by_rank"], wide_model_dir, quantized, engine, fsdp_version)

    if checkpoint:  # the intermediate FSDP checkpoint (DCP shards) becomes the adapter the final save wrote
        from export import consolidate

        checkpoint = out / "checkpoint-3"
        assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
        assert not (checkpoint / "adapter_model.safetensors").exists()  # sharded: not loadable as it is
        consolidated = load_file(consolidate(checkpoint) / "adapter_model.safetensors")
        assert consolidated.keys() == sharded_adapter.keys()
        for name in sharded_adapter:
            assert torch.equal(consolidated[name], sharded_adapter[name])


def load_growth(phases: dict) -> float:
    """The peak of reading, wrapping and sharding, above what the process held before it read the model."""
    return max(phases[p]["host_peak_gib"] for p in ("read", "wrap", "shard")) - phases["read"]["host_start_gib"]


def assert_phases_as_planned(by_rank: list[dict], model_dir, quantized: bool, engine: str, fsdp_version: int) -> None:
    """Rank 1 read nothing of the base, the save gathered the adapter alone, and both ranks' load and save peaks are
    within 15% of the plan (or 50 MiB: this 0.1 GiB model carries about 40 MiB of fixed costs that the plan leaves to
    larger models, where tests/test_memory_at_scale.py holds each phase to 10%)."""
    # As configuration.planned_run describes these runs: fp32 LoRA, or 4-bit with the rest in the bf16 storage dtype
    run = Run(method="qlora" if quantized else "lora", engine=engine, gpus=2, device="cpu",
              load_dtype="bfloat16" if quantized else "float32", checkpoint_dtype="float32", batch=1, seq=512,
              lora_r=16, nested_quant=False, optimizer="sgd", fsdp_version=fsdp_version, weights_from_rank0=True)
    shapes = Shapes.of(load_config(str(model_dir)))
    planned = plan(shapes, run)
    model_gib = plan(shapes, replace(run, engine="none", gpus=1)).host["weights (frozen)"]  # the base, loaded
    rank0, rank1 = by_rank
    assert rank1["read"]["host_growth_gib"] < 0.25 * model_gib, (rank1, model_gib)  # never materializes the base
    measured = {"load host rank 0": load_growth(rank0), "load host other rank": load_growth(rank1),
                "save host rank 0": rank0["save"]["host_growth_gib"]}
    predicted = {"load host rank 0": planned.phases["load"]["host rank 0"],
                 "load host other rank": planned.phases["load"]["host other rank"],
                 "save host rank 0": planned.phases["save"]["host rank 0"]}
    print(engine, fsdp_version, "qlora" if quantized else "lora",
          {key: (round(predicted[key], 3), round(measured[key], 3)) for key in measured},
          "rank 1 read", round(rank1["read"]["host_growth_gib"], 4), "of", round(model_gib, 3))
    assert predicted["save host rank 0"] < 0.1 * model_gib, predicted  # the adapter alone, not the base
    for key in measured:
        assert abs(measured[key] - predicted[key]) <= max(0.15 * predicted[key], 50 / 1024), (key, measured, predicted)


FSDP1_BUFFERS = r"""
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import LlamaConfig, LlamaForCausalLM
from recipe.engines.trainers import keep_fsdp1_buffers_in_fp32
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
seen = {{}}
for kept in (False, True):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    plugin.set_mixed_precision("bf16")  # what accelerate does for a bf16 run
    if kept:
        keep_fsdp1_buffers_in_fp32(plugin)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, vocab_size=128))
    rotary = model.model.rotary_emb
    rotary.register_forward_pre_hook(lambda m, a, kept=kept: seen.update({{kept: str(m.inv_freq.dtype)}}))
    wrapped = FSDP(model, mixed_precision=plugin.mixed_precision_policy, device_id=torch.device("cpu"))
    wrapped(input_ids=torch.ones(1, 3, dtype=torch.long))
print(json.dumps(seen))
"""


def test_fsdp1_bf16_keeps_the_rotary_frequencies_in_fp32():
    """accelerate's bf16 policy makes FSDP1 cast every buffer to bf16 before the forward, the rotary embedding's
    inverse frequencies too (`false` below: if this stops, the recipe's fix is no longer needed); with the recipe's
    policy (trainers.keep_fsdp1_buffers_in_fp32) the rotary embedding computes from fp32 frequencies."""
    import subprocess
    import sys

    from conftest import free_port

    script = FSDP1_BUFFERS.format(repo=str(REPO_DIR), port=free_port())
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"false": "torch.bfloat16", "true": "torch.float32"}

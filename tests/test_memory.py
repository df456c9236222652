"""Memory planner: counts from the meta model are exact; the arithmetic behaves; published points are near."""

import inspect
from dataclasses import replace

import pytest
import torch
from conftest import REPO, settled

from recipe.settings import checks
from recipe.planning.memory import ALLOCATOR_HEADROOM, GIB, Run, Shapes, load_config, plan


def test_counts_match_the_real_model_and_peft(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shapes = Shapes.of(load_config(str(tiny_model_dir)))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert shapes.total == sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shapes.lora_per_rank * 16 == trainable


def test_config_json_and_presets_load(tiny_model_dir):
    assert Shapes.of(load_config(str(tiny_model_dir / "config.json"))).num_layers == 2
    assert Shapes.of(load_config("llama-2-70b")).total == pytest.approx(68.98e9, rel=0.01)  # 70B: 69.0 B params


def gib(run: Run, model="llama-2-7b"):
    return plan(Shapes.of(load_config(model)), run)


def test_the_arithmetic_moves_the_right_way():
    base = Run(method="lora", engine="fsdp", gpus=8, batch=4, seq=2048)
    assert gib(base).per_gpu["weights (frozen)"] == pytest.approx(
        gib(Run(method="lora", engine="none", batch=4, seq=2048)).per_gpu["weights (frozen)"] / 8)
    assert gib(Run(**{**base.__dict__, "checkpointing": False})).per_gpu["activations"] > \
        3 * gib(base).per_gpu["activations"]
    qlora = gib(Run(**{**base.__dict__, "method": "qlora"}))
    assert qlora.per_gpu["weights (frozen)"] < 0.4 * gib(base).per_gpu["weights (frozen)"]
    offload = gib(Run(**{**base.__dict__, "offload": True}))
    assert offload.per_gpu["weights (frozen)"] == 0 and offload.host["weights (frozen)"] > 0
    full = gib(Run(**{**base.__dict__, "method": "full", "engine": "deepspeed"}))
    assert full.per_gpu["optimizer state"] > 10 * gib(base).per_gpu["optimizer state"]


@pytest.mark.parametrize("run, published_gib, tolerance", [
    # PEFT's published figures for Llama-2-70B (GB converted to GiB); the planner's reserved estimate must land near.
    (Run(method="lora", engine="fsdp", gpus=8, batch=8, seq=2048), 76 * 1e9 / GIB, 0.2),
    (Run(method="qlora", engine="fsdp", gpus=2, batch=2, seq=2048, offload=True), 19.6 * 1e9 / GIB, 0.35),
    (Run(method="qlora", engine="fsdp", gpus=2, batch=2, seq=2048), 35.6 * 1e9 / GIB, 0.2),
], ids=["lora-fsdp-8xH100", "qlora-fsdp-offload-2x24GB", "qlora-fsdp-no-offload"])
def test_published_reference_points(run, published_gib, tolerance):
    reserved = gib(run, "llama-2-70b").per_gpu_total * ALLOCATOR_HEADROOM
    assert reserved == pytest.approx(published_gib, rel=tolerance)


def test_preflight_warns_when_the_plan_does_not_fit(tiny_model_dir):
    from transformers import AutoConfig

    argv = ["--per_device_train_batch_size", "64", "--max_length", "4096", "--activation_checkpointing", "false"]
    facts = dict(cuda=True, here=False, model_config=AutoConfig.from_pretrained(tiny_model_dir))
    assert checks.memory_fit(settled(argv, gpu_gib=1, **facts)).level == "warning"
    assert checks.memory_fit(settled(argv, gpu_gib=4000, **facts)) is None


@pytest.mark.e2e
def test_command_prints_breakdown_assumptions_and_verdict(capsys):
    from recipe.planning.memory import main  # `python memory.py ARGS` is main(ARGS), in-process (no interpreter start)

    main(["--model", "llama-2-70b", "--method", "qlora", "--engine", "fsdp", "--gpus", "2", "--offload", "--batch", "2",
          "--seq", "2048", "--gpu_gib", "24"])
    printed = capsys.readouterr().out
    for expected in ("per GPU:", "activations", "host RAM:", "weights (frozen)", "assumptions:", "fits in 24 GiB"):
        assert expected in printed


def test_the_loss_tiles_are_trls():
    """The planner's loss follows TRL's tiling; this fails when TRL changes it (the plan must then follow)."""
    import trl
    import trl.trainer.utils as trl_utils
    from trl.kernels import chunked_logprob

    from recipe.planning.memory import LOSS_TILE_TOKENS, LOSS_TILE_VOCAB, TRL_LOSS_VERSION

    assert chunked_logprob.TOKEN_CHUNK_SIZE == LOSS_TILE_TOKENS
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == LOSS_TILE_VOCAB
    assert trl.__version__.startswith(TRL_LOSS_VERSION)
    # off CUDA the backward upcasts the tile and the head's chunk to fp32 (memory.LOSS_UPCAST_BYTES)
    assert "acc.addmm_(a.float(), b.float())" in inspect.getsource(chunked_logprob._addmm_fp32)


def test_fsdp2_units_are_accelerates():
    """The planner's FSDP2 gathers follow accelerate's units and torch's all-gather (memory.gathered_bytes); this fails
    when either changes (the plan must then follow)."""
    import accelerate
    from accelerate.utils import fsdp_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from recipe.planning.memory import FSDP2_UNITS_ACCELERATE

    assert accelerate.__version__.startswith(FSDP2_UNITS_ACCELERATE)
    prepare = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert "fully_shard(input_embed, **fsdp2_kwargs)" in prepare  # an untied embedding: a unit resharded after forward
    assert 'fully_shard(tail, **{**fsdp2_kwargs, "reshard_after_forward": False})' in prepare  # norm, head: kept
    # the parameters are copied out of the all-gather's output (two copies of a unit at once), not views of it
    assert "split_with_sizes_copy" in inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)


def test_fsdp2_loading_sends_a_tied_embedding_twice_and_holds_both_slices_until_it_ties_them_again():
    """accelerate's fsdp2_load_full_state_dict walks model.state_dict(), which names a tied embedding as the embedding
    and as the head: every rank receives it twice and keeps two slices until fsdp2_prepare_model ties the weights again
    (measured on 2 CPU processes: 0.12 GiB more on each rank of bench/memory_grid.py's 20-layer model). Fails when
    accelerate changes either step (the plan must then follow)."""
    from accelerate.utils import fsdp_utils

    assert "meta_sharded_sd = model.state_dict()" in inspect.getsource(fsdp_utils.fsdp2_load_full_state_dict)
    prepare = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert prepare.index("fsdp2_load_full_state_dict(") < prepare.rindex("model.tie_weights()")
    for name, gpus, device in (("gemma-2-9b", 8, "cuda"), ("gemma-2-9b", 2, "cpu"), ("Meta-Llama-3-8B", 2, "cpu")):
        shapes = Shapes.of(load_config(f"{REPO}/configs/models/{name}"))
        run = Run(method="lora", engine="fsdp", gpus=gpus, device=device, fsdp_version=2)
        loads = [plan(s, run).phases["load"] for s in (shapes, replace(shapes, tied_embedding=0))]
        slice_gib = shapes.tied_embedding * 2 / gpus / GIB  # bf16
        assert (shapes.tied_embedding > 0) is (name == "gemma-2-9b")
        places = ["gpu"] if device == "cuda" else ["host rank 0", "host other rank"]
        for place in places:
            assert loads[0][place] - loads[1][place] == pytest.approx(slice_gib)


def test_fsdp2_gathers_the_tail_at_the_loss_and_twice_for_a_moment():
    """Llama-3-8B (untied) and Gemma-2-9B (tied), LoRA on 8 GPUs: FSDP1 keeps its whole root unit (embedding, head)
    gathered; under FSDP2 the untied embedding is not gathered at the loss, while a tied vocabulary of 256k is the tail
    whose gather, twice over for a moment, outweighs a short loss."""
    def step(model, fsdp_version, seq):
        """What the step adds at its peak beyond what each GPU holds: gathered units, activations and the loss."""
        run = Run(method="lora", engine="fsdp", gpus=8, batch=1, seq=seq, fsdp_version=fsdp_version)
        per_gpu = gib(run, f"{REPO}/configs/models/{model}").per_gpu
        return per_gpu["gathered units"] + per_gpu["activations"] + per_gpu["loss (head tiles)"], per_gpu

    llama = Shapes.of(load_config(f"{REPO}/configs/models/Meta-Llama-3-8B"))
    embedding = llama.untied_embedding * 2 / GIB
    assert embedding == pytest.approx(128256 * 4096 * 2 / GIB)
    assert step("Meta-Llama-3-8B", 2, 2048)[0] == pytest.approx(step("Meta-Llama-3-8B", 1, 2048)[0] - embedding)
    gemma = Shapes.of(load_config(f"{REPO}/configs/models/gemma-2-9b"))
    assert gemma.untied_embedding == 0
    tail = gemma.unquantized * 2 / GIB
    peak, per_gpu = step("gemma-2-9b", 2, 64)
    assert peak == pytest.approx(2 * tail + per_gpu["activations"]) and peak > step("gemma-2-9b", 1, 64)[0]


def test_over_gloo_a_gathered_vocabulary_is_held_twice_where_nccl_gathers_in_place():
    """FSDP1's root unit and ZeRO-3's embedding and head as a step starts: held twice for a moment on CPU, where gloo
    gathers through a buffer of its own (the probe below measures it), once on CUDA; on CPU the moment comes before any
    activation, so a long step's loss can still be the peak."""
    llama = Shapes.of(load_config(f"{REPO}/configs/models/Meta-Llama-3-8B"))
    root = llama.unquantized * 2 / GIB  # embedding and head, bf16
    for engine, version in (("fsdp", 1), ("deepspeed", 2)):
        def step(device, seq=64):
            run = Run(method="qlora", engine=engine, fsdp_version=version, gpus=2, batch=1, seq=seq, device=device)
            planned = gib(run, f"{REPO}/configs/models/Meta-Llama-3-8B")
            terms = planned.per_gpu if device == "cuda" else planned.host
            return terms["gathered units"] + terms["activations"] + terms["loss (head tiles)"], terms

        assert step("cpu")[0] == pytest.approx(2 * root) and step("cuda")[0] < 1.5 * root, engine
        long_step, terms = step("cpu", seq=65536)  # its activations and loss outweigh the second copy
        assert long_step > 2 * root
        assert terms["gathered units"] == pytest.approx(step("cuda", 65536)[1]["gathered units"])


GLOO_GATHER_PROBE = r"""
import json, os, sys
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def hwm_gib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 2**20

def rank(r, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    shard = torch.randn(2**26, dtype=torch.bfloat16)  # 128 MiB; the whole output 256 MiB
    out = torch.zeros(2 * shard.numel(), dtype=torch.bfloat16)  # resident before the gather
    growth = {}
    for name, gather in (("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(out, shard)),
                         ("all_gather", lambda: dist.all_gather(list(out.chunk(2)), shard))):
        dist.barrier()
        open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here
        before = hwm_gib()
        gather()
        growth[name] = (hwm_gib() - before) / (out.numel() * 2 / 2**30)
    results[r] = growth
    dist.destroy_process_group()

if __name__ == "__main__":
    results = mp.Manager().dict()
    mp.start_processes(rank, args=(int(sys.argv[1]), results), nprocs=2, start_method="fork")
    print(json.dumps(dict(results)))
"""


@pytest.mark.multiprocess
def test_gloo_gathers_through_a_buffer_of_the_whole_output():
    """What the planner's CPU gathers stand on (memory.gathered_bytes): gloo's all-gather, into one tensor (ZeRO-3) or
    into chunks (FSDP1), fills a buffer of the whole output and copies it out, so the output is held twice for a moment.
    If torch's gloo gathers in place one day, this fails and the plan's CPU terms should follow."""
    import json
    import subprocess
    import sys

    from conftest import free_port

    result = subprocess.run([sys.executable, "-c", GLOO_GATHER_PROBE, str(free_port())], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for growth in json.loads(result.stdout.strip().splitlines()[-1]).values():
        assert growth["all_gather_into_tensor"] > 0.9 and growth["all_gather"] > 0.9, growth  # measured: 1.0


# Runs in a process of its own with glibc's mmap threshold fixed from its start: in a process that has freed large
# blocks into its heaps (the test session), glibc serves the tiles from them and RSS does not grow.
LOSS_TILE_PROBE = r"""
import json, sys
sys.path.insert(0, {repo!r})
import torch
from trl.kernels import ChunkedLogProbFunction
from recipe.planning.run_memory import GIB, PhasePeaks

def peak_bytes_per_element(softcap):
    hidden = torch.randn(1024, 64, requires_grad=True)
    weight, targets = torch.randn(8192, 64), torch.randint(0, 8192, (1024,))
    peaks = PhasePeaks()
    peaks.start("loss")
    log_probs = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 4096, softcap, 1.0,
                                             ("log_probs", "entropy", "is_top1"))[0]
    (-log_probs.sum()).backward()
    peaks.end()
    # the kernel's high-water mark: each freed tile is unmapped at once, and the kernel records the peak first
    return peaks.phases["loss"]["rss_hwm_growth_gib"] * GIB / (1024 * 4096)

peak_bytes_per_element(None)  # the first call also sets up the kernels' own buffers
print(json.dumps({{"plain": peak_bytes_per_element(None), "softcapped": peak_bytes_per_element(30.0)}}))
"""


@pytest.mark.e2e
def test_the_loss_backward_holds_what_the_plan_counts_per_tile_element():
    """TRL's chunked log-probabilities on CPU, forward and backward over 1024 x 4096 tiles, the peak from /proc: the
    bytes held per tile element at the peak are the planner's (the fp32 buffer and the backward's torch temporaries)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    from recipe.planning.memory import LOSS_TILE_SOFTCAP_BYTES, LOSS_TILE_TORCH_BYTES
    from recipe.planning.run_memory import MMAP_THRESHOLD_BYTES

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}
    result = subprocess.run([sys.executable, "-c", LOSS_TILE_PROBE.format(repo=str(REPO))], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["plain"] == pytest.approx(4 + LOSS_TILE_TORCH_BYTES, rel=0.1)
    assert measured["softcapped"] == pytest.approx(4 + LOSS_TILE_TORCH_BYTES + LOSS_TILE_SOFTCAP_BYTES, rel=0.1)


def test_eager_attention_adds_each_examples_scores_once_per_layer_or_once_with_checkpointing():
    """eager_varlen (Gemma-2, gpt-oss) keeps each example's seq x seq scores per head (what it keeps per score:
    test_each_layer_keeps_what_the_plan_counts), in every layer, or in the one recomputed with checkpointing."""
    from recipe.planning.memory import eager_score_bytes

    shapes = Shapes.of(load_config("llama-2-7b"))
    for checkpointing, layers in ((True, 1), (False, shapes.num_layers)):
        run = Run(batch=2, seq=1024, checkpointing=checkpointing)
        added = plan(shapes, replace(run, eager_attention=True)).per_gpu["activations"] - plan(shapes, run).per_gpu[
            "activations"]
        assert added * GIB == pytest.approx(2 * shapes.heads * 1024 ** 2 * eager_score_bytes(shapes, run) * layers)


LAYER_PROBES = {  # small models whose layers the saved tensors are counted on: dense, and experts (2 of 4 routed)
    "llama": ("LlamaConfig", dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=4,
                                  vocab_size=256)),
    "mixtral": ("MixtralConfig", dict(hidden_size=128, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=256, num_local_experts=4,
                                      num_experts_per_tok=2)),
    # eager attention per example (softcapped scores), four norms per layer, queries wider than hidden
    "gemma2": ("Gemma2Config", dict(hidden_size=128, intermediate_size=352, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=48, vocab_size=256, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=48)),
    # eager attention with sinks, experts (2 of 4 routed)
    "gpt_oss": ("GptOssConfig", dict(hidden_size=128, intermediate_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, vocab_size=256, num_local_experts=4,
                                     num_experts_per_tok=2)),
}


def probe_config(family: str, layers: int):
    import transformers

    config_class, shape = LAYER_PROBES[family]
    return getattr(transformers, config_class)(**shape, num_hidden_layers=layers)


def saved_bytes_of_layers(family: str, layers: int, method: str, precision: str, dropout: float,
                          examples: int) -> int:
    """Bytes of the tensors one forward keeps for its backward (autograd's saved tensors, parameters left out), on a
    small model of `family` with `layers` decoder layers and LoRA on every linear (or none: full), under autocast in
    bf16 as the Trainer runs it, over a packed row of examples of 640 tokens (the recipe's attention for the family,
    past its fp32 range on CPU)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from recipe.model.fast_paths import CPU_FP32_ATTENTION_UP_TO, attention_for, register_attention
    from recipe.model.moe import fused_experts, split_experts

    length = CPU_FP32_ATTENTION_UP_TO + 128
    config = probe_config(family, layers)
    config._attn_implementation = register_attention(attention_for(config)[0])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    if fused_experts(model):  # as the recipe loads a mixture of experts: one linear module per expert
        split_experts(model)
    if method == "full":
        model.train()
    else:
        model = get_peft_model(model, LoraConfig(r=4, lora_dropout=dropout, target_modules="all-linear"))
        if method == "qlora":  # TRL casts a quantized model's adapters to bf16; the 4-bit base keeps no input either
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.data = parameter.data.to(torch.bfloat16)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 256, (1, examples * length))
    starts = torch.arange(examples + 1, dtype=torch.int32) * length
    packed = dict(position_ids=torch.arange(length).repeat(examples)[None], cu_seq_lens_q=starts, cu_seq_lens_k=starts,
                  max_length_q=length, max_length_k=length)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, **packed).loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("family, method, precision, dropout", [
    ("llama", "lora", "bf16", 0.0),  # fp32 adapters under bf16 autocast: each branch keeps autocast's bf16 input copy
    ("llama", "lora", "bf16", 0.05),  # and dropout's mask
    ("llama", "qlora", "bf16", 0.0),  # bf16 adapters read the tensor the base reads: each input once
    ("llama", "lora", "fp32", 0.0),
    ("llama", "lora", "fp32", 0.05),  # dropout's output and mask
    ("llama", "full", "bf16", 0.0),
    ("mixtral", "qlora", "bf16", 0.0),  # each routed expert's input and output
    ("gemma2", "lora", "bf16", 0.0),  # and each example's scores: softmax, its cast, softcapping's tanh
    ("gemma2", "lora", "fp32", 0.0),
    ("gpt_oss", "qlora", "bf16", 0.0),
])
def test_each_layer_keeps_what_the_plan_counts(family, method, precision, dropout):
    """What one decoder layer keeps for the backward (a model of two layers less one of one layer: the embedding, the
    head and the loss cancel out) against memory.layer_activation_bytes and eager_score_bytes, within 5% (the router's
    few values per token are not counted). The old count (10 x hidden + 2 x kv + 5 x intermediate values, plus each
    branch's input again in the adapter's dtype) was up to 1.7 times this."""
    from recipe.model.fast_paths import CPU_FP32_ATTENTION_UP_TO, EAGER_ATTENTION, attention_for
    from recipe.planning.memory import eager_score_bytes, layer_activation_bytes

    examples, length = 2, CPU_FP32_ATTENTION_UP_TO + 128
    tokens = examples * length
    measured = (saved_bytes_of_layers(family, 2, method, precision, dropout, examples) -
                saved_bytes_of_layers(family, 1, method, precision, dropout, examples))
    shapes = Shapes.of(probe_config(family, 1))
    run = Run(method=method, load_dtype={"bf16": "bfloat16", "fp32": "float32"}[precision], lora_dropout=dropout,
              device="cpu")
    planned = tokens * layer_activation_bytes(shapes, run)
    if attention_for(probe_config(family, 1))[0] == EAGER_ATTENTION:
        planned += examples * shapes.heads * length ** 2 * eager_score_bytes(shapes, run)
    assert measured == pytest.approx(planned, rel=0.05)

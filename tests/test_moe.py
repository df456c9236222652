"""Mixtures of experts (moe.py): tiny random Mixtral, Qwen3-MoE and gpt-oss models. The split experts compute what
the fused ones compute, their 4-bit form is bitsandbytes NF4 as the attention's is, LoRA adapts every expert and not
the router, the adapter loads onto the stock transformers model, and each family trains with train.py."""

import copy
import json

import pytest
import torch
import transformers
from conftest import losses, tiny_run_args
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from recipe.model import moe
from recipe.model.model_files import REPO_DIR

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512)
FAMILIES = {  # each routes 2 of its experts per token
    "mixtral": lambda **ids: transformers.MixtralConfig(**COMMON, **ids, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda **ids: transformers.Qwen3MoeConfig(**COMMON, **ids, moe_intermediate_size=64, num_experts=8,
                                                           num_experts_per_tok=2),
    "gpt_oss": lambda **ids: transformers.GptOssConfig(**{**COMMON, "intermediate_size": 64}, **ids,
                                                       num_local_experts=4, num_experts_per_tok=2),
}
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                "gpt_oss": ("gate_proj", "up_proj", "down_proj")}
EXPERTS = {"mixtral": 4, "qwen3_moe": 8, "gpt_oss": 4}
FOUR_BIT = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                              bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=torch.bfloat16)


def tiny_moe(family: str, vocab_size: int = 300, dtype=torch.float32, **ids):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](vocab_size=vocab_size, **ids), dtype=dtype)
    with torch.no_grad():  # the experts and biases start at zero or tiny: give them a trained model's scale
        for name, parameter in model.named_parameters():
            if parameter.dim() == 3 or name.endswith("bias"):
                parameter.normal_(std=0.05)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # decisive, as a trained router is
                parameter.normal_(std=1.0)
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_experts_compute_what_the_fused_experts_compute(family):
    fused = tiny_moe(family)
    split = copy.deepcopy(fused)
    counts = moe.split_experts(split)
    assert counts == {name: 2 * EXPERTS[family] for name in EXPERT_NAMES[family]}  # 2 layers
    assert not moe.fused_experts(split) and isinstance(split.model.layers[0].mlp.experts, moe.ExpertLinears)
    ids = torch.randint(0, 300, (2, 16))
    want, got = fused(ids).logits, split(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    for layer in range(2):
        fused_grad = fused.model.layers[layer].mlp.experts.down_proj.grad
        split_grads = [getattr(expert, EXPERT_NAMES[family][2]).weight.grad for expert in
                       split.model.layers[layer].mlp.experts]
        if family == "gpt_oss":  # x @ W: the linear weight is the transpose
            split_grads = [g.t() if g is not None else None for g in split_grads]
        for e, grad in enumerate(split_grads):  # an expert no token reached has no gradient in either
            torch.testing.assert_close(grad if grad is not None else torch.zeros_like(fused_grad[e]), fused_grad[e],
                                       rtol=1e-4, atol=1e-4)  # float32 sums in another order


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_4bit_experts_are_nf4_like_the_attention(family, tmp_path):
    """Under QLoRA each expert matrix is a bitsandbytes Linear4bit (NF4, nested constants, bf16 storage: what FSDP and
    ZeRO-3 shard), computing exactly what its dequantized weight computes, as far from the 16-bit expert as the
    attention's 4-bit projections are from theirs."""
    import bitsandbytes as bnb

    original = tiny_moe(family, dtype=torch.bfloat16)
    original.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=FOUR_BIT, dtype=torch.bfloat16)
    moe.split_experts(model, FOUR_BIT)
    layer, reference = model.model.layers[0], original.model.layers[0]

    def relative_error(module: torch.nn.Module, weight: torch.Tensor, bias=None) -> float:
        x = torch.randn(32, weight.shape[1], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
        want = torch.nn.functional.linear(x, weight, bias).float()
        return ((module(x).float() - want).norm() / want.norm()).item()

    expert = layer.mlp.experts[1]
    gate = getattr(expert, EXPERT_NAMES[family][0])
    assert isinstance(gate, bnb.nn.Linear4bit) and isinstance(gate.weight, bnb.nn.Params4bit)
    assert gate.weight.dtype == torch.bfloat16 and gate.weight.quant_state.nested and gate.weight.quant_type == "nf4"
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    dequantized = bnb.functional.dequantize_4bit(gate.weight.data, gate.weight.quant_state)
    out = gate(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, dequantized, gate.bias), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.float().square().sum(), x)  # backward: through the same dequantized weight
    want = torch.autograd.grad(torch.nn.functional.linear(x, dequantized, gate.bias).float().square().sum(), x)[0]
    torch.testing.assert_close(grad, want, rtol=0, atol=0)

    fused = reference.mlp.experts
    if family == "gpt_oss":
        w16, b16 = fused.gate_up_proj[1].t()[0::2], fused.gate_up_proj_bias[1][0::2]
    else:
        w16, b16 = fused.gate_up_proj[1, :128], None
    expert_error = relative_error(gate, w16, b16)
    attention_error = relative_error(layer.self_attn.q_proj, reference.self_attn.q_proj.weight,
                                     reference.self_attn.q_proj.bias)
    assert isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit)
    assert 0 < expert_error < 2 * attention_error, (expert_error, attention_error)


def test_an_expert_no_token_reached_still_gets_a_gradient_for_each_trainable_parameter():
    """FSDP reduce-scatters the gradients a unit's parameters have: a rank whose tokens never reached an expert would
    send fewer than the others, and the collectives would no longer match."""
    from peft import LoraConfig, get_peft_model

    model = tiny_moe("mixtral")
    moe.split_experts(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    experts = next(m for m in model.modules() if isinstance(m, moe.ExpertLinears))
    hidden = torch.randn(5, 64)
    top_k_index = torch.tensor([[0, 1]] * 5)  # experts 2 and 3 reached by no token
    experts(hidden, top_k_index, torch.full((5, 2), 0.5)).square().sum().backward()
    grads = {name: p.grad for name, p in experts.named_parameters() if p.requires_grad}
    assert grads and all(grad is not None for grad in grads.values())
    assert all(grads[name].abs().sum() == 0 for name in grads if name.startswith(("2.", "3.")))
    assert any(grads[name].abs().sum() > 0 for name in grads if name.startswith("0.") and "lora_B" in name)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_each_layers_experts_are_split_and_quantized_as_they_load(family, layout, tmp_path, monkeypatch):
    """A checkpoint stored per expert (transformers 4, what save_pretrained writes for Mixtral) or fused (transformers
    5) loads with each layer's experts split into 4-bit linears as soon as they are read
    (compat.TRANSFORMERS_SPLITS_EXPERTS_AS_LOADED): no other layer's experts are in 16 bits at that moment, and the
    model is the one a load followed by moe.split_experts builds, to the bit."""
    from safetensors.torch import save_file

    from recipe import compat
    from recipe.model.model_files import load_causal_lm

    original = tiny_moe(family, dtype=torch.bfloat16)
    original.save_pretrained(tmp_path)
    if layout == "fused":
        for old in tmp_path.glob("*.safetensors"):
            old.unlink()
        save_file({k: v.contiguous() for k, v in original.state_dict().items()}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
    splits, split_as_loaded = [], moe.split_as_loaded

    def recorded(model, name, config=None):
        done = split_as_loaded(model, name, config)
        if done:  # every other layer is still on the meta device or already split
            splits.append([n for n, m in moe.fused_experts(model) if m.gate_up_proj.device.type != "meta"])
        return done

    with compat.splitting_experts_as_loaded(recorded):
        model = load_causal_lm(str(tmp_path), quantization_config=FOUR_BIT, dtype=torch.bfloat16)
    assert splits == [[]] * original.config.num_hidden_layers and not moe.fused_experts(model)
    reference = load_causal_lm(str(tmp_path), quantization_config=FOUR_BIT, dtype=torch.bfloat16)
    moe.split_experts(reference, FOUR_BIT)
    for built in (model, reference):  # as utils.build_model: the trainable 4-bit layout
        compat.keep_4bit_layers_trainable(built)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_adapts_every_expert_not_the_router_and_the_adapter_loads_onto_the_stock_model(family, tmp_path):
    """all-linear reaches each expert's three matrices and no router; Mixtral's and Qwen3-MoE's adapter (named as
    their transformers 4 checkpoints named the experts) loads onto the stock, fused transformers 5 model through
    PEFT's own conversion, to the same logits. gpt-oss was fused from its first release: its adapter loads onto a model
    split the same way."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from train import adapted_matrices

    tiny_moe(family).save_pretrained(tmp_path / "base")
    split = tiny_moe(family)
    moe.split_experts(split)
    model = get_peft_model(split, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    counts = adapted_matrices(model)
    assert counts == {**{name: 2 for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
                      **{name: 2 * EXPERTS[family] for name in EXPERT_NAMES[family]}}, counts
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path / "adapter")

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    if family == "gpt_oss":
        moe.split_experts(base)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    if family != "gpt_oss":
        assert moe.fused_experts(loaded)  # the stock model, its experts adapted through target_parameters
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)


def test_router_is_adapted_only_when_asked():
    from peft import get_peft_model

    from recipe.settings.arguments import ModelArguments
    from train import adapted_matrices
    from utils import build_peft_config

    split = tiny_moe("mixtral")
    moe.split_experts(split)
    config = build_peft_config(ModelArguments(lora_router=True), [], split)
    assert config.target_parameters == ["mlp.gate.weight"]
    assert adapted_matrices(get_peft_model(split, config))["gate.weight"] == 2


def test_a_fused_layout_the_recipe_cannot_split_is_refused_with_the_fix():
    model = tiny_moe("mixtral")
    experts = model.model.layers[0].mlp.experts
    # a layout it does not know
    experts.register_parameter("gate_up_proj_bias", torch.nn.Parameter(torch.zeros(4, 256)))
    with pytest.raises(ValueError, match="lora_target_modules q_proj,k_proj,v_proj,o_proj"):
        moe.split_experts(model)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, smol_tokenizer):
    """Each family with SmolLM2's vocabulary and tokenizer, saved as a checkpoint."""
    dirs = {}
    for family in FAMILIES:
        out = tmp_path_factory.mktemp(family)
        model = tiny_moe(family, vocab_size=len(smol_tokenizer), bos_token_id=smol_tokenizer.bos_token_id,
                         eos_token_id=smol_tokenizer.eos_token_id, pad_token_id=smol_tokenizer.pad_token_id)
        model.save_pretrained(out)
        smol_tokenizer.save_pretrained(out)
        dirs[family] = out
    return dirs


@pytest.mark.e2e
@pytest.mark.parametrize("family, method", [("mixtral", "qlora"), ("qwen3_moe", "lora"), ("gpt_oss", "qlora")])
def test_each_family_trains_in_one_process(family, method, moe_dirs, chat_dir, tmp_path, capsys):
    import train

    out = tmp_path / "out"
    extra = ["--use_4bit_quantization", "true", "--use_nested_quant", "true"] if method == "qlora" else []
    train.run(tiny_run_args(moe_dirs[family], chat_dir, out, "--max_steps", "3", *extra))
    printed = capsys.readouterr().out
    assert "LoRA adapts: " in printed and f"{EXPERT_NAMES[family][0]} x {2 * EXPERTS[family]}" in printed
    assert "router = not adapted" in printed and "load-balancing loss = coefficient" in printed
    summary = json.loads((out / "run_summary.json").read_text())
    logged = losses(summary["log_history"])
    assert len(logged) == 3 and all(loss == loss for loss in logged)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert set(EXPERT_NAMES[family]) <= set(adapter["target_modules"])
    assert any("aux_loss" in entry for entry in summary["log_history"])  # TRL adds and logs the router's loss


# engine x method, the families spread over them; ZeRO-3 QLoRA on 32 experts routing 1 each: with about a hundred
# tokens per rank and step, some expert one rank routes to is never reached by the other (asserted), which without the
# experts as one ZeRO-3 leaf would leave a rank waiting in an all-gather. (Each rank reached 21-25 of the 32 in each
# forward of each layer, 1-6 of them not the other's; with 16, one layer's ranks reached all 16 alike. 64 took 50%
# more CPU than 32.)
SHARDED = {
    "fsdp2-lora-mixtral": ("fsdp2_config.yaml", "mixtral", False),
    "fsdp2-qlora-qwen3_moe": ("fsdp2_config.yaml", "qwen3_moe", True),
    "fsdp1-lora-qwen3_moe": ("fsdp_config.yaml", "qwen3_moe", False),
    "fsdp1-qlora-mixtral": ("fsdp_config_qlora.yaml", "mixtral", True),
    "zero3-lora-gpt_oss": ("deepspeed_config.yaml", "gpt_oss", False),
    "zero3-qlora-mixtral32": ("deepspeed_config_z3_qlora.yaml", "mixtral32", True),
    "fsdp2-lora-mixtral32": ("fsdp2_config.yaml", "mixtral32", False),  # FSDP: reduce-scatters each unit's gradients
}


@pytest.fixture(scope="module")
def mixtral32_dir(tmp_path_factory, smol_tokenizer):
    out = tmp_path_factory.mktemp("mixtral32")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**COMMON, vocab_size=len(smol_tokenizer), num_local_experts=32,
                                        num_experts_per_tok=1, bos_token_id=smol_tokenizer.bos_token_id,
                                        eos_token_id=smol_tokenizer.eos_token_id,
                                        pad_token_id=smol_tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 3:
                parameter.normal_(std=0.05)
            elif name.endswith("mlp.gate.weight"):  # a decisive router: rounding noise never flips a token's expert
                parameter.normal_(std=1.0)
    model.save_pretrained(out)
    smol_tokenizer.save_pretrained(out)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(SHARDED))
def test_two_processes_equal_one_process(case, moe_dirs, mixtral32_dir, chat_dir, tmp_path):
    """Each engine x method pair on 2 CPU processes through its shipped accelerate config: the same losses as one
    process on the same global batch, the decoder layers (experts included) sharded, and every rank holding one
    process's 4-bit expert payloads bit for bit."""
    from conftest import base_model, launch_two_processes
    from test_distributed import WORKER, recipe_args

    import train

    config, family, quantized = SHARDED[case]
    model_dir = mixtral32_dir if family == "mixtral32" else moe_dirs[family]
    out = tmp_path / "two"
    # The load-balancing loss is a product of per-batch means: each rank computes it over its own tokens (as every
    # data-parallel MoE trainer does), which no single process reproduces; off here, on in the one-process runs above.
    # A tenth of the dense tests' learning rate: at 0.5, bf16 rounding in step 2 moved tokens to other experts by step
    # 3 (grad norms 2-30% apart, measured), which says nothing about the engines
    args = ["--router_aux_loss_coef", "0", "--learning_rate", "0.05"]
    launch_two_processes(WORKER, [*recipe_args(model_dir, chat_dir, out, 2, quantized), *args],
                         REPO_DIR / "configs" / config)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    engine = "DEEPSPEED" if "deepspeed" in config else "FSDP"
    for report in ranks:
        assert report["distributed_type"] == f"DistributedType.{engine}" and report["world_size"] == 2
        if engine == "FSDP":
            assert report["layers_are_fsdp"] == [True, True]
        params = list(report["params"].items())
        if case.startswith("fsdp1"):  # its flat parameters (bitsandbytes registers each 4-bit weight's view again in
            # its forward: a parameter of the whole shape, over the storage FSDP1 frees after the forward)
            params = [(name, p) for name, p in params if "holds" in p]
        experts = [p for name, p in params if not p["trainable"] and any(
            ".experts." in held for held in p.get("holds", [name]))]
        assert experts and all(p["local_numel"] < p["numel"] for p in experts)  # every expert matrix sharded
    assert ranks[0]["adapter_saved_keys_match"] and ranks[0]["adapter_saved_max_abs_difference"] == 0.0  # as trained

    trainer, _ = train.run([*recipe_args(model_dir, chat_dir, tmp_path / "one", 4, quantized), *args])
    # 4-bit: the two runs reduce gradients in another order over bf16-stored weights; fp32: rounding only. The grad
    # norm of a 4-bit run on one process is bf16 (TRL keeps a quantized model's adapter in bf16: each of its 400
    # tensors' norms is rounded to 8 bits before they are combined), DeepSpeed's is fp32: 1.6% apart in step 3 on an
    # AVX2 CPU, within 1% on an AVX512-BF16 one (measured with 64 experts, 784 tensors)
    two = torch.tensor(losses(ranks[0]["log_history"], with_grad_norm=True))
    one = torch.tensor(losses(trainer.state.log_history, with_grad_norm=True))
    torch.testing.assert_close(two[:, 0], one[:, 0], rtol=1e-2 if quantized else 1e-5, atol=0)
    torch.testing.assert_close(two[:, 1], one[:, 1], rtol=3e-2 if quantized else 1e-5, atol=0)

    if family == "mixtral32":  # a forward in which one rank reached an expert the other never did (each expert's
        # trainable parameters still got a zero gradient there: moe.ExpertLinears)
        reached = [report["experts_reached"] for report in ranks]
        assert any(set(mine) != set(theirs) for layer in reached[0]
                   for mine, theirs in zip(reached[0][layer], reached[1][layer])), reached
    if quantized:
        single = {name: module for name, module in base_model(recipe_args(model_dir, chat_dir, tmp_path / "x", 4,
                                                                          True)).named_modules()
                  if ".experts." in name and hasattr(module, "quant_state")}
        for rank in (0, 1):
            layers = {name: layer for name, layer in torch.load(out / f"rank{rank}_4bit.pt").items()
                      if ".experts." in name}
            assert layers.keys() == single.keys() and layers
            for name, layer in layers.items():
                assert torch.equal(layer["weight"].view(torch.uint8), single[name].weight.data.view(torch.uint8))
                assert torch.equal(layer["absmax"], single[name].quant_state.absmax), name


def test_planner_counts_every_expert_for_memory_and_the_routed_ones_for_activations():
    from recipe.planning.memory import Shapes, load_config

    shapes = Shapes.of(load_config(str(REPO_DIR / "configs" / "models" / "Mixtral-8x7B-v0.1")))
    assert (shapes.experts, shapes.experts_per_token) == (8, 2)
    assert shapes.expert_linear == 32 * 8 * 3 * 4096 * 14336  # every expert: 4-bit, adapted
    assert shapes.linear == shapes.expert_linear + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)  # and the attention
    assert len(shapes.layer_linears) == 4 + 2 * 3 and shapes.intermediate == 2 * 14336  # a token meets 2 experts
    assert shapes.active_linear == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336)  # FLOPs: 12.6 G


def test_a_4bit_mixture_on_one_gpu_loads_on_the_host_and_moves_after_the_split():
    """bitsandbytes quantizes linear layers only while placing them: the fused experts would reach the GPU in 16 bits
    (gpt-oss-20b: 36 GiB), so the run loads on the host, splits and quantizes there, then moves."""
    from conftest import settled

    from recipe.platform.launch import Launch
    from recipe.planning.memory import load_config

    config = settled(["--model_name_or_path", "openai/gpt-oss-20b", "--use_4bit_quantization", "true"], cuda=True,
                     here=True, gpu_gib=24, launch=Launch({}, 1),
                     model_config=load_config(str(REPO_DIR / "configs" / "models" / "Qwen3-30B-A3B")))
    assert config.device_map == {"": "cpu"} and config.place_on == "cuda:0"


@pytest.mark.parametrize("model", ["Mixtral-8x7B-v0.1", "Qwen3-30B-A3B"])
def test_moe_qlora_on_two_24gb_gpus_plans_under_20_gib_per_gpu(model):
    """The shipped 2 x 24 GB QLoRA config, as the README's verdict table plans it."""
    from recipe.planning.memory import ALLOCATOR_HEADROOM

    from recipe.settings.checks import preflight
    from recipe.settings.configuration import configure, memory_plan

    config = configure(["--model_name_or_path", str(REPO_DIR / "configs" / "models" / model), "--check",
                        "--accelerate_config", "configs/fsdp2_config_qlora.yaml", "--gpu_gib", "24",
                        "--use_4bit_quantization", "true", "--max_length", "2048",
                        "--per_device_train_batch_size", "2", "--eval_num_prompts", "0"])
    assert memory_plan(config).per_gpu_total * ALLOCATOR_HEADROOM < 20
    assert not [problem for problem in preflight(config) if problem.level == "error" and "memory" in problem.what]


def test_an_mxfp4_checkpoint_is_refused_with_the_fix():
    from conftest import settled

    from recipe.settings.checks import mxfp4_checkpoint
    from recipe.planning.memory import load_config

    config = settled(["--model_name_or_path", "openai/gpt-oss-20b"],
                     model_config=load_config(str(REPO_DIR / "configs" / "models" / "gpt-oss-20b")))
    problem = mxfp4_checkpoint(config)
    assert problem.level == "error" and "MXFP4" in problem.what
    assert "Mxfp4Config(dequantize=True)" in problem.fix and "gpt-oss-20b-BF16" in problem.fix

"""Every model family the recipe claims, as tiny random models: the recipe's attention on packed rows equals each
example run alone through the family's own eager attention (sliding windows, Gemma-2's logit softcapping, gpt-oss's
sinks included), in logits and gradients, and generation after a training step equals eager's; with the example
lengths kept on the host, a step reads nothing back from the device. FlexAttention's path is compared in its forward
(torch has no FlexAttention backward on CPU); the varlen kernel runs on CUDA only (bench/gpu_check.py)."""

import pickle
import traceback

import pytest
import torch
import transformers
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from recipe.model.fast_paths import (EXAMPLE_LENGTHS, FLEX_ATTENTION, KERNEL_ATTENTION, WithExampleLengths,
                                     attention_for, packed_rows, register_attention, sdpa_varlen_forward)
from recipe.model.model_files import REPO_DIR

WINDOW = 8  # shorter than the examples below, so a window that is ignored changes the numbers
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1),  # layer 0 full, layer 1 sliding
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=1),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                                final_logit_softcapping=30.0),  # 2.0: the cap bites at this scale
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, sliding_window=WINDOW, sliding_window_pattern=2),
    "phi3": lambda: transformers.Phi3Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                                            sliding_window=WINDOW),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, sliding_window=WINDOW, num_local_experts=4,
                                                 num_experts_per_tok=2),
}
LENGTHS = [21, 14, 9]


def tiny_model(family: str):
    config = FAMILIES[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # random weights of a trained model's scale: attention far from uniform
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


def token_log_likelihood(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token log-likelihood of one example (a sum, so packed and separate runs compare exactly)."""
    return logits[:-1].log_softmax(-1).gather(-1, ids[1:, None]).sum()


def packed_batch(examples: list[torch.Tensor]) -> dict:
    """One padding-free row, as TRL's collator gives it: positions restart per example, boundaries in cu_seq_lens."""
    bounds = torch.tensor([0, *torch.tensor([len(x) for x in examples]).cumsum(0).tolist()], dtype=torch.int32)
    longest = max(len(x) for x in examples)
    positions = torch.cat([torch.arange(len(x)) for x in examples])
    return dict(input_ids=torch.cat(examples)[None], position_ids=positions[None],
                cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_equal_each_example_alone_and_generation_equals_eager(family):
    model = tiny_model(family)
    attention, _ = attention_for(model.config)
    assert attention == ("eager_varlen" if family in ("gemma2", "gpt_oss") else "sdpa_varlen")
    torch.manual_seed(1)
    examples = [torch.randint(3, COMMON["vocab_size"], (n,)) for n in LENGTHS]

    alone = [model(input_ids=x[None], use_cache=False).logits[0] for x in examples]  # the family's eager attention
    sum(token_log_likelihood(logits, x) for logits, x in zip(alone, examples)).backward()
    reference = gradients(model)

    model.set_attn_implementation(register_attention(attention))
    logits = model(**packed_batch(examples), use_cache=False).logits[0]
    torch.testing.assert_close(logits, torch.cat(alone), rtol=0, atol=2e-5)
    loss = -sum(token_log_likelihood(part, x) for part, x in zip(logits.split(LENGTHS), examples))
    (-loss).backward()
    packed = gradients(model)
    assert packed.keys() == reference.keys()
    for name, grad in reference.items():  # float rounding of sums in another order: 3e-6 of the largest (measured)
        torch.testing.assert_close(packed[name], grad, rtol=0, atol=2e-5 * grad.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")

    with torch.no_grad():  # a training step through the recipe's attention, then generation past the window
        for name, parameter in model.named_parameters():
            parameter.sub_(0.05 * packed[name])
    prompt = examples[0][None, :12]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    scores = model(input_ids=prompt, use_cache=False).logits
    model.set_attn_implementation("eager")
    assert torch.equal(generated, model.generate(prompt, max_new_tokens=6, do_sample=False))
    torch.testing.assert_close(scores, model(input_ids=prompt, use_cache=False).logits, rtol=0, atol=2e-5)


def test_packed_rows_that_ignored_the_window_or_the_softcap_would_miss_by_far():
    """The tolerance above tells the difference: the same per-example attention without the sliding window (Mistral)
    or the logit softcap (Gemma-2), as the recipe's attention was before, misses each example alone by far more."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def without_window_and_softcap(*args, sliding_window=None, softcap=None, **kwargs):
        return sdpa_varlen_forward(*args, **kwargs)

    AttentionInterface.register("varlen_without_window_and_softcap", without_window_and_softcap)
    ALL_MASK_ATTENTION_FUNCTIONS.register("varlen_without_window_and_softcap", sdpa_mask)
    for family in ("mistral", "gemma2"):
        model = tiny_model(family)
        torch.manual_seed(1)
        examples = [torch.randint(3, COMMON["vocab_size"], (n,)) for n in LENGTHS]
        alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in examples])
        model.set_attn_implementation("varlen_without_window_and_softcap")
        assert (model(**packed_batch(examples), use_cache=False).logits[0] - alone).abs().max() > 1e-2, family


# What waits for the device when a tensor lives there: reading values into Python, or an output sized by them
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero}


class HostReads(TorchFunctionMode):
    """Each read of a tensor's values into Python while active, with the function that made it."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.reads.append(f"{func.__name__} in {traceback.extract_stack()[-2].name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_a_packed_step_reads_no_boundary_back_when_the_lengths_come_from_the_host(family):
    model = tiny_model(family)
    model.set_attn_implementation(register_attention(attention_for(model.config)[0]))
    torch.manual_seed(1)
    batch = packed_batch([torch.randint(3, COMMON["vocab_size"], (n,)) for n in LENGTHS])
    with HostReads() as without:  # the boundaries read in every layer, the mask's packed check once per forward
        model(**batch, use_cache=False).logits.sum().backward()
    assert any("example_lengths" in read for read in without.reads), without.reads
    assert any("find_packed_sequence_indices" in read for read in without.reads), without.reads
    batch[EXAMPLE_LENGTHS] = tuple(LENGTHS)
    with packed_rows(batch), HostReads() as with_lengths:
        model(**batch, use_cache=False).logits.sum().backward()
    assert with_lengths.reads == [] and EXAMPLE_LENGTHS not in batch


def test_the_collator_keeps_the_example_lengths_on_the_host():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = pickle.loads(pickle.dumps(WithExampleLengths(DataCollatorForLanguageModeling(0, padding_free=True))))
    batch = collator([{"input_ids": list(range(3, 3 + n))} for n in LENGTHS])
    assert collator.padding_free and batch[EXAMPLE_LENGTHS] == tuple(LENGTHS)
    assert batch["cu_seq_lens_q"].tolist() == [0, 21, 35, 44] and batch["max_length_q"] == 21


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flex_attention_on_packed_rows_equals_each_example_alone(family):
    model = tiny_model(family)
    torch.manual_seed(1)
    examples = [torch.randint(3, COMMON["vocab_size"], (n,)) for n in LENGTHS]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in examples])
        model.set_attn_implementation(register_attention(FLEX_ATTENTION))
        batch = {**packed_batch(examples), EXAMPLE_LENGTHS: tuple(LENGTHS)}
        with packed_rows(batch):
            torch.testing.assert_close(model(**batch, use_cache=False).logits[0], alone, rtol=0, atol=2e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_use_flash_attn_means_one_kernel_per_packed_row(family):
    from conftest import settled

    config = settled(["--use_flash_attn", "true"], model_config=FAMILIES[family](), cuda=True, torch_varlen=True)
    eager = family in ("gemma2", "gpt_oss")  # softcapping, sinks: FlexAttention computes them
    assert config.attention == (FLEX_ATTENTION if eager else KERNEL_ATTENTION)
    dropout = FAMILIES[family]()
    dropout.attention_dropout = 0.1  # computed by neither kernel: the per-example loop stays
    assert settled(["--use_flash_attn", "true"], model_config=dropout, cuda=True, torch_varlen=True).attention == (
        "eager_varlen" if eager else "sdpa_varlen")
    decisions = settled([], model_config=FAMILIES[family](), cuda=True).decisions
    opt_in = [d.why for d in decisions if d.setting == "attention"]
    assert "opt-in (--use_flash_attn true)" in opt_in[0]


def test_an_older_torchs_causal_varlen_kernel_gets_every_head_its_keys_and_the_models_scale(monkeypatch):
    """A torch before window_size and enable_gqa (`varlen_attn(..., is_causal)`, every query head with its own key
    head, scaled by dim^-0.5): fast_paths repeats grouped key/value heads and folds the model's scale into the
    queries. The op is stood in for by its own definition, causal attention within each example (it runs on CUDA
    only), which refuses grouped heads as the op does."""
    import torch.nn.attention.varlen as varlen

    from recipe.model import fast_paths

    def causal_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
        assert is_causal and query.shape[1] == key.shape[1]
        bounds = cu_seq_q.tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (query, key, value)), is_causal=True).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])])

    monkeypatch.setattr(varlen, "varlen_attn", causal_varlen)
    kernel, why = fast_paths.torch_varlen_attn()
    assert why is None and not fast_paths.torch_varlen_windows()
    torch.manual_seed(0)
    q, k, v = torch.randn(44, 4, 16), torch.randn(44, 2, 16), torch.randn(44, 2, 16)
    bounds = torch.tensor([0, 21, 35, 44], dtype=torch.int32)
    out = kernel(q, k, v, bounds, 21, 0.3, (-1, 0))
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=True).transpose(0, 1)
        for a, b in zip([0, 21, 35], [21, 35, 44])])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no sliding window"):
        kernel(q, k, v, bounds, 21, 0.3, (7, 0))


def test_the_kernel_refuses_what_it_cannot_compute():
    from recipe.model.fast_paths import kernel_varlen_forward

    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    query, key = torch.zeros(1, 4, 6, 16), torch.zeros(1, 2, 6, 16)
    bounds = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="no attention dropout, softcapping or sinks"):
        kernel_varlen_forward(attention, query, key, key, None, dropout=0.1, cu_seq_lens_q=bounds)
    with pytest.raises(RuntimeError, match="kernel_varlen: the FlashAttention kernels run on CUDA only"):
        kernel_varlen_forward(attention, query, key, key, None, cu_seq_lens_q=bounds)


SHIPPED = sorted(path.name for path in (REPO_DIR / "configs" / "models").iterdir())


@pytest.mark.e2e  # runs the recipe's command (--check)
@pytest.mark.parametrize("model", [*FAMILIES, *SHIPPED])
def test_check_works_from_a_config_json_alone(model, tmp_path, capsys):
    """A folder with only config.json (no weights, no tokenizer): the launch, the wrap class, the attention and the
    memory plan are checked; the tokenizer is named as not checked."""
    import train

    folder = REPO_DIR / "configs" / "models" / model if model in SHIPPED else tmp_path / model
    if model in FAMILIES:
        FAMILIES[model]().save_pretrained(folder)
    assert [path.name for path in folder.iterdir()] == ["config.json"]
    argv = ["--check", "--model_name_or_path", str(folder), "--accelerate_config", "configs/fsdp2_config_qlora.yaml",
            "--gpu_gib", "24", "--use_4bit_quantization", "true", "--eval_num_prompts", "0"]
    if model == "gpt-oss-20b":  # the published config: MXFP4 experts, refused with the fix before anything loads
        with pytest.raises(SystemExit) as stopped:
            train.run(argv)
        assert stopped.value.code == 2 and "stores its experts in MXFP4" in capsys.readouterr().err
        return
    train.run(argv)
    output = capsys.readouterr()
    assert "check passed" in output.out and "memory plan, GiB: per GPU" in output.out
    assert "has no tokenizer files" in output.err
    eager = model in ("gemma2", "gpt_oss", "gemma-2-9b")
    assert f"attention = {'eager_varlen' if eager else 'sdpa_varlen'}" in output.out

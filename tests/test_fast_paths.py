"""The waste fast_paths.py removes: each shortcut gives the numbers of the long way round, and is in effect."""


import pytest
import torch

from recipe.compat import TRL_SCORES_LABELLED_POSITIONS_ON_CPU
from recipe.model.fast_paths import register_attention
from recipe.data.training_data import ORIGIN, tokenize_splits


@pytest.fixture(scope="module")
def examples(recipe_examples, chat_dir):
    return recipe_examples(chat_dir, 5)


def collate(examples, tokenizer, padding_free: bool) -> dict:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=padding_free)(examples)


def load(model_dir, attention: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad()
    out = model(**batch, use_cache=False)  # as TRL calls it: a cache turns off packed-sequence masking
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@torch.no_grad()
def loss(model, batch: dict) -> torch.Tensor:
    """The forward pass alone (emulated bf16, on CPUs without it, makes a backward pass many times slower)."""
    return model(**batch, use_cache=False).loss


def test_attention_per_packed_example_equals_masked_sdpa(tiny_model_dir, smol_tokenizer, examples):
    """Same logits and gradients as sdpa over the whole row with its block-diagonal mask (GQA model, fp32)."""
    batch = collate(examples, smol_tokenizer, padding_free=True)
    assert batch["input_ids"].shape[0] == 1 and len(batch["cu_seq_lens_q"]) == len(examples) + 1
    masked = loss_and_grads(load(tiny_model_dir, "sdpa"), batch)
    per_example = loss_and_grads(load(tiny_model_dir, register_attention()), batch)
    torch.testing.assert_close(per_example[0], masked[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_example[1], masked[1], rtol=1e-4, atol=1e-5)
    for name, grad in masked[2].items():
        torch.testing.assert_close(per_example[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_attention_per_packed_example_in_bf16_autocast(tiny_model_dir, smol_tokenizer, examples):
    """bf16 weights under autocast (the recipe on a bf16 CPU, where short examples attend in fp32): the loss stays
    that of the fp32 model within bf16 rounding, as plain sdpa's does."""
    batch = collate(examples, smol_tokenizer, padding_free=True)
    reference = loss(load(tiny_model_dir, "sdpa"), batch)
    losses = {}
    for attention in ("sdpa", register_attention()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[attention] = loss(load(tiny_model_dir, attention, torch.bfloat16), batch).float()
    assert abs(losses["sdpa_varlen"] - reference) < 0.02 * reference
    print({name: float(value - reference) for name, value in losses.items()})
    assert abs(losses["sdpa_varlen"] - reference) <= abs(losses["sdpa"] - reference) + 1e-3


def test_padded_batches_keep_plain_sdpa(tiny_model_dir, smol_tokenizer, examples):
    """Eval and generation batches are padded, with no example boundaries: exactly sdpa's numbers."""
    batch = collate(examples, smol_tokenizer, padding_free=False)
    assert "attention_mask" in batch and "cu_seq_lens_q" not in batch
    masked = loss_and_grads(load(tiny_model_dir, "sdpa"), batch)
    same = loss_and_grads(load(tiny_model_dir, register_attention()), batch)
    assert torch.equal(masked[0], same[0]) and torch.equal(masked[1], same[1])


def test_lm_head_projects_only_the_labelled_positions(tiny_model_dir, smol_tokenizer, examples, monkeypatch):
    """TRL's fused head on CPU then takes just the rows with a label, and the loss is the full-logits one."""
    import trl.trainer.utils as trl_utils
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    TRL_SCORES_LABELLED_POSITIONS_ON_CPU.apply()  # its canary: tests/test_compat.py
    model = load(tiny_model_dir, register_attention())
    trainer = SFTTrainer(model=model, processing_class=smol_tokenizer, train_dataset=Dataset.from_list(examples),
                         args=SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none",
                                        padding_free=True, max_length=None))
    rows = []
    apply = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply",
                        lambda hidden, *args: rows.append(hidden.shape[0]) or apply(hidden, *args))
    batch = collate(examples, smol_tokenizer, padding_free=True)
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    assert labelled < batch["input_ids"].numel() / 3  # chat examples supervise their answers only
    loss = trainer.compute_loss(model, dict(batch))
    assert rows == [labelled]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits.float(), batch["labels"][0, 1:], ignore_index=-100)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_padding_free_data_is_truncated_by_the_recipe(smol_tokenizer, tmp_path):
    """TRL does not truncate padding-free batches: the recipe cuts what max_length allows (a trailing user turn)."""
    from datasets import Dataset, DatasetDict

    messages = [{"role": "user", "content": "Date?"}, {"role": "assistant", "content": "2020-01-01"},
                {"role": "user", "content": "thanks " * 200}]
    raw = DatasetDict({"train": Dataset.from_list([{"messages": messages, ORIGIN: "train:1"}])})
    tokenized, bad = tokenize_splits(raw, "conversational", smol_tokenizer, max_length=64, truncate=True)
    assert not bad and len(tokenized["train"][0]["input_ids"]) == 64
    assert any(label != -100 for label in tokenized["train"][0]["labels"])


def test_generation_runs_compiled_decoder_layers_eagerly(tiny_model_dir, smol_tokenizer):
    """Held-out generation after a compiled run (--torch_compile, or compiled mid-run): every new token's cache state
    would be one more graph until torch gives up ("hit config.recompile_limit", warned at length); it runs eager."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from recipe.reporting.heldout import generate_answers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    want = generate_answers(model, smol_tokenizer, ["Convert May 1, 2000"], max_new_tokens=4)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    assert generate_answers(model, smol_tokenizer, ["Convert May 1, 2000"], max_new_tokens=4) == want
    assert not counters["stats"]["unique_graphs"]

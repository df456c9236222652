"""Shared fixtures: the real SmolLM2 tokenizer (converted once from the packaged GGUF) and a tiny random Llama."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from utils import convert_default_model

    return convert_default_model()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A 2-layer Llama with SmolLM2's vocabulary and tokenizer, randomly initialised: trains in seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=smol_tokenizer.bos_token_id, eos_token_id=smol_tokenizer.eos_token_id,
                         pad_token_id=smol_tokenizer.pad_token_id, tie_word_embeddings=True,
                         initializer_range=0.2)  # wider than 0.02, so logits are not flat and LoRA moves the loss fast
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    smol_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory) -> Path:
    """A small copy of the demo data: 64 train and 8 test conversations."""
    out = tmp_path_factory.mktemp("dates")
    for split, n in (("train", 64), ("test", 8)):
        lines = (REPO / "data" / "dates" / f"{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def recipe_examples(smol_tokenizer):
    """The first n train examples of a data folder, tokenized as the recipe tokenizes them (input_ids, labels)."""
    import argparse

    from utils import build_datasets, drop_bad, load_raw_datasets

    def tokenize(source: Path, n: int) -> list[dict]:
        raw, _, data_format = load_raw_datasets(argparse.Namespace(dataset_name=str(source), split_names=["train"]))
        raw["train"] = raw["train"].select(range(n))
        tokenized, _ = build_datasets(raw, data_format, smol_tokenizer,
                                      argparse.Namespace(add_special_tokens=False, append_concat_token=True),
                                      argparse.Namespace(dataset_text_field="text", max_length=512))
        return list(drop_bad(tokenized, [])["train"])

    return tokenize

"""Held-out evaluation: greedy answers to held-out prompts, exact match against the reference answers.

    python evaluate.py --adapter outputs/smollm2-dates-lora          # base + adapter vs base, on data/dates test
    python evaluate.py --model_name_or_path models/SmolLM2-135M-Instruct --num_prompts 16
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from recipe.data.training_data import first_examples


@dataclass
class HeldOut:
    prompts: list  # chat message lists (conversational data) or strings
    references: list[str]


def heldout_examples(dataset, num_prompts: int) -> HeldOut | None:
    """Prompt = everything before the final answer; reference = the final answer. None for plain-text data."""
    rows = first_examples(dataset, num_prompts)
    prompts, references = [], []
    for row in rows:
        if "messages" in row:
            messages = row["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompts.append(messages[:last])
            references.append(messages[last]["content"])
        elif "prompt" in row and "completion" in row:
            prompts.append(row["prompt"])
            completion = row["completion"]
            references.append(completion[-1]["content"] if isinstance(completion, list) else completion)
        else:
            return None
    return HeldOut(prompts, references)


def normalize(answer: str) -> str:
    return " ".join(answer.strip().split()).rstrip(".").lower()


def exact_match(predictions: list[str], references: list[str]) -> float:
    return sum(normalize(p) == normalize(r) for p, r in zip(predictions, references)) / max(len(references), 1)


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list, max_new_tokens: int = 32, batch_size: int = 32) -> list[str]:
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list) else p
        for p in prompts
    ]
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues on the right
    was_training = model.training
    model.eval()
    answers = []
    # Eager even where the run compiled its decoder layers (--torch_compile, or mid-run): each generated token's
    # cache state would be one more graph, and the compile hits its limit ("torch._dynamo hit config.recompile_limit")
    try:
        with torch.compiler.set_stance("force_eager"):
            for i in range(0, len(texts), batch_size):
                batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True,
                                  add_special_tokens=False).to(model.device)
                output = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
                answers += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return [a.strip() for a in answers]


@torch.no_grad()
def heldout_loss(model, tokenizer, dataset, num_examples: int, text_field: str = "text") -> float:
    """Mean loss per supervised token (the assistant turns / completions) over held-out examples."""
    from recipe.data.training_data import IGNORE_INDEX, detect_format, tokenize_example

    data_format = detect_format(dataset.column_names, text_field)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for row in first_examples(dataset, num_examples):
        example = tokenize_example(row, tokenizer, data_format, text_field, False, data_format != "conversational")
        labels = torch.tensor([example["labels"]], device=model.device)
        logits = model(input_ids=torch.tensor([example["input_ids"]], device=model.device)).logits.float()
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum",
                                                   ignore_index=IGNORE_INDEX)
        total += losses.item()
        count += int((labels[0, 1:] != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / max(count, 1)


def evaluate_exact_match(model, tokenizer, heldout: HeldOut, max_new_tokens: int) -> tuple[float, list[str]]:
    predictions = generate_answers(model, tokenizer, heldout.prompts, max_new_tokens)
    return exact_match(predictions, heldout.references), predictions


def main() -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    from recipe.settings.arguments import DEFAULT_DATASET
    from recipe.data.training_data import load_splits
    from recipe.model.model_files import (DEFAULT_MODEL_DIR, convert_default_model, load_causal_lm,
                                          refuse_pickled_weights)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--adapter", help="a PEFT adapter folder; reported side by side with the base model")
    parser.add_argument("--dataset_name", default=DEFAULT_DATASET)
    parser.add_argument("--split", default="test")
    parser.add_argument("--num_prompts", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--show", type=int, default=5, help="generations printed side by side with the reference")
    args = parser.parse_args()
    refuse_pickled_weights(*filter(None, (args.model_name_or_path, args.adapter)))  # before anything loads

    if args.model_name_or_path == DEFAULT_MODEL_DIR:
        convert_default_model()
    raw, _, _, _ = load_splits(args.dataset_name, [args.split])
    heldout = heldout_examples(raw[args.split], args.num_prompts)
    if heldout is None:
        raise SystemExit(f"error: the {args.split} split is plain text; exact match needs chat or prompt/completion "
                         "data.")
    tokenizer = AutoTokenizer.from_pretrained(args.adapter or args.model_name_or_path)
    model = load_causal_lm(args.model_name_or_path, dtype=torch.float32)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # the adapter's template added tokens
    results = {"base": evaluate_exact_match(model, tokenizer, heldout, args.max_new_tokens)}
    losses = {"base": heldout_loss(model, tokenizer, raw[args.split], args.num_prompts)}
    if args.adapter:
        model = PeftModel.from_pretrained(model, args.adapter)
        results["adapter"] = evaluate_exact_match(model, tokenizer, heldout, args.max_new_tokens)
        losses["adapter"] = heldout_loss(model, tokenizer, raw[args.split], args.num_prompts)
    for name, (score, _) in results.items():
        print(f"{name:8s} loss {losses[name]:.4f}  exact match {score:.1%}  on {len(heldout.references)} "
              f"{args.split} examples")
    for i in range(min(args.show, len(heldout.references))):
        print(f"\nreference: {heldout.references[i]}")
        for name, (_, predictions) in results.items():
            print(f"{name:9s}: {predictions[i]!r}")


if __name__ == "__main__":
    main()

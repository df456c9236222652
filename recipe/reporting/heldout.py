"""What a run reports of held-out examples: greedy answers to held-out prompts and their exact match against the
reference answers (train.py before and after training, evaluate.py for any adapter)."""

from __future__ import annotations

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
def evaluate_exact_match(model, tokenizer, heldout: HeldOut, max_new_tokens: int) -> tuple[float, list[str]]:
    predictions = generate_answers(model, tokenizer, heldout.prompts, max_new_tokens)
    return exact_match(predictions, heldout.references), predictions

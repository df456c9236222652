"""Held-out evaluation of a base model and of an adapter on it, as a training run evaluates: the split prepared as
train.py prepares it, the loss from TRL's own evaluation through the recipe's trainer (a run's `eval_loss`, to bf16's
rounding where the run had compiled its layers), and the exact match of greedy answers to the held-out prompts.

    python evaluate.py --adapter outputs/smollm2-dates-lora          # base + adapter vs base, on data/dates test
    python evaluate.py --model_name_or_path models/SmolLM2-135M-Instruct --num_prompts 16
    python evaluate.py --adapter outputs/run --bf16 false            # any other flag: as the run was trained
"""

from __future__ import annotations

import argparse
import tempfile

import train
from recipe.model.model_files import DEFAULT_MODEL_DIR, refuse_pickled_weights
from recipe.reporting.heldout import evaluate_exact_match, heldout_examples
from recipe.settings.arguments import DEFAULT_DATASET
from recipe.settings.configuration import configure


def measured(config, model, data, heldout, max_new_tokens: int) -> tuple[float, float, list[str]]:
    """The held-out loss as the run reports it (its trainer's evaluation), the exact match and the answers."""
    trainer, _ = train.build_trainer(config, model, data)
    loss = trainer.evaluate()["eval_loss"]
    score, predictions = evaluate_exact_match(model, config.facts.tokenizer, heldout, max_new_tokens)
    return loss, score, predictions


def main(argv: list[str] | None = None) -> None:
    from peft import PeftModel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--adapter", help="a PEFT adapter folder; reported side by side with the base model")
    parser.add_argument("--dataset_name", default=DEFAULT_DATASET)
    parser.add_argument("--split", default="test", choices=["test", "validation"])
    parser.add_argument("--num_prompts", type=int, default=64, help="held-out examples for the loss and exact match")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--show", type=int, default=5, help="generations printed side by side with the reference")
    args, run_flags = parser.parse_known_args(argv)  # the rest: train.py's flags, as the run was trained
    refuse_pickled_weights(*filter(None, (args.model_name_or_path, args.adapter)))  # before anything loads

    with tempfile.TemporaryDirectory() as out:
        config = configure(["--model_name_or_path", args.model_name_or_path, "--dataset_name", args.dataset_name,
                            "--splits", f"train,{args.split}", "--max_eval_samples", str(args.num_prompts),
                            "--eval_num_prompts", "0", "--use_peft_lora", "false", *run_flags, "--output_dir", out])
        data = train.load_data(config)
        heldout = heldout_examples(data.raw[args.split], args.num_prompts)
        if heldout is None:
            raise SystemExit(f"error: the {args.split} split is plain text; exact match needs chat or "
                             "prompt/completion data.")
        model = train.build_base_model(config)  # as the run built it: its dtype, its template's added tokens
        results = {"base": measured(config, model, data, heldout, args.max_new_tokens)}
        if args.adapter:
            model = PeftModel.from_pretrained(model, args.adapter)
            results["adapter"] = measured(config, model, data, heldout, args.max_new_tokens)
    for name, (loss, score, _) in results.items():
        print(f"{name:8s} loss {loss:.4f}  exact match {score:.1%}  on {len(heldout.references)} {args.split} "
              "examples")
    for i in range(min(args.show, len(heldout.references))):
        print(f"\nreference: {heldout.references[i]}")
        for name, (_, _, predictions) in results.items():
            print(f"{name:9s}: {predictions[i]!r}")


if __name__ == "__main__":
    main()

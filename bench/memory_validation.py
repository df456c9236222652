"""Validate the memory planner against measured runs of train.py on this machine (CPU, peak RSS).

    .venv/bin/python bench/memory_validation.py   # about 3 minutes on 2 cores; writes bench/memory_validation.json

Each run is a real `train.py` run in its own process. The process records its RSS after the imports (the process
base), after the model is built (the weights), and its peak (ru_maxrss) at the end; the planner predicts the same
three parts for the same run (device cpu). Not a test: the output is the table in the README.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Runs inside each child process: wraps build_model to sample RSS, then runs the recipe.
CHILD = r"""
import json, resource, sys
import psutil
sys.path.insert(0, {repo!r})
import train
marks = {{"base": psutil.Process().memory_info().rss}}
build = train.build_model
def measured_build(*args, **kwargs):
    model = build(*args, **kwargs)
    marks["after_model"] = psutil.Process().memory_info().rss
    return model
train.build_model = measured_build
trainer, summary = train.run({argv!r})
marks["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
marks["max_tokens"] = max(len(x) for x in trainer.train_dataset["input_ids"])
print("MARKS " + json.dumps(marks))
"""


def tiny_model(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from recipe.model.model_files import convert_default_model

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def measure(argv: list[str]) -> dict:
    script = CHILD.format(repo=str(REPO), argv=argv)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    line = next(line for line in result.stdout.splitlines() if line.startswith("MARKS "))
    return json.loads(line[len("MARKS "):])


def main() -> None:
    from recipe.planning.memory import GIB, Run, Shapes, load_config, plan
    from recipe.platform.hardware import native_bf16_supported
    from recipe.model.model_files import DEFAULT_MODEL_DIR

    precision = "bf16" if native_bf16_supported() else "fp32"
    work = Path(tempfile.mkdtemp())
    tiny = tiny_model(work / "tiny")
    common = ["--max_steps", "4", "--per_device_train_batch_size", "8", "--eval_num_prompts", "0", "--splits", "train",
              "--disable_tqdm", "true", "--bf16", str(precision == "bf16").lower(), "--lora_dropout", "0.05"]
    runs = {
        "tiny Llama 4x256, LoRA": (tiny, "lora"),
        "tiny Llama 4x256, QLoRA": (tiny, "qlora"),
        "SmolLM2-135M, LoRA": (Path(DEFAULT_MODEL_DIR), "lora"),
        "SmolLM2-135M, QLoRA": (Path(DEFAULT_MODEL_DIR), "qlora"),
    }
    rows = []
    for name, (model, method) in runs.items():
        argv = [*common, "--model_name_or_path", str(model), "--output_dir", str(work / name.replace(" ", "_"))]
        if method == "qlora":
            argv += ["--use_4bit_quantization", "true"]
        marks = measure(argv)
        run = Run(method=method, engine="none", device="cpu", batch=8, seq=marks["max_tokens"], checkpointing=False,
                  lora_r=16, lora_dropout=0.05, load_dtype="bfloat16" if precision == "bf16" else "float32",
                  nested_quant=False)
        predicted = plan(Shapes.of(load_config(str(model))), run).host
        measured = {"process": marks["base"] / GIB, "weights": (marks["after_model"] - marks["base"]) / GIB,
                    "training": (marks["peak"] - marks["after_model"]) / GIB}
        weights = predicted["weights (frozen)"]
        training = sum(v for k, v in predicted.items() if k not in ("weights (frozen)", "process"))
        components = {k: round(v, 3) for k, v in predicted.items()}
        rows.append({"run": name, "tokens_per_sequence": marks["max_tokens"],
                     "process": [round(predicted["process"], 3), round(measured["process"], 3)],
                     "weights": [round(weights, 3), round(measured["weights"], 3)],
                     "training": [round(training, 3), round(measured["training"], 3)],
                     "peak": [round(sum(predicted.values()), 3), round(marks["peak"] / GIB, 3)],
                     "predicted_components": components})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nplanner vs measured peak RSS on this CPU ({precision}), GiB: predicted / measured")
    print(f"{'run':26s} {'process':>15s} {'weights':>15s} {'training':>15s} {'peak':>15s}")
    for row in rows:
        cells = [f"{p:.2f} / {m:.2f}" for p, m in (row["process"], row["weights"], row["training"], row["peak"])]
        print(f"{row['run']:26s} " + " ".join(f"{c:>15s}" for c in cells))
    (REPO / "bench" / "memory_validation.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""The memory planner against runs of train.py at the largest scale a 2-core, 24 GiB machine holds, measured from
outside.

    .venv/bin/python bench/memory_grid.py                 # the whole grid; writes bench/memory_grid.json and .md
    .venv/bin/python bench/memory_grid.py --cases NAME..  # some of it (names as in the table)

Each case is a real `train.py` run (one process, or `accelerate launch` of a shipped config on 2 gloo processes) on a
random-weight model of a real architecture (Llama, Qwen2, Gemma-2) of 2-4 GiB, shaped so that memory is large and
compute small: wide vocabularies and embeddings, one or two decoder layers, two steps. A sampler in this process reads
`/proc/<pid>/status` of every process of the run every 20 ms (RssAnon: what the process holds, not the memory-mapped
checkpoint pages the kernel can drop). The run marks where each phase starts (`run_memory.PhasePeaks`, through the
RECIPE_PHASE_MARKS file), so each rank's peak in each phase is set against the plan `train.py --check` makes for the
same flags. The recipe's own accounting (run_summary.json) is not used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GIB = 2**30
SAMPLE_S = 0.02
TOLERANCE = 0.10  # of the planned value, or ...
TOLERANCE_GIB = 50 / 1024  # ... 50 MiB, whichever is larger


# ---------------------------------------------------------------------------------------------------------------------
# Models and data


@dataclass(frozen=True)
class ModelShape:
    """A random-weight model of a real architecture; the bulk of its bytes is the vocabulary, cheap to compute with."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    tied: bool
    experts: int = 0  # a mixture of experts: experts per layer (2 routed per token); `intermediate` is each expert's
    dtype: str = "float32"  # of the checkpoint

    def config(self, tokenizer):
        from transformers import AutoConfig

        extra = {"head_dim": self.hidden // self.heads} if self.model_type == "gemma2" else {}
        if self.experts:
            extra.update(num_local_experts=self.experts, num_experts_per_tok=2)
        return AutoConfig.for_model(
            self.model_type, vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
            intermediate_size=self.intermediate, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            tie_word_embeddings=self.tied, max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)


MODELS = {
    # Llama-3's vocabulary, untied head: 0.57 G parameters, 2.1 GiB in fp32
    "llama-2g": ModelShape("llama", 128256, 2048, 2, 2048, 16, 8, tied=False),
    # The same at half the width: 0.28 G parameters, 1.05 GiB in fp32 (the tests' model: gloo moves the gathered
    # vocabulary matrices through loopback TCP at a few hundred MB/s, which makes the 2.1 GiB one take minutes there)
    "llama-1g": ModelShape("llama", 128256, 1024, 2, 2048, 8, 4, tied=False),
    # Qwen2.5's vocabulary, untied head: 1.1 G parameters, 4.1 GiB in fp32
    "qwen2-4g": ModelShape("qwen2", 151936, 3584, 1, 2048, 28, 4, tied=False),
    # Gemma-2's vocabulary, tied (as Gemma ties), eager attention with softcapping: 0.6 G parameters, 2.3 GiB in fp32
    "gemma2-2g": ModelShape("gemma2", 256000, 2304, 1, 2048, 8, 4, tied=True),
    # Many decoder layers, as most models are: 0.59 G parameters, 2.2 GiB in fp32, mostly in 20 x 7 linear weights
    "llama-deep-2g": ModelShape("llama", 49152, 1280, 20, 5120, 10, 5, tied=True),
    # The logits case: a small model whose loss runs over a 128k vocabulary (0.07 G parameters)
    "llama-logits": ModelShape("llama", 128256, 256, 2, 768, 4, 2, tied=False),
    # A mixture of experts as published, in bf16: 2.3 G parameters, 4.3 GiB, 96% of them in 24 layers x 8 experts
    "mixtral-4g": ModelShape("mixtral", 49152, 1024, 24, 3584, 16, 8, tied=False, experts=8, dtype="bfloat16"),
}


def make_model(name: str, cache: Path) -> Path:
    """The model's folder (made once): random weights saved as safetensors, with the default model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipe.model.model_files import convert_default_model

    out, made = cache / name, cache / f"{name}.made"  # written last: a run killed while saving starts over
    if made.exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(convert_default_model())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODELS[name].config(tokenizer), dtype=getattr(torch, MODELS[name].dtype))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    made.touch()
    return out


def make_data(out: Path, seq: int, supervised: float, examples: int = 16) -> Path:
    """Prompt/completion examples longer than `seq` tokens (the recipe truncates them to exactly `seq`), the
    completion starting after (1 - supervised) of them: `supervised` of each example's tokens carry a label."""
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from his her an be this are".split()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(examples):
            prompt = " ".join(rng.choice(words) for _ in range(int(seq * (1 - supervised))))
            completion = " ".join(rng.choice(words) for _ in range(seq))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The sampler


class TreeSampler:
    """RssAnon of a process and all its descendants, every SAMPLE_S seconds, from /proc (pid -> [(time, bytes)])."""

    def __init__(self, root: int):
        self.root = root
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _children() -> dict[int, list[int]]:
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                except OSError:
                    continue
                parent = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
        return children

    def _run(self) -> None:
        tree, refreshed = [self.root], 0.0
        while not self._stop.is_set():
            now = time.time()
            if now - refreshed > 0.5:  # new processes appear at start-up only; a full /proc scan costs ~5 ms
                children, tree, refreshed = self._children(), [self.root], now
                for pid in tree:
                    tree.extend(children.get(pid, []))
            for pid in tree:
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("RssAnon:"):
                            self.samples.setdefault(pid, []).append((now, int(line.split()[1]) * 1024))
                            break
                except OSError:
                    pass
            self._stop.wait(SAMPLE_S)


def phase_peaks(samples: dict[int, list[tuple[float, int]]], marks: list[str]) -> list[dict[str, float]]:
    """Each rank's peak RssAnon in the load (read, wrap, shard), train and save phases, and what it held when the
    load began (its process with the data prepared), from the run's phase marks."""
    by_rank: dict[int, tuple[int, list[tuple[str, float]]]] = {}
    for line in marks:
        rank, pid, phase, at = line.split()
        by_rank.setdefault(int(rank), (int(pid), []))[1].append((phase, float(at)))
    result = []
    for rank in sorted(by_rank):
        pid, events = by_rank[rank]
        starts = {}
        for phase, at in events:
            starts.setdefault(phase, at)
        ends = [at for phase, at in events if phase == "end"]
        windows = {"load": (starts["read"], starts["train"]), "train": (starts["train"], starts["save"]),
                   "save": (starts["save"], max(ends))}
        series = samples.get(pid, [])
        def held_at(moment: float) -> float:
            before = [value for at, value in series if at <= moment]
            return (before[-1] if before else series[0][1]) / GIB

        record = {"start": held_at(starts["read"]), "save_start": held_at(starts["save"])}
        for phase, (begin, end) in windows.items():
            inside = [value for at, value in series if begin <= at <= end]
            record[phase] = max(inside) / GIB if inside else float("nan")
        result.append(record)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Cases


ENGINES = {"one": None, "fsdp1": "configs/fsdp_config.yaml", "fsdp2": "configs/fsdp2_config.yaml",
           "zero3": "configs/deepspeed_config.yaml"}
QLORA_ENGINES = {"fsdp1": "configs/fsdp_config_qlora.yaml",
                 "fsdp2": "configs/fsdp2_config_qlora.yaml",  # its parameter offload: off on CPU
                 "zero3": "configs/deepspeed_config_z3_qlora.yaml"}


@dataclass(frozen=True)
class Case:
    model: str
    engine: str  # one | fsdp1 | fsdp2 | zero3
    method: str  # lora | qlora
    seq: int
    checkpointing: bool
    supervised: float = 0.125  # of each example's tokens carrying a label
    batch: int = 1
    steps: int = 2  # the second step holds the optimizer's state as well (for LoRA, a few MiB)

    @property
    def name(self) -> str:
        return (f"{self.model} {self.engine} {self.method} {self.batch}x{self.seq}"
                f"{' ckpt' if self.checkpointing else ''} sup{self.supervised:g}"
                f"{f' {self.steps} step' if self.steps != 2 else ''}")

    @property
    def processes(self) -> int:
        return 1 if self.engine == "one" else 2

    @property
    def accelerate_config(self) -> str | None:
        return (QLORA_ENGINES if self.method == "qlora" else ENGINES).get(self.engine)

    def flags(self, model_dir: Path, data_dir: Path, out: Path) -> list[str]:
        flags = ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--splits", "train",
                 "--output_dir", str(out), "--max_steps", str(self.steps),
                 "--per_device_train_batch_size", str(self.batch),
                 "--max_length", str(self.seq), "--bf16", "false", "--eval_num_prompts", "0", "--disable_tqdm", "true",
                 "--logging_steps", "1", "--save_strategy", "no", "--lora_r", "16", "--lora_dropout", "0.05",
                 "--activation_checkpointing", str(self.checkpointing).lower(), "--report_to", "none"]
        if self.method == "qlora":
            flags += ["--use_4bit_quantization", "true"]
        return flags

    def launcher(self) -> list[str]:
        if self.engine == "one":
            return [sys.executable, "train.py"]
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", self.accelerate_config,
                "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0", "train.py"]


GRID = [
    Case("llama-logits", "one", "lora", 2048, False, supervised=1.0, batch=4),  # the logits case
    Case("llama-logits", "one", "lora", 4096, False, supervised=1.0),
    Case("llama-logits", "fsdp2", "lora", 4096, False, supervised=1.0),
    Case("llama-deep-2g", "fsdp2", "lora", 256, False),
    Case("llama-2g", "one", "lora", 256, False),
    Case("llama-2g", "one", "qlora", 256, False),
    Case("llama-2g", "one", "qlora", 4096, True),
    Case("llama-2g", "fsdp2", "lora", 256, False),
    Case("llama-2g", "fsdp2", "qlora", 4096, False),
    Case("llama-2g", "fsdp1", "lora", 4096, True),
    Case("llama-2g", "fsdp1", "qlora", 256, False),
    Case("llama-2g", "zero3", "lora", 256, False),
    Case("llama-2g", "zero3", "qlora", 4096, True),
    Case("qwen2-4g", "one", "lora", 4096, False),
    Case("qwen2-4g", "fsdp2", "lora", 4096, True),
    Case("qwen2-4g", "zero3", "qlora", 256, False),
    Case("gemma2-2g", "one", "lora", 4096, True),
    Case("gemma2-2g", "fsdp2", "qlora", 256, False),
    Case("gemma2-2g", "fsdp1", "lora", 256, False),
    Case("mixtral-4g", "fsdp2", "qlora", 256, False),  # each layer's experts quantized as it loads
]


def planned(case: Case, model_dir: Path, data_dir: Path, out: Path) -> dict[str, dict[str, float]]:
    """The plan train.py makes for the case's flags in each process of its launch on this machine."""
    from dataclasses import replace

    from recipe.settings.arguments import parse_arguments
    from recipe.settings.configuration import memory_plan, settle
    from recipe.settings.facts import gather
    from recipe.platform.launch import Launch, launch_environment

    request = parse_arguments(case.flags(model_dir, data_dir, out))
    facts = gather(request)  # this process: one CPU process
    if case.engine != "one":
        env = launch_environment(["--config_file", case.accelerate_config, "--num_processes", "2",
                                  "--mixed_precision", "no", "train.py"])
        facts = replace(facts, launch=Launch(env, 2))
    return memory_plan(settle(request, facts), labelled=case.supervised).phases


def measure(case: Case, model_dir: Path, data_dir: Path, out: Path) -> list[dict[str, float]]:
    marks = out.with_suffix(".marks")
    marks.unlink(missing_ok=True)
    # the machine's cores shared among the case's processes, unless a thread count is set (the test suite sets 1: its
    # other worker runs beside the case, and two threads on one free core took ~10% more CPU for the same case)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) // case.processes))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1", "RECIPE_PHASE_MARKS": str(marks)}
    process = subprocess.Popen([*case.launcher(), *case.flags(model_dir, data_dir, out)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with TreeSampler(process.pid) as sampler:
        log, _ = process.communicate(timeout=1800)
    if process.returncode != 0:
        raise RuntimeError(f"{case.name} failed:\n{log[-4000:]}")
    return phase_peaks(sampler.samples, marks.read_text().splitlines())


def compare(case: Case, plan_phases: dict, measured: list[dict[str, float]]) -> dict:
    """Each rank's growth in each phase, planned against measured: loading and training above what the rank held when
    loading began (the weights and all that training adds), saving above what it held when the save began."""
    rows = {}
    for rank, record in enumerate(measured):
        place = "host rank 0" if rank == 0 else "host other rank"
        for phase in ("load", "train", "save"):
            want = plan_phases[phase][place]
            # a peak above its start
            got = max(0.0, record[phase] - record["save_start" if phase == "save" else "start"])
            rows[f"rank {rank} {phase}"] = {"planned": round(want, 3), "measured": round(got, 3),
                                            "ok": abs(got - want) <= max(TOLERANCE * want, TOLERANCE_GIB)}
    return rows


def run_case(case: Case, cache: Path, work: Path) -> dict:
    model_dir = make_model(case.model, cache)
    data_dir = make_data(work / f"data-{case.seq}-{case.supervised:g}", case.seq, case.supervised)
    out = work / case.name.replace(" ", "_")
    plan_phases = planned(case, model_dir, data_dir, out)
    started = time.time()
    measured = measure(case, model_dir, data_dir, out)
    result = {"case": case.name, "seconds": round(time.time() - started, 1), "measured": measured,
              "phases": compare(case, plan_phases, measured)}
    if MODELS[case.model].experts:
        result["checkpoint_gib"] = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / GIB
        result["adapter_max_logit_difference"] = adapter_on_the_stock_model(model_dir, out)
    return result


def adapter_on_the_stock_model(model_dir: Path, adapter_dir: Path) -> dict[str, float]:
    """A mixture of experts' adapter, trained on experts split into linear modules, loaded onto the stock fused model
    (PEFT converts it) and onto the split model: the largest difference of their logits, fp32, on a probe, beside how
    far the adapter moves the base's logits (the same comparison with an untrained adapter would be 0). PEFT 0.21
    refuses LoRA dropout on the fused experts' parameters (`lora.ParamWrapper`): dropout does nothing at inference, so
    the adapter is loaded without it."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from recipe.model import moe

    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    logits = []
    for split in (False, True):
        config = PeftConfig.from_pretrained(adapter_dir)  # each load its own: PEFT rewrites it for the fused model
        config.lora_dropout = 0.0
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if split:
            moe.split_experts(base)
            with torch.no_grad():
                base_logits = base(ids).logits
        with torch.no_grad():
            logits.append(PeftModel.from_pretrained(base, adapter_dir, config=config).eval()(ids).logits)
        del base
    return {"stock_against_split": (logits[0] - logits[1]).abs().max().item(),
            "adapter_against_base": (logits[1] - base_logits).abs().max().item()}


def replan(result: dict, cache: Path, work: Path) -> dict:
    """A measured result set against the current planner (for changing the planner without measuring again)."""
    case = next(c for c in GRID if c.name == result["case"])
    model_dir = make_model(case.model, cache)
    data_dir = make_data(work / f"data-{case.seq}-{case.supervised:g}", case.seq, case.supervised)
    plan_phases = planned(case, model_dir, data_dir, work / "out")
    return {**result, "phases": compare(case, plan_phases, result["measured"])}


def table(results: list[dict]) -> str:
    lines = ["| case | phase | planned GiB | measured GiB | error |", "|---|---|---|---|---|"]
    for result in results:
        for key, row in result["phases"].items():
            error = (row["measured"] - row["planned"]) / row["planned"] if row["planned"] else float("nan")
            lines.append(f"| {result['case']} | {key} | {row['planned']:.2f} | {row['measured']:.2f} | "
                         f"{error:+.0%}{'' if row['ok'] else ' (off)'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", help="substrings of case names (default: the whole grid)")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "recipe-memory-grid"),
                        help="where the random models are kept between runs")
    parser.add_argument("--out", default=str(REPO / "bench" / "memory_grid"), help="the table's path, without suffix")
    parser.add_argument("--replan", action="store_true", help="set the measurements in OUT.json against the current "
                        "planner instead of measuring again")
    args = parser.parse_args(argv)
    cases = [c for c in GRID if not args.cases or any(s in c.name for s in args.cases)]
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    results = []
    saved_file = Path(args.out).with_suffix(".json")
    # Some cases measured again: the other cases' rows are kept as they were measured, these replaced
    earlier = (json.loads(saved_file.read_text())["results"] if args.cases and not args.replan and saved_file.is_file()
               else [])

    def with_earlier(measured: list[dict]) -> list[dict]:
        now = {result["case"]: result for result in measured}
        return [now.pop(result["case"], result) for result in earlier] + list(now.values())

    header = (f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores; growth of each rank's RssAnon above what it held when loading began (save: "
              "above what it held when the save began).")
    with tempfile.TemporaryDirectory() as work:
        if args.replan:
            saved = json.loads(Path(args.out).with_suffix(".json").read_text())
            header = saved["measured"]
            results = [replan(r, cache, Path(work)) if "measured" in r else r for r in saved["results"]
                       if r["case"] in {c.name for c in cases}]
        else:
            for case in cases:
                try:
                    results.append(run_case(case, cache, Path(work)))
                except Exception as err:  # the next cases still run; the table says which one failed
                    results.append({"case": case.name, "error": str(err)[-3000:], "phases": {}})
                print(json.dumps(results[-1]), flush=True)
                saved_file.write_text(json.dumps({"measured": header, "results": with_earlier(results)}, indent=1))
    results = with_earlier(results)
    saved_file.write_text(json.dumps({"measured": header, "results": results}, indent=1))
    Path(args.out).with_suffix(".md").write_text(header + "\n\n" + table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()

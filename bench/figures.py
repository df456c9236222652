"""Measured figures in README.md and docs/, made from the results files the benchmarks write, never typed by hand.

    .venv/bin/python bench/figures.py           # prints every block the documents hold, made again
    .venv/bin/python bench/figures.py --write   # rewrites them where they are

A block names the results file it is made from (a path under bench/), so each dated table stays with its run:
`<!-- figures.py: KIND FILE.json -->` ... `<!-- /figures.py -->`; several files are several runs, the later's entries
replacing the earlier's. Kinds, from the GPU check's results
(gpu_check_results/):

- `speed`: the speed part's runs, a row each: tokens/s, MFU (as this project counts and, where recorded, as NeMo
  AutoModel counts), the first step, GPU memory against the plan; runs of a data set beside `trl sft`'s on it show the
  ratio.
- `speed-line`: the same in one sentence, for the README.
- `profile`: where one step's GPU time went, and the calls that waited for the GPU, per run that recorded them.
- `launchers`: each launcher's run: seconds, losses, the reloaded adapter's logits against the trained model's, memory.

and from the CPU scripts' results files:

- `data-preparation` (data_preparation.json): one rank's preparation on one core and on two, and ranks at once.
- `demo` (demo.json): the default run's held-out exact match, losses and seconds.
- `test-suite` (test_suite.json): `make test` and `make test-fast` on a fresh clone.
- `benchmark`, `ablation` (benchmark.json): the recipe against `trl sft` on CPU, and each fast path switched off.
- `memory-grid` (memory_grid.json): each case's growth per rank and phase against its plan.
- `memory-validation` (memory_validation.json): the planner against one-process runs' peak RSS.
- `load-time` (load_time.json): rank 0's load, planned and measured, and the collective timeout.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench"
sys.path.insert(0, str(REPO / "bench"))

from plan_tables import DOCUMENTS, blocks_command  # noqa: E402

TOOL = "figures.py"
LAUNCHER_NAMES = {"fsdp1-qlora-offload": "FSDP1 QLoRA + CPU offload", "fsdp2-lora": "FSDP2 LoRA",
                  "zero3-lora": "ZeRO-3 LoRA", "zero3-qlora": "ZeRO-3 QLoRA"}
METHOD_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
DATA_NAMES = {"chat": "chat lengths (LMSYS-Chat-1M)", "full": "full 4096-token sequences", "demo": "demo dates"}


def percent(value) -> str:
    return f"{value:.0%}" if value is not None else "n/a"


def speed_rows(speed: dict) -> list[tuple[str, str, dict]]:
    """(name, label, row) for each run that trained: SETUP:DATA runs, or the methods of the runs recorded before."""
    rows = []
    for name, row in speed.get("results", {}).items():
        if "error" in row:
            continue
        if "setup" in row:
            label = f"{row['setup']}, {DATA_NAMES.get(row['data'], row['data'])}"
        else:
            label = f"8B {name}, {speed['steps']} steps"
        rows.append((name, label, row))
    return rows


def tokens_per_s(row: dict) -> float:
    return row.get("steady_tokens_per_s") or row["tokens_per_s"]


def speed_table(results: dict) -> str:
    speed = results["speed"]
    trl = {row["data"]: tokens_per_s(row) for _, _, row in speed_rows(speed) if row.get("setup") == "trl"}
    lines = ["| run | attention | tokens/s | vs `trl sft` | MFU (datasheet / measured peak) | MFU, NeMo's count | "
             "first step after | GPU allocated, train: measured / planned |", "|---|---|---|---|---|---|---|---|"]
    for _, label, row in speed_rows(speed):
        ratio = (f"{tokens_per_s(row) / trl[row['data']]:.2f}x" if row.get("setup", "trl") != "trl" and
                 row.get("data") in trl else "")
        memory = (row.get("memory_against_plan") or {}).get("train")
        measured = (f"{memory['allocated_gib']:.2f} / {memory['planned_allocated_gib']:.2f} GiB" if memory else
                    f"{row['gpu_allocated_gib']:.2f} GiB" if row.get("gpu_allocated_gib") is not None else "")
        first = row.get("seconds_to_first_step")
        lines.append(f"| {label} | {row['attention']} | {tokens_per_s(row):.0f} | {ratio} | "
                     f"{percent(row.get('mfu_datasheet'))} / {percent(row.get('mfu_measured_peak'))} | "
                     f"{percent(row.get('mfu_nemo_count_datasheet'))} | "
                     f"{f'{first:.0f} s' if first is not None else ''} | {measured} |")
    return "\n".join(lines)


def speed_line(results: dict) -> str:
    speed = results["speed"]
    figures = [f"{label} {tokens_per_s(row):,.0f} tokens/s" for _, label, row in speed_rows(speed)]
    return f"{speed['date']}, one {speed['device']}, {speed['shape']} shape: " + "; ".join(figures) + "."


def profile_table(results: dict) -> str:
    lines = ["| run | step | matmuls | attention | other kernels | GPU idle | calls that waited for the GPU (in "
             "decoder layers) |", "|---|---|---|---|---|---|---|"]
    for _, label, row in speed_rows(results["speed"]):
        profile, syncs = row.get("profile"), row.get("syncs")
        if not profile:
            continue
        step = profile["step_seconds"]
        share = lambda key: percent(profile[key] / step) if profile.get(key) is not None else "n/a"  # noqa: E731
        waited = (f"{len(syncs)} ({sum(s['in_decoder_layer'] for s in syncs)})" if syncs is not None else "n/a")
        lines.append(f"| {label} | {step:.2f} s | {share('matmul_seconds')} | {share('attention_seconds')} | "
                     f"{share('other_seconds')} | {share('idle_seconds')} | {waited} |")
    return "\n".join(lines)


def launchers_table(results: dict) -> str:
    lines = ["| launcher | seconds | loss, step 1 → 5 | reloaded logits vs trained: max abs difference | "
             "GPU allocated, load: measured / planned | train: measured / planned |", "|---|---|---|---|---|---|"]
    for name, row in results.get("launchers", {}).items():
        if "losses" not in row:
            continue
        memory = row["memory_against_plan"]
        gib = lambda phase: (f"{memory[phase]['allocated_gib']:.2f} / "  # noqa: E731
                             f"{memory[phase]['planned_allocated_gib']:.2f}")
        verdict = "" if row["passed"] else " (over the 2% bound: failed)"
        lines.append(f"| {LAUNCHER_NAMES.get(name, name)} | {row['seconds']:.1f} | {row['losses'][0]:.2f} → "
                     f"{row['losses'][-1]:.2f} | {row['logits_max_abs_difference']:.3g} of "
                     f"{row['logits_max_abs']:.3g}{verdict} | {gib('load')} | {gib('train')} |")
    return "\n".join(lines)


def data_preparation_table(results: dict) -> str:
    r = results
    return "\n".join([
        "| conversations | tokens | one core | two cores | identical tokens | 2 ranks at once, a core each "
        "| ranks apart |",
        "|---|---|---|---|---|---|---|",
        f"| {r['examples']:,} | {r['tokens'] / 1e6:.1f}M | {r['seconds_one_core']} s "
        f"({r['examples_per_second_one_core']} "
        f"conversations/s) | {r['seconds_two_cores']} s ({r['two_cores_speedup']}x) | "
        f"{'yes' if r['identical_tokens'] else 'NO'} | {' s and '.join(map(str, r['seconds_together']))} s | "
        f"{r['spread_seconds']} s |"])


def machine(r: dict) -> str:
    return f"{r['date']}, {r['cores']} cores of {r['cpu']}"


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def demo_line(r: dict) -> str:
    return (f"{machine(r)} ({'bf16' if r['bf16'] else 'fp32'}): held-out exact match **{r['exact_match_before']:.1%} "
            f"before, {r['exact_match_after']:.1%} after**, train loss {r['train_loss']:.3f}, eval loss "
            f"{r['eval_loss']:.3f}, {r['seconds']:.0f} s in all.")


def test_suite_line(r: dict) -> str:
    full, fast = r["results"]["make test"], r["results"]["make test-fast"]
    failed = lambda run: f", {run['failed']} failed" if run["failed"] else ""  # noqa: E731
    return (f"{machine(r)}: `make test` {full['passed']} passed{failed(full)}, pytest {minutes(full['pytest_s'])} "
            f"({minutes(full['total_s'])} with the setup of a fresh clone); `make test-fast` {fast['passed']} passed"
            f"{failed(fast)} in {fast['pytest_s']:.0f} s.")


def benchmark_table(r: dict) -> str:
    lines = [f"{r['date']}, {r['threads']} threads, {r['precision']}, {r['steps']} steps, median of the runs; "
             f"{r['flops_per_token'] / 1e6:.0f} MFLOP per trained token:", "",
             "| setup | tokens/s | s/step | peak RSS | loss, steps 1 / 4 / 8 | FLOPs utilisation | recipe / this |",
             "|---|---|---|---|---|---|---|"]
    recipe = next(iter(r["table"].values()))["tokens_per_s"]
    for name, row in r["table"].items():
        losses = row["losses"]
        lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {row['s_per_step']:.2f} | "
                     f"{row['peak_rss_gib']:.2f} GiB | "
                     f"{losses[0]:.3f} / {losses[3]:.3f} / {losses[-1]:.3f} | {row['flops_utilisation']:.0%} | "
                     f"{recipe / row['tokens_per_s']:.2f}x |")
    lines += ["", "Every matrix product of one step timed alone at its own shape: "
              f"{r['matmul_ceiling']:.0%} utilisation if nothing else took time."]
    return "\n".join(lines)


def ablation_table(r: dict) -> str:
    lines = ["| | median seconds | vs the recipe | rounds it beat the recipe |", "|---|---|---|---|"]
    for index, (name, row) in enumerate(r["ablation"].items()):
        lines.append(f"| {name} | {row['seconds']:.2f} | {row['vs_recipe']:.2f}x | "
                     f"{row['faster_than_recipe'] if index else ''} |")
    return "\n".join(lines)


def memory_grid_table(r: dict) -> str:
    """Each case's growth per rank and phase, planned / measured GiB, the error shown where it passes 10%."""
    phases = ["rank 0 load", "rank 0 train", "rank 1 load", "rank 1 train"]
    lines = [r["measured"], "", "| case | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for case in r["results"]:
        cells = []
        for phase in phases:
            value = case.get("phases", {}).get(phase)
            if value is None:
                cells.append("")
                continue
            error = (value["measured"] - value["planned"]) / value["planned"] if value["planned"] else 0
            cells.append(f"{value['planned']:.2f} / {value['measured']:.2f}" + (f" ({error:+.0%})" if abs(error) > 0.1
                                                                               and value["planned"] > 0.1 else ""))
        lines.append(f"| {case['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_validation_table(runs: list) -> str:
    lines = ["| run | process | weights | training | peak | error |", "|---|---|---|---|---|---|"]
    for run in runs:
        pair = lambda key: f"{run[key][0]:.2f} / {run[key][1]:.2f}"  # noqa: E731
        error = run["peak"][0] / run["peak"][1] - 1
        lines.append(f"| {run['run']} | {pair('process')} | {pair('weights')} | {pair('training')} | {pair('peak')} | "
                     f"{error:+.0%} |")
    return "\n".join(lines)


def load_time_line(r: dict) -> str:
    runs = "; ".join(f"{METHOD_NAMES[method]} planned {run['planned_s']:.1f} s, measured "
                     f"{run['measured_s']:.1f} s ({run['ratio']:.2f}), collective timeout "
                     f"{run['collective_timeout_s']} s"
                     f"{'' if run['covered'] else ' (NOT covered)'}" for method, run in r["runs"].items())
    return f"{r['date']}, {r['cores']} cores, a {r['checkpoint_gib']} GiB checkpoint: {runs}."


KINDS = {"speed": speed_table, "speed-line": speed_line, "profile": profile_table, "launchers": launchers_table,
         "data-preparation": data_preparation_table, "demo": demo_line, "test-suite": test_suite_line,
         "benchmark": benchmark_table, "ablation": ablation_table, "memory-grid": memory_grid_table,
         "memory-validation": memory_validation_table, "load-time": load_time_line}


def merged(files: list[str]) -> dict | list:
    """The results of one file, or of several runs in order: a later run's entries replace an earlier one's (each
    launcher's latest row, for example)."""
    results = [json.loads((RESULTS / file).read_text()) for file in files]
    if len(results) == 1:
        return results[0]
    out: dict = {}
    for result in results:
        for key, value in result.items():
            out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def block(name: str) -> str:
    """Block `name` ("KIND FILE.json [FILE.json ...]") made from its results files; empty while a file is not there
    yet (a script whose first run is still to come publishes nothing)."""
    kind, *files = name.split()
    if not all((RESULTS / file).is_file() for file in files):
        return ""
    return KINDS[kind](merged(files))


def written_names() -> list[str]:
    pattern = re.compile(rf"<!-- {re.escape(TOOL)}: ([^>]+?) -->")
    return [name for document in DOCUMENTS for name in pattern.findall(document.read_text())]


def blocks() -> dict[str, str]:
    return {name: block(name) for name in written_names()}


def main(argv: list[str] | None = None) -> None:
    blocks_command(blocks, __doc__, argv, TOOL)


if __name__ == "__main__":
    main()

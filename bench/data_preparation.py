"""How long data preparation takes on one rank with one core and with two, and how far apart ranks finish it.

train.py prepares the data on every rank in parallel (load, check, tokenize: training_data.prepare), after the
process group exists and before the first collective (the weights' broadcast from rank 0). No rank waits for another
while it tokenizes; at the first collective a rank waits only for the slowest one, so the collective timeout
(--ddp_timeout) must cover the ranks' difference, not the whole preparation. The other choice, rank 0 first and the
others reading its cache, would make every other rank wait in a barrier for all of it. Each rank tokenizes with the
cores it has (configuration.data_processes: the machine's cores over its ranks, or --dataset_num_proc).

This writes N chat conversations shaped like ultrachat's (3 user/assistant turns, about 1,360 tokens each in all:
random words, so the tokenizer does the work of real text), then times `prepare` with the SmolLM2 tokenizer: one rank
held to one core (one process), the same rank with two cores (two tokenizing processes), the tokens of both compared;
then P ranks started together (as the ranks of one machine are), each with its share of the cores:

    .venv/bin/python bench/data_preparation.py --examples 200000 --processes 2

Prints one JSON line: examples, tokens, seconds on one core and on two, whether their tokens are identical, each
rank's seconds together, and the spread."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS_PER_TURN = {"user": 60, "assistant": 180}


def write_conversations(path: Path, examples: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    vocabulary = [f"{rng.choice('bcdfghklmnprstvw')}{rng.choice('aeiou')}{rng.choice('nrstl')}"
                  f"{rng.choice(['', 'ing', 'ed', 's', 'er'])}" for _ in range(5000)]
    with open(path, "w") as f:
        for _ in range(examples):
            messages = [{"role": role, "content": " ".join(rng.choices(vocabulary, k=WORDS_PER_TURN[role])) + "."}
                        for _ in range(3) for role in ("user", "assistant")]
            f.write(json.dumps({"messages": messages}) + "\n")


def prepare_once(data_dir: str, cores: int, pin: bool = True, per_process: int | None = None, queue=None) -> dict:
    """train.py's preparation of the train split with `cores` tokenizing processes (held to that many cores where
    `pin`: ranks started together are left to the scheduler, as train.py's are), timed from the start of loading to
    the tokenized dataset; a digest of its tokens and labels. `per_process`: the fewest examples a tokenizing process
    takes (training_data.EXAMPLES_PER_PROCESS unless given)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import hashlib

    import datasets

    from recipe.settings.arguments import ModelArguments
    from recipe.model.model_files import convert_default_model
    from recipe.data import training_data
    from recipe.data.training_data import prepare
    from recipe.model.tokenizer import build_tokenizer

    if per_process is not None:
        training_data.EXAMPLES_PER_PROCESS = per_process
    if pin:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])  # the workers it forks inherit it
    datasets.disable_caching()  # every run tokenizes, as a first run on a fresh cache does
    datasets.disable_progress_bars()
    convert_default_model()
    tokenizer, _ = build_tokenizer(ModelArguments())  # the default model's, as train.py builds it
    started = time.perf_counter()
    data = prepare(data_dir, ["train"], tokenizer, max_length=2048, truncate=True, num_proc=cores)
    seconds = time.perf_counter() - started
    train = data.datasets["train"].data
    digest = hashlib.sha256()
    for column in ("input_ids", "labels"):
        for chunk in train.column(column).chunks:  # the values as stored, chunk boundaries aside
            digest.update(chunk.flatten().to_numpy().tobytes())
    result = {"seconds": seconds, "tokens": data.counts["tokens"], "examples": data.counts["examples"],
              "digest": digest.hexdigest()}
    if queue is not None:
        queue.put(result)
    return result


def in_process(target, *args):
    """`target(*args)` in a fresh process (its own affinity), started as a rank is: its result."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=args, kwargs={"queue": queue})
    process.start()
    result = queue.get()
    process.join()
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--processes", type=int, default=2, help="ranks started together; 0: one rank only")
    parser.add_argument("--examples_per_process", type=int, help="the fewest examples a tokenizing process takes "
                        "(default: training_data.EXAMPLES_PER_PROCESS)")
    args = parser.parse_args(argv)
    from recipe.platform.hardware import usable_cores

    cpus = usable_cores()
    with tempfile.TemporaryDirectory() as folder:
        write_conversations(Path(folder) / "train.jsonl", args.examples)
        one = in_process(prepare_once, folder, 1, True, args.examples_per_process)
        two = in_process(prepare_once, folder, 2, True, args.examples_per_process) if cpus >= 2 else None
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        share = max(1, cpus // max(args.processes, 1))
        ranks = [context.Process(target=prepare_once, args=(folder, share), kwargs={"pin": False, "queue": queue})
                 for _ in range(args.processes)]
        for rank in ranks:
            rank.start()
        together = [queue.get()["seconds"] for _ in ranks]
        for rank in ranks:
            rank.join()
    result = {"examples": one["examples"], "tokens": one["tokens"], "cpus": cpus,
              "seconds_one_core": round(one["seconds"], 1),
              "examples_per_second_one_core": round(one["examples"] / one["seconds"])}
    if two is not None:
        result.update(seconds_two_cores=round(two["seconds"], 1),
                      two_cores_speedup=round(one["seconds"] / two["seconds"], 2),
                      identical_tokens=one["digest"] == two["digest"])
    if together:
        result.update(seconds_together=sorted(round(s, 1) for s in together),
                      spread_seconds=round(max(together) - min(together), 1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""How long data preparation takes on each rank, and how far apart the ranks finish it.

train.py prepares the data on every rank in parallel (load, check, tokenize: training_data.prepare), after the
process group exists and before the first collective (the weights' broadcast from rank 0). No rank waits for another
while it tokenizes; at the first collective a rank waits only for the slowest one, so the collective timeout
(--ddp_timeout) must cover the ranks' difference, not the whole preparation. The other choice, rank 0 first and the
others reading its cache, would make every other rank wait in a barrier for all of it.

This writes N chat conversations shaped like ultrachat's (3 user/assistant turns, about 1,000 tokens each in all:
random words, so the tokenizer does the work of real text), then times `prepare` with the SmolLM2 tokenizer in one
process, and in P processes started together (as the ranks of one machine are):

    .venv/bin/python bench/data_preparation.py --examples 200000 --processes 2

Prints one JSON line: examples, tokens, seconds alone, each process's seconds together, and the spread."""

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


def prepare_once(data_dir: str, queue=None) -> dict:
    """train.py's preparation of the train split, timed from the start of loading to the tokenized dataset."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    from arguments import ModelArguments
    from model_files import convert_default_model
    from training_data import prepare
    from utils import build_tokenizer

    datasets.disable_caching()  # every run tokenizes, as a first run on a fresh cache does
    datasets.disable_progress_bars()
    convert_default_model()
    tokenizer, _ = build_tokenizer(ModelArguments())  # the default model's, as train.py builds it
    started = time.perf_counter()
    data = prepare(data_dir, ["train"], tokenizer, max_length=2048, truncate=True)
    result = {"seconds": time.perf_counter() - started, "tokens": data.counts["tokens"],
              "examples": data.counts["examples"]}
    if queue is not None:
        queue.put(result)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--processes", type=int, default=2, help="0: one process alone only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        write_conversations(Path(folder) / "train.jsonl", args.examples)
        alone = prepare_once(folder)
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        ranks = [context.Process(target=prepare_once, args=(folder, queue)) for _ in range(args.processes)]
        for rank in ranks:
            rank.start()
        together = [queue.get()["seconds"] for _ in ranks]
        for rank in ranks:
            rank.join()
    result = {"examples": alone["examples"], "tokens": alone["tokens"], "seconds_alone": round(alone["seconds"], 1),
              "examples_per_second_alone": round(alone["examples"] / alone["seconds"]), "cpus": os.cpu_count()}
    if together:
        result.update(seconds_together=sorted(round(s, 1) for s in together),
                      spread_seconds=round(max(together) - min(together), 1))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

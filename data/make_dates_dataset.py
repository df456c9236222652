"""Generate the demo chat dataset: rewrite a date written in everyday English as an ISO 8601 date.

SmolLM2-135M-Instruct gets this wrong out of the box (it answers in prose, pads no zeros, guesses the
year); a few dozen LoRA steps on CPU teach it. The train and held-out splits use disjoint dates, so
the held-out exact match measures the skill, not memorised answers.

    python data/make_dates_dataset.py            # rewrites data/dates/{train,test}.jsonl
"""

import argparse
import calendar
import datetime
import json
import random
from pathlib import Path

PROMPT = "Convert this date to ISO format (YYYY-MM-DD): {date}"

# Everyday ways to write a date; each takes a datetime.date and returns text.
_ORDINAL_SUFFIX = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}
STYLES = [
    lambda d: f"{calendar.month_name[d.month]} {d.day}, {d.year}",
    lambda d: f"{d.day} {calendar.month_name[d.month]} {d.year}",
    lambda d: f"{calendar.month_abbr[d.month]} {d.day} {d.year}",
    lambda d: f"the {d.day}{_ORDINAL_SUFFIX.get(d.day, 'th')} of {calendar.month_name[d.month]}, {d.year}",
    lambda d: f"{calendar.day_name[d.weekday()]}, {calendar.month_name[d.month]} {d.day}, {d.year}",
    lambda d: f"{d.year}, {calendar.month_name[d.month]} {d.day}",
]


def make_example(date: datetime.date, style: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": PROMPT.format(date=STYLES[style](date))},
            {"role": "assistant", "content": date.isoformat()},
        ]
    }


def make_splits(n_train: int, n_test: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    first, last = datetime.date(1950, 1, 1).toordinal(), datetime.date(2049, 12, 31).toordinal()
    ordinals = rng.sample(range(first, last + 1), n_train + n_test)  # distinct dates: no test date is seen in training
    dates = [datetime.date.fromordinal(o) for o in ordinals]
    examples = [make_example(d, rng.randrange(len(STYLES))) for d in dates]
    return {"train": examples[:n_train], "test": examples[n_train:]}


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default=str(Path(__file__).parent / "dates"))
    parser.add_argument("--n_train", type=int, default=512)
    parser.add_argument("--n_test", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, rows in make_splits(args.n_train, args.n_test, args.seed).items():
        write_jsonl(rows, Path(args.out_dir) / f"{split}.jsonl")
        print(f"wrote {len(rows)} examples to {Path(args.out_dir) / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()

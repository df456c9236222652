"""Bad data, reported loudly: every malformed example is named by file and line (or row) with what is wrong.

By default the run stops before any weights load; with `--bad_examples skip` the bad examples are left out and
counted by reason. Nothing is dropped silently: the examples and tokens actually trained on are reported.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ORIGIN = "_origin"  # column holding "file:line" (or "source[row N]") for every example until tokenization
ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class BadExample:
    origin: str
    reason: str

    def __str__(self) -> str:
        return f"{self.origin}: {self.reason}"


class DataError(ValueError):
    """Bad examples under --bad_examples stop."""

    def __init__(self, bad: list[BadExample], total: int):
        shown = "\n  ".join(str(b) for b in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        super().__init__(f"{len(bad)} of {total} examples are malformed:\n  {shown}{more}\nFix the data, or pass "
                         "--bad_examples skip to train without them (they are counted and reported).")
        self.bad = bad


def read_json_records(path: Path) -> tuple[list[dict], list[BadExample]]:
    """A .jsonl file line by line (or a .json list), so each problem has its line number."""
    raw = path.read_bytes()
    records, bad = [], []
    if path.suffix == ".json" and raw.lstrip()[:1] == b"[":
        try:
            rows = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return [], [BadExample(f"{path.name}", f"not valid JSON: {err}")]
        return [{**row, ORIGIN: f"{path.name}[{i}]"} if isinstance(row, dict) else row
                for i, row in enumerate(rows)], []
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        origin = f"{path.name}:{number}"
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            bad.append(BadExample(origin, f"not UTF-8 text (byte {err.start}: {line[err.start:err.start + 1]!r})"))
            continue
        except json.JSONDecodeError as err:
            bad.append(BadExample(origin, f"not valid JSON ({err.msg} at column {err.colno})"))
            continue
        if not isinstance(row, dict):
            bad.append(BadExample(origin, f"a JSON {type(row).__name__}, not an object"))
            continue
        records.append({**row, ORIGIN: origin})
    return records, bad


def check_messages(messages, where: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"{where} is not a non-empty list of messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return f"{where}[{i}] lacks a role or content"
        if message["role"] not in ROLES:
            return f"{where}[{i}] has unknown role {message['role']!r} (use {', '.join(sorted(ROLES))})"
        if not isinstance(message["content"], str):
            return f"{where}[{i}] content is not text"
    return None


def check_example(row: dict, data_format: str, text_field: str) -> str | None:
    """What is wrong with one raw example, or None."""
    if data_format == "conversational":
        problem = check_messages(row.get("messages"), "messages")
        if problem:
            return problem
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        if not answers:
            return "no assistant turn: nothing to learn from"
        if any(not m["content"].strip() for m in answers):
            return "an empty assistant turn"
        return None
    if data_format == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            return check_messages(prompt, "prompt") or check_messages(completion, "completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            return "prompt or completion is missing or not text"
        return None if completion.strip() else "an empty completion"
    text = row.get(text_field)
    if not isinstance(text, str) or not text.strip():
        return f"{text_field!r} is missing, empty or not text"
    return None


def too_long(example: dict, max_length: int | None) -> str | None:
    """An example whose supervised tokens would be cut off by truncation to max_length."""
    if not max_length or len(example["input_ids"]) <= max_length:
        return None
    last_supervised = max(i for i, label in enumerate(example["labels"]) if label != -100)
    if last_supervised < max_length:
        return None
    return f"{len(example['input_ids'])} tokens, longer than --max_length {max_length}: its answer would be cut"


def summarize(bad: list[BadExample]) -> str:
    reasons = Counter(b.reason.split(" (")[0].split(":")[0] for b in bad)
    return ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())

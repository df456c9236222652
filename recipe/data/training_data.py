"""The training data: loading, bad examples named by file and line, tokenization with loss masks, and what packing and
padding-free batches need before TRL sees the data.

- Sources: a Hub dataset (offline: from the cache), a folder of `train`/`test`/`validation` files (`.jsonl`, `.json`,
  `.csv`, `.parquet`), a single such file (train only), or a `save_to_disk` folder.
- Formats: conversational (`messages`), prompt/completion, plain text. Chat data is supervised on the assistant turns
  only, with any chat template: the turns are located by rendering each conversation's prefixes. Two common shapes
  become chat messages as they load (CONVERSIONS): ShareGPT (`conversations` of `from`/`value`) and Alpaca
  (`instruction`, optional `input`, `output`).
- Bad data is reported loudly: every malformed example is named by file and line (or row) with what is wrong. The run
  stops before any weights load (`--bad_examples stop`), or leaves them out and counts them by reason (`skip`).

Every function takes plain values (paths, split names, a tokenizer, lengths), so tests call them directly.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IGNORE_INDEX = -100  # labels the loss skips
ORIGIN = "_origin"  # column holding "file:line" (or "source[row N]") for every example until tokenization
ROLES = {"system", "user", "assistant", "tool"}


@dataclass(frozen=True)
class BadExample:
    origin: str
    reason: str
    lost: int = 0  # an example longer than --max_length: the supervised tokens truncation cuts off

    def __str__(self) -> str:
        return f"{self.origin}: {self.reason}"


class DataError(ValueError):
    """Bad examples under --bad_examples stop."""

    def __init__(self, bad: list[BadExample], total: int):
        shown = "\n  ".join(str(b) for b in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        malformed, long = any(not b.lost for b in bad), any(b.lost for b in bad)
        fixes = ["fix the data, or pass --bad_examples skip to train without them (counted and reported)"] * malformed
        fixes += ["raise --max_length, or pass --long_examples truncate (train on what fits, as TRL does) or skip "
                  "(leave them out); either is counted and reported"] * long
        what = "malformed or too long" if malformed and long else "malformed" if malformed else "too long"
        super().__init__(f"{len(bad)} of {total} examples are {what}:\n  {shown}{more}\n"
                         + "; ".join(fixes).capitalize() + ".")
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


# ShareGPT's speakers as chat roles; any other speaker is a bad example, named with its line
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CONVERSIONS = {  # source shape: (the columns that identify it, what the run prints about the mapping)
    "sharegpt": ({"conversations"}, "ShareGPT conversations as chat messages: from/value -> role/content, human -> "
                 "user, gpt -> assistant, system -> system"),
    "alpaca": ({"instruction", "output"}, "Alpaca as chat messages: instruction (+ a blank line and input, when not "
               "empty) -> user, output -> assistant"),
}


def sharegpt_messages(row: dict) -> tuple[list[dict] | None, str | None]:
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None, "conversations is not a non-empty list of turns"
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            return None, f"conversations[{i}] lacks from or value"
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            return None, (f"conversations[{i}] is from {turn['from']!r}, which has no chat role (known: "
                          f"{', '.join(sorted(SHAREGPT_ROLES))})")
        messages.append({"role": role, "content": turn["value"]})
    return messages, None


def alpaca_messages(row: dict) -> tuple[list[dict] | None, str | None]:
    instruction, extra, output = row.get("instruction"), row.get("input") or "", row.get("output")
    if not isinstance(instruction, str) or not instruction.strip():
        return None, "instruction is missing, empty or not text"
    if not isinstance(extra, str) or not isinstance(output, str):
        return None, "input or output is not text"
    prompt = instruction + (f"\n\n{extra}" if extra.strip() else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}], None


def as_messages(row: dict, source_format: str) -> tuple[dict, str | None]:
    """A ShareGPT or Alpaca row as a chat row (`messages`, its origin kept), or the row and what is wrong with it."""
    convert = sharegpt_messages if source_format == "sharegpt" else alpaca_messages
    messages, problem = convert(row)
    return ({"messages": messages, ORIGIN: row[ORIGIN]}, None) if messages is not None else (row, problem)


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


def too_long(example: dict, max_length: int | None) -> BadExample | None:
    """An example whose supervised tokens would be cut off by truncation to max_length, with how many."""
    if not max_length or len(example["input_ids"]) <= max_length:
        return None
    lost = sum(label != IGNORE_INDEX for label in example["labels"][max_length:])
    if not lost:
        return None
    return BadExample(example[ORIGIN], f"{len(example['input_ids'])} tokens, longer than --max_length {max_length}: "
                      f"truncation cuts {lost} supervised tokens", lost)


def summarize(bad: list[BadExample]) -> str:
    reasons = Counter(b.reason.split(" (")[0].split(":")[0] for b in bad)
    return ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())


DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _read_split(source: Path, split: str, dataset_name: str, token: str | None = None):
    """One split as JSON records (local .json/.jsonl: read line by line, so problems have line numbers) or as a
    Dataset (CSV, Parquet, save_to_disk folders, the Hub), plus the lines that could not be parsed."""
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    if source.is_file():
        if source.suffix not in DATA_SUFFIXES:
            raise ValueError(f"{source} is not a {', '.join(DATA_SUFFIXES)} file; convert it to one of those.")
        file = source
    elif source.is_dir():
        if (source / "dataset_dict.json").is_file() or (source / "dataset_info.json").is_file():
            saved = load_from_disk(str(source))
            saved = DatasetDict(train=saved) if isinstance(saved, Dataset) else saved
            if split not in saved:
                raise ValueError(f"{source} has splits {list(saved)}, not {split}; adjust --splits.")
            return saved[split], []
        if (source / split / "dataset_info.json").is_file():  # the reference recipe's layout: one folder a split
            return load_from_disk(str(source / split)), []
        files = [source / f"{split}{suffix}" for suffix in DATA_SUFFIXES if (source / f"{split}{suffix}").is_file()]
        if not files:
            raise ValueError(f"{source} has no {split}.jsonl/.json/.csv/.parquet file; add it or adjust --splits.")
        file = files[0]
    else:  # a Hub dataset; offline this reads the local cache
        return load_dataset(dataset_name, split=split, token=token), []
    if DATA_SUFFIXES[file.suffix] == "json":
        return read_json_records(file)
    return load_dataset(DATA_SUFFIXES[file.suffix], data_files=str(file), split="train"), []


def load_splits(dataset_name: str, splits: list[str], text_field: str = "text", token: str | None = None):
    """The requested splits, checked example by example.

    Returns a DatasetDict (only the columns the format needs, plus each example's origin "file:line"), the bad
    examples found (unparseable lines, wrong structure, unknown roles, empty answers), and the data format."""
    from datasets import Dataset, DatasetDict

    source = Path(dataset_name).expanduser()
    if source.is_file() and splits != ["train"]:
        raise ValueError(f"{source} is a single file, read as the train split; pass --splits train, or point "
                         "--dataset_name to a folder holding train.jsonl and test.jsonl.")
    out, bad, data_format, source_format = DatasetDict(), [], None, None
    for split in splits:
        rows, unreadable = _read_split(source, split, dataset_name, token)
        bad += unreadable
        if isinstance(rows, Dataset):
            name = source.name or dataset_name
            rows = [{**row, ORIGIN: f"{name}:{split}[row {i}]"} for i, row in enumerate(rows)]
        if data_format is None:
            keys = sorted({key for row in rows[:100] for key in row} - {ORIGIN})
            source_format = detect_format(keys, text_field)
            data_format = "conversational" if source_format in CONVERSIONS else source_format
        columns = {"conversational": ["messages"], "prompt_completion": ["prompt", "completion"],
                   "text": [text_field]}[data_format]
        good = []
        for row in rows:
            problem = None
            if source_format in CONVERSIONS:
                row, problem = as_messages(row, source_format)
            problem = problem or check_example(row, data_format, text_field)
            if problem:
                bad.append(BadExample(row[ORIGIN], problem))
                continue
            if data_format == "conversational":  # role and content only: extra keys may differ in type per row
                row = {**row, "messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}
            good.append({key: row[key] for key in (*columns, ORIGIN)})
        if not good:
            raise ValueError(f"the {split} split has no usable example ({len(rows)} read); "
                             + (f"first problem: {bad[0]}" if bad else "it is empty"))
        out[split] = Dataset.from_list(good)
    return out, bad, data_format, source_format


def detect_format(column_names: list[str], text_field: str) -> str:
    """conversational (`messages`), prompt_completion (`prompt` + `completion`), text (`text_field`), or a shape
    converted to chat messages as it loads: sharegpt (`conversations`), alpaca (`instruction` + `output`)."""
    if "messages" in column_names:
        return "conversational"
    if "prompt" in column_names and "completion" in column_names:
        return "prompt_completion"
    for source_format, (columns, _) in CONVERSIONS.items():
        if columns <= set(column_names):
            return source_format
    if text_field in column_names:
        return "text"
    raise ValueError(
        f"the dataset has columns {column_names}, none of which the recipe reads; give it a `messages` column (chat), "
        "`prompt` and `completion` columns, ShareGPT `conversations`, Alpaca `instruction`/`input`/`output`, or a "
        f"text column named by --dataset_text_field (now {text_field!r})."
    )


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def chat_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and return it with the character spans of the assistant turns (the supervised text).

    Works with any chat template that renders a conversation's prefix as a prefix of the whole: each assistant turn
    starts where the prompt up to it (with the generation prompt) ends, and ends after its end-of-turn token."""
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
        rendered_through = _render(tokenizer, messages[: i + 1])
        if not text.startswith(rendered_through) or start > len(rendered_through):
            raise ValueError("the chat template renders a conversation's beginning differently from the whole "
                             "conversation, so assistant turns cannot be located; use --chat_template_format chatml.")
        end = len(rendered_through)
        # Stop supervision after the end-of-turn token: what follows it (a newline) is the template's, not the model's
        eos = tokenizer.eos_token
        if eos and eos in text[start:end]:
            end = text.rindex(eos, start, end) + len(eos)
        spans.append((start, end))
    return text, spans


def tokenize_with_spans(tokenizer, text: str, spans: list[tuple[int, int]], add_special_tokens: bool) -> dict:
    """Token ids of `text` and labels that keep only tokens starting inside a supervised span."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return {"input_ids": encoded["input_ids"],
            "labels": supervised_labels(encoded["input_ids"], encoded["offset_mapping"], spans)}


def supervised_labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Each token's id where it starts inside one of `spans` (character ranges), else IGNORE_INDEX. One pass over
    tokens and spans together (token starts rise through the text): a check of every span per token was half of a
    chat dataset's preparation time."""
    spans, labels, i, previous = sorted(spans), [], 0, -1
    for token_id, (start, end) in zip(ids, offsets):
        if start < previous:  # a special token's (0, 0) after the text: look from the first span again
            i = 0
        previous = start
        while i < len(spans) and spans[i][1] <= start:
            i += 1
        supervised = end > start and i < len(spans) and spans[i][0] <= start
        labels.append(token_id if supervised else IGNORE_INDEX)
    return labels


def tokenize_example(example: dict, tokenizer, data_format: str, text_field: str,
                     add_special_tokens: bool, append_concat_token: bool) -> dict:
    eos = tokenizer.eos_token if append_concat_token else ""
    if data_format == "conversational":
        text, spans = chat_spans(tokenizer, example["messages"])
        return tokenize_with_spans(tokenizer, text, spans, add_special_tokens=False)
    if data_format == "prompt_completion":
        prompt, completion = example["prompt"], example["completion"]
        if isinstance(prompt, list):  # conversational prompt/completion: the template renders both
            text, spans = chat_spans(tokenizer, prompt + completion)
            spans = [span for span in spans if span[0] >= len(_render(tokenizer, prompt, add_generation_prompt=True))]
            return tokenize_with_spans(tokenizer, text, spans, add_special_tokens=False)
        text = prompt + completion + (eos if not completion.endswith(eos) else "")
        return tokenize_with_spans(tokenizer, text, [(len(prompt), len(text))], add_special_tokens)
    text = example[text_field]
    text = text + (eos if not text.endswith(eos) else "")
    return tokenize_with_spans(tokenizer, text, [(0, len(text))], add_special_tokens)


def tokenize_splits(raw, data_format: str, tokenizer, *, max_length: int | None, truncate: bool,
                    text_field: str = "text", add_special_tokens: bool = False,
                    append_concat_token: bool = True, num_proc: int = 1) -> tuple[dict, list[BadExample]]:
    """Tokenize every split into `input_ids` + `labels`, and cut examples to `max_length` where `truncate` (padding-free
    batches: TRL refuses to truncate them; packing cuts its own rows, so it passes False).

    `num_proc` processes each tokenize a contiguous part, in order (the same tokens as one). Returns the tokenized
    splits (with each example's origin) and the examples whose answer truncation to max_length would cut, as bad
    examples."""
    if data_format == "conversational" and add_special_tokens:  # False, the reference recipe's value, is chat's own
        raise ValueError("--add_special_tokens true applies to text and prompt/completion data; chat data takes its "
                         "special tokens from the chat template (the tokenizer would add a second BOS). Drop the "
                         "flag, or choose the template with --chat_template_format.")
    tokenized, bad = {}, []
    for split, dataset in raw.items():
        dataset = map_in_processes(
            dataset, tokenize_example, processes_for(len(dataset), num_proc), desc=f"Tokenizing {split}",
            fn_kwargs=dict(tokenizer=tokenizer, data_format=data_format, text_field=text_field,
                           add_special_tokens=add_special_tokens, append_concat_token=append_concat_token),
            remove_columns=[c for c in dataset.column_names if c != ORIGIN])
        lengths = token_lengths(dataset)  # read from the columns: decoding every example is a second pass
        longest = max(lengths, default=0)
        if max_length:
            bad += filter(None, (too_long(dataset[i], max_length) for i, n in enumerate(lengths) if n > max_length))
        if truncate and max_length and longest > max_length:
            dataset = dataset.map(truncate_example, fn_kwargs={"max_length": max_length}, desc=f"Truncating {split}")
        tokenized[split] = dataset
    return tokenized, bad


# Fewer examples than this per process are tokenized in this one alone (a worker's start and its part's trip
# through the disk cost a fraction of a second)
EXAMPLES_PER_PROCESS = 1000


def processes_for(examples: int, processes: int) -> int:
    """How many processes tokenize `examples`, given `processes` to use."""
    return max(1, min(processes, examples // EXAMPLES_PER_PROCESS))


def map_in_processes(dataset, function, processes: int, desc: str, **map_options):
    """`dataset.map(function, **map_options)`, each of `processes` forked workers mapping a contiguous part, joined in
    order: the same rows as one process. Not `map(num_proc=...)`: datasets' pool sends results through a manager
    process, and its two workers were 1.6 times as fast as one on 6,000 conversations where two forked workers were
    1.95 times (2.05 on 200,000: bench/data_preparation.json). A worker's error is raised here as it was raised
    there."""
    if processes <= 1:
        return dataset.map(function, desc=desc, **map_options)
    import multiprocessing

    from datasets import Dataset, concatenate_datasets

    folder = Path(tempfile.mkdtemp(prefix="recipe-map-"))
    try:
        print(f"{desc}: {len(dataset)} examples in {processes} processes", flush=True)
        workers = [multiprocessing.get_context("fork").Process(
            target=_map_part, args=(dataset, index, processes, function, map_options, folder))
            for index in range(processes)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        for index, worker in enumerate(workers):
            if (folder / f"{index}.error").is_file():
                raise pickle.loads((folder / f"{index}.error").read_bytes())
            if worker.exitcode != 0:
                raise RuntimeError(f"{desc}: worker {index} of {processes} ended with exit code {worker.exitcode}")
        # Memory-mapped, as one process's map cache is: the files stay readable once their folder is removed below
        return concatenate_datasets([Dataset.from_file(str(folder / f"{index}.arrow")) for index in range(processes)])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _map_part(dataset, index: int, parts: int, function, map_options: dict, folder: Path) -> None:
    """One worker's part, written once: straight to the Arrow file the parent maps (no second copy)."""
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # one line from the parent instead of a bar per worker
    try:
        dataset.shard(parts, index, contiguous=True).map(function, cache_file_name=str(folder / f"{index}.arrow"),
                                                         **map_options)
    except BaseException as err:
        try:
            error = pickle.dumps(err)
        except Exception:
            error = pickle.dumps(RuntimeError(f"{type(err).__name__}: {err}"))
        (folder / f"{index}.error").write_bytes(error)
        raise


def truncate_example(example: dict, max_length: int) -> dict:
    return {"input_ids": example["input_ids"][:max_length], "labels": example["labels"][:max_length]}


def drop_bad(tokenized: dict, bad: list) -> dict:
    """Leave the bad examples out (--bad_examples skip); returns the remaining splits without the origin column."""
    origins = {b.origin for b in bad}
    return {split: (dataset.filter(lambda origin: origin not in origins, input_columns=ORIGIN) if origins else dataset)
            .remove_columns(ORIGIN) for split, dataset in tokenized.items()}


def token_lengths(dataset) -> list[int]:
    """Each example's token count, from the Arrow column."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.data.column("input_ids")).to_pylist()


def token_counts(dataset) -> dict:
    import pyarrow.compute as pc

    lengths = token_lengths(dataset)
    labels = pc.list_flatten(dataset.data.column("labels"))
    return {"examples": len(lengths), "tokens": sum(lengths),
            "supervised_tokens": pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0,
            "longest": max(lengths, default=0)}


def first_examples(dataset, count: int):
    """The first `count` rows of a datasets.Dataset (all of them when it has fewer)."""
    return dataset.select(range(min(count, len(dataset))))


@dataclass
class TrainingData:
    raw: Any  # the checked, untokenized splits (held-out prompts come from here)
    datasets: dict  # the tokenized splits, bad examples left out
    data_format: str
    counts: dict  # examples, tokens and supervised tokens of the train split
    skipped: list[BadExample]  # bad examples left out (--bad_examples skip, --long_examples skip)
    truncated: list[BadExample] = field(default_factory=list)  # trained cut to --max_length (--long_examples truncate)
    converted_from: str | None = None  # sharegpt / alpaca: the shape the rows had before they became chat messages

    def evaluation(self, split: str | None, limit: int | None = None):
        """The tokenized eval split, or its first `limit` examples (None without an eval split)."""
        dataset = self.datasets.get(split) if split else None
        return first_examples(dataset, limit) if dataset is not None and limit is not None else dataset

    @property
    def conversion(self) -> str | None:
        """What the rows' conversion to chat messages did, for the run's log."""
        return CONVERSIONS[self.converted_from][1] if self.converted_from else None


def prepare(dataset_name: str, splits: list[str], tokenizer, *, max_length: int | None, truncate: bool,
            bad_examples: str = "stop", long_examples: str = "truncate", text_field: str = "text",
            add_special_tokens: bool = False, append_concat_token: bool = True,
            token: str | None = None, num_proc: int = 1) -> TrainingData:
    """Load, check and tokenize. Raises DataError naming every malformed example under `bad_examples="stop"` and
    every example truncation would cut under `long_examples="stop"`; ValueError for a source or format problem."""
    raw, malformed, data_format, source_format = load_splits(dataset_name, splits, text_field, token)
    tokenized, long = tokenize_splits(raw, data_format, tokenizer, max_length=max_length, truncate=truncate,
                                      text_field=text_field, add_special_tokens=add_special_tokens,
                                      append_concat_token=append_concat_token, num_proc=num_proc)
    stopping = (malformed if bad_examples == "stop" else []) + (long if long_examples == "stop" else [])
    if stopping:
        raise DataError(stopping, sum(len(split) for split in raw.values()) + len(malformed))
    left_out = malformed + (long if long_examples == "skip" else [])
    datasets = drop_bad(tokenized, left_out)
    return TrainingData(raw, datasets, data_format, token_counts(datasets["train"]), left_out,
                        long if long_examples == "truncate" else [],
                        source_format if source_format in CONVERSIONS else None)

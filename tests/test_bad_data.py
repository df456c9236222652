"""Bad data: each kind of malformed example is named by file and line; stop by default, or skip and count."""

import json
import random

import pytest
from conftest import tiny_run_args

from recipe.data.training_data import BadExample, DataError, load_splits, tokenize_splits

GOOD = {"messages": [{"role": "user", "content": "Convert 1 May 2000"}, {"role": "assistant", "content": "2000-05-01"}]}
BAD_LINES = {
    "malformed JSON": ('{"messages": [', "not valid JSON"),
    "missing column": (json.dumps({"mesages": GOOD["messages"]}), "messages is not a non-empty list"),
    "unknown role": (json.dumps({"messages": [{"role": "human", "content": "x"}, GOOD["messages"][1]]}),
                     "unknown role 'human'"),
    "empty assistant turn": (json.dumps({"messages": [GOOD["messages"][0], {"role": "assistant", "content": " "}]}),
                             "an empty assistant turn"),
    "no assistant turn": (json.dumps({"messages": GOOD["messages"][:1]}), "no assistant turn"),
    "content not text": (json.dumps({"messages": [GOOD["messages"][0], {"role": "assistant", "content": 5}]}),
                         "content is not text"),
    "not an object": ("[1, 2]", "a JSON list, not an object"),
}


def write(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")


def load(path, max_length=512, tokenizer=None):
    raw, bad, data_format, _ = load_splits(str(path), ["train"])
    if tokenizer is not None:
        _, cut = tokenize_splits(raw, data_format, tokenizer, max_length=max_length, truncate=True)
        bad += cut
    return raw, bad


@pytest.mark.parametrize("kind", BAD_LINES)
def test_each_kind_is_reported_with_file_and_line(tmp_path, kind):
    line, reason = BAD_LINES[kind]
    write(tmp_path / "train.jsonl", [json.dumps(GOOD), json.dumps(GOOD), line, json.dumps(GOOD)])
    raw, bad = load(tmp_path / "train.jsonl")
    assert [str(b).split(": ", 1)[0] for b in bad] == ["train.jsonl:3"]
    assert reason in bad[0].reason
    assert len(raw["train"]) == 3  # the good ones are all there


def test_non_utf8_bytes(tmp_path):
    write(tmp_path / "train.jsonl", [json.dumps(GOOD), b'{"text": "caf\xe9"}'])
    _, bad = load(tmp_path / "train.jsonl")
    assert str(bad[0]).startswith("train.jsonl:2: not UTF-8 text")


def test_answer_cut_by_max_length(tmp_path, smol_tokenizer):
    long = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    write(tmp_path / "train.jsonl", [json.dumps(GOOD), json.dumps(long)])
    _, bad = load(tmp_path / "train.jsonl", max_length=128, tokenizer=smol_tokenizer)
    assert len(bad) == 1 and bad[0].origin == "train.jsonl:2" and "longer than --max_length 128" in bad[0].reason


@pytest.mark.e2e
def test_stop_lists_everything_then_skip_trains_without_and_counts(tmp_path, tiny_model_dir, capsys):
    import train

    lines = [json.dumps(GOOD)] * 20 + [BAD_LINES["unknown role"][0], BAD_LINES["malformed JSON"][0]]
    write(tmp_path / "train.jsonl", lines)
    argv = tiny_run_args(tiny_model_dir, tmp_path / "train.jsonl", tmp_path / "out", "--splits", "train",
                         "--max_steps", "1")
    with pytest.raises(SystemExit):
        train.run(argv)
    err = capsys.readouterr().err
    assert "2 of 22 examples are malformed" in err and "train.jsonl:21" in err and "train.jsonl:22" in err
    _, summary = train.run([*argv, "--bad_examples", "skip"])
    out = capsys.readouterr().out
    assert "skipped 2 bad examples" in out and "training on 20 examples" in out
    assert summary["trained_examples"] == 20 and summary["skipped_examples"] == 2


def test_fuzz_random_corruptions_never_crash_without_a_clear_message(tmp_path, smol_tokenizer):
    """Random corruptions of a valid file: every outcome is a clean load or bad examples with file:line reasons."""
    rng = random.Random(0)
    valid = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})
             for i in range(12)]

    def corrupt(line: str) -> bytes:
        kind = rng.randrange(7)
        data = line.encode()
        if kind == 0:
            return data[: rng.randrange(len(data))]  # truncated
        if kind == 1:
            position = rng.randrange(len(data))
            byte = rng.choice([b for b in range(256) if b != 0x0A])  # a newline would split the line
            return data[:position] + bytes([byte]) + data[position + 1:]  # one random byte
        row = json.loads(line)
        if kind == 2:
            row["messages"][rng.randrange(2)]["role"] = rng.choice(["bot", "", None, 3])
        elif kind == 3:
            row["messages"][1]["content"] = rng.choice(["", None, [], {"x": 1}])
        elif kind == 4:
            row = {rng.choice(["msgs", "text", "prompt"]): row["messages"]}
        elif kind == 5:
            row["messages"] = rng.choice([[], "hello", None, [1, 2]])
        else:
            row["messages"].append({"role": "assistant"})
        return json.dumps(row).encode()

    for trial in range(40):
        lines = [corrupt(line) if rng.random() < 0.3 else line.encode() for line in valid]
        path = tmp_path / f"fuzz{trial}.jsonl"
        write(path, lines)
        numbers = {n for n, line in enumerate(lines, start=1) if line.strip()}  # a blank line is no example
        clean = {n for n, line in enumerate(lines, start=1) if line == valid[n - 1].encode()}
        try:
            raw, bad = load(path, tokenizer=smol_tokenizer)
        except ValueError as err:  # no usable example left: only where every line was corrupted
            assert not clean and "no usable example" in str(err), err
            continue
        loaded = {int(origin.rsplit(":", 1)[1]) for origin in raw["train"]["_origin"]}
        reported = {int(b.origin.rsplit(":", 1)[1]) for b in bad}
        assert all(b.origin.startswith(f"fuzz{trial}.jsonl:") and b.reason for b in bad)
        assert clean <= loaded and reported.isdisjoint(loaded)  # every clean line trains, every bad one is named
        assert loaded | reported == numbers, (trial, numbers - loaded - reported)  # and no line goes unaccounted


def test_stop_error_message_lists_and_points_to_skip():
    message = str(DataError([BadExample("a.jsonl:3", "not valid JSON")], 10))
    assert "1 of 10 examples are malformed" in message and "a.jsonl:3: not valid JSON" in message
    assert "--bad_examples skip" in message


def long_chats(count: int, rng: random.Random) -> list[dict]:
    """Multi-turn chats of 1 to 6 exchanges with answers of 1 to 30 words: about half outgrow 128 tokens."""
    words = ["date", "month", "year", "ISO", "format", "day", "convert", "please", "March", "2021"]

    def turn(role: str, most: int) -> dict:
        return {"role": role, "content": " ".join(rng.choices(words, k=rng.randint(1, most)))}

    return [{"messages": [message for _ in range(rng.randint(1, 6)) for message in (turn("user", 20),
                                                                                   turn("assistant", 30))]}
            for _ in range(count)]


@pytest.mark.e2e
def test_long_conversations_train_truncated_and_are_reported(tmp_path, tiny_model_dir, smol_tokenizer, capsys):
    import train
    from recipe.data.training_data import prepare

    write(tmp_path / "train.jsonl", [json.dumps(chat) for chat in long_chats(32, random.Random(0))])
    # What truncation to 128 tokens loses, counted from the untruncated tokenization
    full = prepare(str(tmp_path), ["train"], smol_tokenizer, max_length=None, truncate=False).datasets["train"]
    lost = [sum(label != -100 for label in example["labels"][128:]) for example in full]
    assert sum(n > 0 for n in lost) >= 8 and sum(n == 0 for n in lost) >= 8  # both kinds are there

    argv = tiny_run_args(tiny_model_dir, tmp_path, tmp_path / "out", "--splits", "train", "--max_steps", "1",
                         "--max_length", "128")
    _, summary = train.run(argv)  # by default: trained, cut to --max_length as TRL cuts
    out = capsys.readouterr().out
    assert f"truncated {sum(n > 0 for n in lost)} examples longer than --max_length 128, losing {sum(lost)} " in out
    assert (summary["truncated_examples"], summary["truncated_supervised_tokens"]) == (sum(n > 0 for n in lost),
                                                                                        sum(lost))
    assert summary["trained_examples"] == 32 and summary["skipped_examples"] == 0

    skipped = prepare(str(tmp_path), ["train"], smol_tokenizer, max_length=128, truncate=True, long_examples="skip")
    assert len(skipped.datasets["train"]) == sum(n == 0 for n in lost)
    assert len(skipped.skipped) == sum(n > 0 for n in lost)
    with pytest.raises(DataError, match=f"{sum(n > 0 for n in lost)} of 32 examples are too long") as stopped:
        prepare(str(tmp_path), ["train"], smol_tokenizer, max_length=128, truncate=True, long_examples="stop")
    assert "--long_examples truncate" in str(stopped.value) and "--bad_examples" not in str(stopped.value)

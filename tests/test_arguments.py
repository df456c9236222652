"""Argument parsing: the reference recipe's flags, config files, recipe defaults, and refusals."""

import json

import pytest

from arguments import ConfigError, parse_arguments, recipe_defaults

REFERENCE_FLAGS = [
    "--model_name_or_path", "some/model", "--chat_template_format", "chatml", "--lora_r", "8", "--lora_alpha", "16",
    "--lora_dropout", "0.1", "--lora_target_modules", "q_proj,k_proj,v_proj", "--use_peft_lora", "true",
    "--use_4bit_quantization", "true", "--use_nested_quant", "true", "--bnb_4bit_compute_dtype", "bfloat16",
    "--bnb_4bit_quant_storage_dtype", "bfloat16", "--bnb_4bit_quant_type", "nf4", "--use_flash_attn", "true",
    "--use_reentrant", "false", "--dataset_name", "some/data", "--splits", "train,validation",
    "--dataset_text_field", "content", "--add_special_tokens", "false", "--append_concat_token", "false",
    "--packing", "true", "--max_length", "2048", "--bf16", "false", "--output_dir", "out",
]


def test_reference_recipe_flags_parse_into_their_fields():
    model_args, data_args, training_args, explicit = parse_arguments(REFERENCE_FLAGS)
    assert model_args.model_name_or_path == "some/model"
    assert model_args.chat_template_format == "chatml"
    assert (model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout) == (8, 16, 0.1)
    assert model_args.lora_targets == ["q_proj", "k_proj", "v_proj"]
    assert model_args.use_4bit_quantization and model_args.use_nested_quant and model_args.use_flash_attn
    assert not model_args.use_reentrant
    assert (model_args.bnb_4bit_compute_dtype, model_args.bnb_4bit_quant_storage_dtype) == ("bfloat16", "bfloat16")
    assert data_args.dataset_name == "some/data" and data_args.eval_split == "validation"
    assert not data_args.add_special_tokens and not data_args.append_concat_token
    assert training_args.dataset_text_field == "content" and training_args.packing
    assert training_args.max_length == 2048 and not training_args.bf16 and training_args.output_dir == "out"
    assert {"lora_r", "packing", "bf16"} <= explicit


def test_all_linear_is_passed_through():
    model_args, *_ = parse_arguments(["--lora_target_modules", "all-linear"])
    assert model_args.lora_targets == "all-linear"


def test_recipe_defaults_apply_where_nothing_is_set():
    _, _, training_args, explicit = parse_arguments([])
    defaults = recipe_defaults()
    assert explicit == set()
    assert training_args.learning_rate == defaults["learning_rate"]
    assert training_args.activation_checkpointing is False  # TRL's default is True
    assert training_args.bf16 == defaults["bf16"]
    assert training_args.hub_private_repo is True
    assert training_args.padding_free  # attention within each example (fast_paths.py)


def test_wrapped_packing_turns_the_padding_free_default_off_but_not_an_explicit_choice():
    wrapped = ["--packing", "true", "--packing_strategy", "wrapped"]
    assert not parse_arguments(wrapped)[2].padding_free
    assert parse_arguments([*wrapped, "--padding_free", "true"])[2].padding_free
    assert parse_arguments(["--packing", "true"])[2].padding_free  # bfd packing is padding-free anyway


def test_every_sft_config_flag_is_accepted():
    _, _, training_args, _ = parse_arguments(["--num_train_epochs", "3", "--weight_decay", "0.01",
                                              "--packing_strategy", "wrapped", "--eval_strategy", "steps",
                                              "--eval_steps", "5", "--lr_scheduler_type", "linear"])
    assert training_args.num_train_epochs == 3 and training_args.weight_decay == 0.01
    assert training_args.packing_strategy == "wrapped" and training_args.eval_steps == 5


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_then_flags_override(tmp_path, suffix):
    values = {"lora_r": 4, "learning_rate": 0.0005, "splits": "train", "packing": True}
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(values) if suffix == ".json" else "\n".join(f"{k}: {v}" for k, v in values.items()))
    model_args, data_args, training_args, explicit = parse_arguments([str(path), "--lora_r", "32"])
    assert model_args.lora_r == 32  # the flag wins
    assert training_args.learning_rate == 0.0005 and training_args.packing and data_args.splits == "train"
    assert set(values) <= explicit


def test_unknown_key_in_file_is_refused_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora_alpah: 8\nmax_seq_length: 512\n")
    with pytest.raises(ConfigError, match=r"unknown keys: lora_alpah \(did you mean lora_alpha\?\), max_seq_length \(did you mean max_length\?\)"):
        parse_arguments([str(path)])


def test_unknown_flag_is_refused():
    with pytest.raises(ConfigError, match="unknown arguments: --max_seq_len 512"):
        parse_arguments(["--max_seq_len", "512"])


def test_missing_config_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_arguments([str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("argv, message", [
    (["--use_4bit_quantization", "true", "--use_8bit_quantization", "true"], "keep one of them"),
    (["--use_4bit_quantization", "true", "--use_peft_lora", "false"], "QLoRA"),
    (["--splits", "test"], "no train split"),
    (["--splits", "train,dev"], "train, test, validation"),
    (["--lora_r", "0"], "must be positive"),
])
def test_bad_combinations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_arguments(argv)


def test_unknown_template_name_is_refused_from_a_file_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("chat_template_format: llama3\n")
    with pytest.raises(ConfigError, match="chat_template_format 'llama3' is not one of none, chatml, zephyr"):
        parse_arguments([str(path)])


"""Argument parsing: the reference recipe's flags, config files, mode flags, and refusals."""

import json

import pytest
from conftest import settled

from recipe.settings.arguments import ConfigError, parse_arguments

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
    config = settled(REFERENCE_FLAGS)
    model_args, data_args, training_args = config.model, config.data, config.training
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
    assert config.max_length == training_args.max_length == 2048  # packing: TRL cuts its own rows to this length
    assert not training_args.bf16 and training_args.output_dir == "out"
    assert {"packing", "bf16", "max_length"} <= set(parse_arguments(REFERENCE_FLAGS).training)


def test_all_linear_is_passed_through():
    assert parse_arguments(["--lora_target_modules", "all-linear"]).model.lora_targets == "all-linear"


def test_parsing_records_only_what_was_given():
    request = parse_arguments(["--learning_rate", "0.1", "--lora_r", "4"])
    assert request.training == {"learning_rate": 0.1}  # no default is applied here: settle() does that
    assert request.model.lora_r == 4 and not request.check


def test_mode_flags_are_taken_out_wherever_they_stand(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora_r: 4\n")
    request = parse_arguments(["--check", "--accelerate_config", "configs/fsdp2_config.yaml", str(path), "--gpu_gib",
                               "24"])
    assert request.check and request.accelerate_config == "configs/fsdp2_config.yaml" and request.gpu_gib == 24
    assert request.model.lora_r == 4
    with pytest.raises(ConfigError, match="not a number of GiB"):
        parse_arguments(["--check", "--gpu_gib", "lots"])


def test_every_sft_config_flag_is_accepted():
    training_args = settled(["--num_train_epochs", "3", "--weight_decay", "0.01", "--packing_strategy", "wrapped",
                             "--eval_strategy", "steps", "--eval_steps", "5", "--lr_scheduler_type", "linear"]).training
    assert training_args.num_train_epochs == 3 and training_args.weight_decay == 0.01
    assert training_args.packing_strategy == "wrapped" and training_args.eval_steps == 5


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_then_flags_override(tmp_path, suffix):
    values = {"lora_r": 4, "learning_rate": 0.0005, "splits": "train", "packing": True}
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(values) if suffix == ".json" else "\n".join(f"{k}: {v}" for k, v in values.items()))
    request = parse_arguments([str(path), "--lora_r", "32"])
    assert request.model.lora_r == 32  # the flag wins
    assert request.training == {"learning_rate": 0.0005, "packing": True} and request.data.splits == "train"


def test_unknown_key_in_file_is_refused_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora_alpah: 8\nmax_seq_length: 512\n")
    with pytest.raises(ConfigError, match=r"unknown keys: lora_alpah \(did you mean lora_alpha\?\), "
                                          r"max_seq_length \(did you mean max_length\?\)"):
        parse_arguments([str(path)])


def test_unknown_flag_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown arguments: --lora_alfa \(did you mean --lora_alpha\?\) 16"):
        parse_arguments(["--lora_alfa", "16"])


def test_missing_config_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_arguments([str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("argv, message", [
    (["--use_4bit_quantization", "true", "--use_8bit_quantization", "true"], "keep one of them"),
    (["--use_4bit_quantization", "true", "--use_peft_lora", "false"], "QLoRA"),
    (["--splits", "test"], "no train split"),
    (["--splits", "train,dev"], "train, test, validation"),
    (["--lora_r", "0"], "must be positive"),
    (["--max_eval_samples", "0"], "--max_eval_samples must be positive"),
    (["--splits", "train", "--max_eval_samples", "8"], "--max_eval_samples limits the eval split"),
    (["--warmup_steps", "-1"], "invalid training arguments"),
    (["--fsdp", "full_shard auto_wrap"], "--fsdp set up sharding inside the Trainer.*configs/fsdp2_config.yaml"),
    (["--deepspeed", "ds.json"], "--deepspeed set up sharding inside the Trainer.*configs/deepspeed_config.yaml"),
])
def test_bad_combinations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        settled(argv)


def test_unknown_template_name_is_refused_from_a_file_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("chat_template_format: llama3\n")
    with pytest.raises(ConfigError, match="chat_template_format 'llama3' is not one of none, chatml, zephyr"):
        parse_arguments([str(path)])



def test_the_reference_recipes_old_names_are_taken_with_a_note(tmp_path):
    config = settled(["--max_seq_len", "1024", "--warmup_ratio", "0.05"])
    assert (config.max_length, config.training.warmup_steps) == (1024, 0.05)
    notes = {d.setting: d.why for d in config.decisions}
    assert "given as max_seq_len" in notes["max_length"] and "given as warmup_ratio" in notes["warmup_steps"]
    file = tmp_path / "run.yaml"
    file.write_text("max_seq_len: 256\n")
    assert parse_arguments([str(file)]).training == {"max_length": 256}
    assert parse_arguments([str(file), "--max_length", "128"]).training == {"max_length": 128}  # flags win
    with pytest.raises(ConfigError, match="both max_seq_len and max_length"):
        parse_arguments(["--max_seq_len", "1024", "--max_length", "2048"])
    with pytest.raises(ConfigError, match="warmup_ratio 1.5"):
        parse_arguments(["--warmup_ratio", "1.5"])

"""Bad input stops the run with one clear line naming the problem and the fix, before any weights load."""

import json
import subprocess
import sys
import tempfile

import pytest

import train
from recipe.model.model_files import REPO_DIR


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: every refusal here must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the problem was reported")
    monkeypatch.setattr(train, "build_model", refuse)


def refused(argv, capsys) -> str:
    if "--output_dir" not in argv:  # a fresh folder: the default one may hold the demo's run
        argv = [*argv, "--output_dir", tempfile.mkdtemp()]
    with pytest.raises(SystemExit) as exit_info:
        train.run(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_missing_model_path(no_weights, capsys, tmp_path):
    line = refused(["--model_name_or_path", str(tmp_path / "no-model")], capsys)
    assert "--model_name_or_path" in line and "no such model folder" in line


def test_hub_model_not_cached_while_offline(no_weights, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = refused(["--model_name_or_path", "nobody/no-such-model"], capsys)
    assert "not in the local Hugging Face cache" in line and "hf download nobody/no-such-model" in line


def test_missing_dataset_path(no_weights, capsys, tmp_path):
    line = refused(["--dataset_name", str(tmp_path / "nothing.jsonl")], capsys)
    assert "--dataset_name" in line and "no such dataset" in line


def test_missing_column(no_weights, capsys, tmp_path, tiny_model_dir):
    (tmp_path / "train.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    line = refused(["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(tmp_path / "train.jsonl"),
                    "--splits", "train"], capsys)
    assert "['answer', 'question']" in line and "--dataset_text_field" in line


def test_missing_split_file(no_weights, capsys, tmp_path, tiny_model_dir):
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    line = refused(["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(tmp_path)], capsys)
    assert "no test.jsonl" in line and "--splits" in line


def test_unknown_template(no_weights, capsys):
    line = refused(["--chat_template_format", "llama3"], capsys)
    assert "--chat_template_format" in line and "'llama3'" in line and "'chatml', 'zephyr'" in line


def test_4bit_and_8bit_together(no_weights, capsys):
    line = refused(["--use_4bit_quantization", "true", "--use_8bit_quantization", "true"], capsys)
    assert "keep one of them" in line


def test_flash_attention_where_it_cannot_run(no_weights, capsys):
    line = refused(["--use_flash_attn", "true"], capsys)
    assert "--use_flash_attn" in line and "sdpa" in line


def test_bf16_on_a_machine_without_it(no_weights, capsys, monkeypatch):
    monkeypatch.setenv("RECIPE_NATIVE_BF16", "0")  # the probe's switch: as on a CPU without native bf16
    line = refused(["--bf16", "true"], capsys)
    assert line == ("error: --bf16 on a CPU without native bf16 (emulated bf16 is many times slower than fp32). "
                    "Fix: pass --bf16 false")


def test_template_the_tokenizer_cannot_take(no_weights, capsys, tmp_path, tiny_model_dir):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(config))
    line = refused(["--model_name_or_path", str(tmp_path / "model"), "--chat_template_format", "zephyr"], capsys)
    assert "could not be prepared" in line and "no" in line and "--chat_template_format chatml" in line


def test_missing_resume_checkpoint(no_weights, capsys, tmp_path):
    line = refused(["--resume_from_checkpoint", str(tmp_path / "checkpoint-9")], capsys)
    assert "no such checkpoint folder" in line


def test_malformed_jsonl_names_file_and_line(no_weights, capsys, tmp_path, tiny_model_dir):
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(SystemExit) as exit_info:
        train.run(["--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(tmp_path / "train.jsonl"),
                   "--splits", "train", "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: 1 of 2 examples are malformed" in err and "train.jsonl:2: not valid JSON" in err
    assert "--bad_examples skip" in err


@pytest.mark.e2e
def test_command_line_exit_code_and_message():
    """The real command: non-zero exit, one error line on stderr, no traceback."""
    result = subprocess.run([sys.executable, "train.py", "--lora_rr", "8"], cwd=REPO_DIR, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "error: unknown arguments: --lora_rr (did you mean --lora_r?) 8" in result.stderr
    assert "Traceback" not in result.stderr

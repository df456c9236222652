"""After training: the run report, merging, held-out evaluation, and publishing (network call replaced)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import probe_logits, tiny_run_args
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import export
import train
from utils import REPO_DIR

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=[False, True], ids=["lora", "qlora"])
def trained(request, tiny_model_dir, chat_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    argv = tiny_run_args(tiny_model_dir, chat_dir, out, "--max_steps", "4", "--learning_rate", "1e-2",
                         "--eval_num_prompts", "4")
    if request.param:
        argv += ["--use_4bit_quantization", "true"]
    train.run(argv)
    return out, request.param


def test_run_leaves_a_report_and_curves(trained):
    out, _ = trained
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["results"]["train_steps"] == 4 and "eval_loss" in summary["results"]
    assert {"padding_free", "attention", "use_cpu"} <= {decision["setting"] for decision in summary["decisions"]}
    assert len(summary["results"]["step_seconds"]) == 4 and all(x > 0 for x in summary["results"]["step_seconds"])
    assert [e["step"] for e in summary["log_history"] if "loss" in e] == [1, 2, 3, 4]
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_matches_base_plus_adapter(trained, tmp_path):
    """QLoRA adapters merge into the unquantized base; the merged model equals that base + the adapter."""
    out, quantized = trained
    merged_dir = export.merge(out, tmp_path / "merged", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(json.loads((out / "adapter_config.json").read_text())[
        "base_model_name_or_path"], dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(base, out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(probe_logits(merged, tokenizer), probe_logits(unmerged, tokenizer), rtol=1e-4, atol=1e-4)


def test_merge_is_refused_inside_a_sharded_run(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="merging inside a sharded"):
        export.merge(trained[0], tmp_path / "merged")


def test_publish_uploads_a_checked_private_folder_and_never_the_token(trained, monkeypatch):
    out, quantized = trained
    planted = "hf_PLANTEDtokenDoNotLeak0123456789"
    monkeypatch.setenv("HF_TOKEN", planted)
    calls = {}

    def create_repo(self, repo_id, private=None, exist_ok=False):
        calls["create"] = dict(repo_id=repo_id, private=private)
        return f"https://hub.example/{repo_id}"

    def upload_folder(self, repo_id, folder_path, commit_message=None):
        from pathlib import Path

        calls["files"] = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    export.publish(out, "someone/dates-adapter")
    assert calls["create"] == {"repo_id": "someone/dates-adapter", "private": True}
    files = calls["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md",
            "training_curves.png"} <= set(files)
    card = files["README.md"].decode()
    for expected in ("base_model:", "QLoRA" if quantized else "LoRA", "dates", "| lora_r | 16 |", "learning_rate",
                     "train loss", "after 4 steps", "eval loss", "exact match", "training_curves.png",
                     "AutoPeftModelForCausalLM", "hardware: 1 x CPU"):
        assert expected in card, expected
    for name, content in files.items():
        assert planted.encode() not in content, name
    for path in out.rglob("*"):  # nor anything the run itself wrote
        assert not path.is_file() or planted.encode() not in path.read_bytes(), path


def test_publish_refuses_an_unfinished_folder(tmp_path):
    with pytest.raises(SystemExit, match="lacks adapter_model.safetensors"):
        export.stage_for_hub(tmp_path, tmp_path / "stage")


def test_evaluate_command_reports_loss_and_exact_match_with_and_without_adapter(trained, chat_dir):
    out, _ = trained  # a QLoRA adapter is evaluated on the unquantized base, as it is served
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    result = subprocess.run([sys.executable, "evaluate.py", "--model_name_or_path", base, "--adapter", str(out),
                             "--dataset_name", str(chat_dir), "--num_prompts", "4", "--max_new_tokens", "4",
                             "--show", "1"], cwd=REPO_DIR, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("base ") and "loss" in line and "exact match" in line for line in lines)
    assert any(line.startswith("adapter ") and "loss" in line for line in lines)
    assert "reference:" in result.stdout

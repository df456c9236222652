"""After training: the run report, merging, held-out evaluation, and publishing (to a fake Hub on 127.0.0.1)."""

import json
import subprocess
import sys
from xml.etree import ElementTree

import pytest
import torch
from conftest import probe_logits, tiny_run_args
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import export
import train
from recipe.model.model_files import REPO_DIR

pytestmark = pytest.mark.e2e
TINY_ID = "someone/tiny-llama"  # the Hub id the tiny base stands for (recorded instead of its folder in /tmp)


@pytest.fixture(scope="module", params=[False, True], ids=["lora", "qlora"])
def trained(request, tiny_model_dir, chat_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    argv = tiny_run_args(tiny_model_dir, chat_dir, out, "--max_steps", "4", "--learning_rate", "1e-2",
                         "--eval_num_prompts", "4", "--base_model_id", TINY_ID)
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
    # The curves: one point per logged train loss, one per evaluation, one per learning rate, each inside its chart
    svg = ElementTree.parse(out / "training_curves.svg").getroot()
    lines = svg.findall(".//{http://www.w3.org/2000/svg}polyline")
    counts = [len(line.get("points").split()) for line in lines]
    evaluations = sum("eval_loss" in e for e in summary["log_history"])
    assert counts == [4, evaluations, sum("learning_rate" in e for e in summary["log_history"])] and evaluations
    for line in lines:
        assert all(60 <= float(x) <= 480 and 30 <= float(y) <= 320
                   for x, y in (point.split(",") for point in line.get("points").split()))


def test_merge_matches_base_plus_adapter(trained, tiny_model_dir, tmp_path):
    """QLoRA adapters merge into the unquantized base; the merged model equals that base + the adapter."""
    out, quantized = trained
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == TINY_ID
    merged_dir = export.merge(out, tmp_path / "merged", dtype="float32", base=str(tiny_model_dir))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(base, out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(probe_logits(merged, tokenizer), probe_logits(unmerged, tokenizer), rtol=1e-4, atol=1e-4)


def test_pickled_weights_and_unmarked_checkpoints_are_refused(trained, tiny_model_dir, tmp_path):
    """merge and evaluate load safetensors only; consolidate reads only checkpoints this recipe marked complete."""
    import shutil

    pickled = tmp_path / "pickled-base"
    pickled.mkdir()
    shutil.copy(tiny_model_dir / "config.json", pickled)
    torch.save({}, pickled / "pytorch_model.bin")  # were it loaded, a pickle could run code
    with pytest.raises(SystemExit, match="pickles only.*save_pretrained"):
        export.merge(trained[0], tmp_path / "merged", base=str(pickled))
    if not trained[1]:  # the command once (the adapter's method does not matter to it)
        result = subprocess.run([sys.executable, "evaluate.py", "--model_name_or_path", str(pickled)], cwd=REPO_DIR,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 1 and "pickles only" in result.stderr and "Traceback" not in result.stderr
    unmarked = tmp_path / "checkpoint-3"
    (unmarked / "pytorch_model_fsdp_0").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no checkpoint_complete marker.*--trust_checkpoint"):
        export.consolidate(unmarked)


def test_merge_is_refused_inside_a_sharded_run(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="merging inside a sharded"):
        export.merge(trained[0], tmp_path / "merged")


@pytest.fixture
def hub(monkeypatch):
    """The fake Hub on 127.0.0.1 (tests/fake_hub.py), where every client built from now on sends its requests."""
    import huggingface_hub.constants
    from fake_hub import FakeHub

    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield server
    server.close()


PLANTED = "hf_PLANTEDtokenDoNotLeak0123456789"


def test_publish_creates_a_private_repo_and_uploads_a_checked_folder(trained, hub, monkeypatch):
    out, quantized = trained
    monkeypatch.setenv("HF_TOKEN", PLANTED)
    export.publish(out, "someone/dates-adapter")
    repo = hub.repos["someone/dates-adapter"]
    assert repo.private
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md",
            "training_curves.svg"} <= set(repo.files)
    assert repo.files["adapter_model.safetensors"] == (out / "adapter_model.safetensors").read_bytes()
    assert repo.files["README.md"] == (out / "README.md").read_bytes()  # the output folder's card is the recipe's
    for name, content in repo.files.items():  # no path of this machine: the base is recorded by its Hub id
        assert b"/tmp/" not in content and str(REPO_DIR).encode() not in content, name
    card = repo.files["README.md"].decode()
    assert f"base_model: {TINY_ID}" in card
    for expected in ("base_model:", "QLoRA" if quantized else "LoRA", "dates", "| lora_r | 16 |", "learning_rate",
                     "train loss", "after 4 steps", "eval loss", "exact match", "training_curves.svg",
                     "AutoPeftModelForCausalLM", "hardware: 1 x CPU"):
        assert expected in card, expected
    # The token travels in the Authorization header only: in no request body, no uploaded file, no file of the run
    assert any(r.headers.get("authorization") == f"Bearer {PLANTED}" for r in hub.requests)
    assert all(PLANTED.encode() not in r.body for r in hub.requests)
    for name, content in repo.files.items():
        assert PLANTED.encode() not in content, name
    for path in out.rglob("*"):
        assert not path.is_file() or PLANTED.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("public", [False, True], ids=["existing-private", "existing-public"])
def test_publish_to_an_existing_repo_keeps_it_private_or_refuses(trained, hub, public):
    from fake_hub import Repo

    out, _ = trained
    hub.repos["someone/existing"] = Repo(private=not public)
    if public:  # create_repo(exist_ok=True) would have left it public and uploaded: nothing is sent now
        with pytest.raises(SystemExit, match="someone/existing exists and is public.*--public"):
            export.publish(out, "someone/existing")
        assert hub.repos["someone/existing"].files == {}
        assert not [r for r in hub.requests if r.method == "POST"]
        export.publish(out, "someone/existing", private=False)  # asked for: published there
    else:
        export.publish(out, "someone/existing")
        assert not any(r.path == "/api/repos/create" for r in hub.requests)
    assert "adapter_model.safetensors" in hub.repos["someone/existing"].files
    assert hub.repos["someone/existing"].private == (not public)


def test_publish_refuses_an_unfinished_folder(tmp_path):
    with pytest.raises(SystemExit, match="lacks adapter_model.safetensors"):
        export.stage_for_hub(tmp_path, tmp_path / "stage")


@pytest.mark.parametrize("trained", [False], ids=["lora"], indirect=True)  # the command does not depend on the method
def test_evaluate_command_reports_the_runs_own_held_out_loss_and_exact_match(trained, tiny_model_dir, chat_dir):
    """evaluate.py on the run's adapter, with the run's flags, reports the run's eval_loss (one held-out loss: TRL's
    evaluation through the recipe's trainer) beside the base model's."""
    out, _ = trained
    results = json.loads((out / "run_summary.json").read_text())["results"]
    result = subprocess.run([sys.executable, "evaluate.py", "--model_name_or_path", str(tiny_model_dir), "--adapter",
                             str(out), "--dataset_name", str(chat_dir), "--num_prompts", "8", "--max_new_tokens", "4",
                             "--show", "1", "--bf16", "false"], cwd=REPO_DIR, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    base = next(line for line in lines if line.startswith("base "))
    adapter = next(line for line in lines if line.startswith("adapter "))
    assert f"loss {results['eval_loss']:.4f}" in adapter and "exact match" in base
    assert base.split()[2] != adapter.split()[2]  # the adapter moved the loss
    assert "reference:" in result.stdout

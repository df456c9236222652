"""Training end to end through train.py: LoRA and QLoRA on a tiny Llama, recorded losses, added template tokens,
`--torch_compile`, the default run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_model, losses, probe_logits, settled, tiny_llama_config, tiny_run_args
from peft import PeftModel
from transformers import AutoModelForCausalLM

from recipe.settings import checks
import train
from recipe.platform import process
from recipe.settings.configuration import configure
from recipe.model.model_files import REPO_DIR

# The tiny fp32 LoRA run (tiny_run_args on the first 64 demo conversations, 6 steps, seed 42), recorded on 2026-12-01
# (AMD EPYC, AVX2, torch 2.13.0 CPU). A change in the data, the masks, the loss or the optimizer moves them by far more
# than the tolerance; other CPU kernels move them by rounding only: ATEN_CPU_CAPABILITY=default (no vector kernels)
# moved them by at most 7e-7 relative, 30x inside the tolerance.
RECORDED_LOSSES = [11.692840, 10.171215, 8.557518, 8.144197, 7.650654, 7.694229]


@pytest.mark.e2e
def test_tiny_lora_run_reproduces_its_recorded_losses(tiny_model_dir, chat_dir, tmp_path):
    """...and finds each packed row's examples from the lengths the collator kept on the host: no boundary read back
    in the attention of any layer, no packed-row check in transformers' mask preparation."""
    from test_model_families import HostReads

    with HostReads() as reads:
        trainer, _ = train.run(tiny_run_args(tiny_model_dir, chat_dir, tmp_path / "out", "--splits", "train"))
    assert losses(trainer.state.log_history) == pytest.approx(RECORDED_LOSSES, rel=2e-5, abs=0)
    assert not [read for read in reads.reads if read.endswith(("example_lengths", "find_packed_sequence_indices"))]


@pytest.mark.e2e
@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora-4bit"])
def test_lora_trains_only_the_adapter_and_the_saved_adapter_reloads(tiny_model_dir, chat_dir, tmp_path, quantized):
    extra = ["--use_4bit_quantization", "true", "--eval_num_prompts", "2"] if quantized else []
    argv = tiny_run_args(tiny_model_dir, chat_dir, tmp_path / "out", *extra)
    trainer, summary = train.run(argv)

    trained = losses(trainer.state.log_history)
    assert len(trained) == 6 and trained[-1] < trained[0] - 0.3, trained

    base = dict(base_model(argv).named_parameters())
    lora_b = 0
    for name, param in trainer.model.named_parameters():
        if "lora_" in name:
            assert param.requires_grad
            lora_b += name.count("lora_B") and bool(param.detach().abs().sum() > 0)  # B starts at zero
        else:
            assert not param.requires_grad, name
            original = base[name.replace("base_model.model.", "").replace(".base_layer", "")]
            # compared as bytes: 4-bit weights are packed into a float storage dtype, where NaNs never compare equal
            assert torch.equal(param.detach().cpu().view(torch.uint8), original.detach().cpu().view(torch.uint8)), name
    assert lora_b == 2 * 7  # every LoRA B of the 2 layers x 7 linear modules moved away from zero

    out = tmp_path / "out"
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 16 and {name.rsplit(".", 1)[-1] for name in config["target_modules"]} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # TRL trains the adapter of a quantized model in bf16; PEFT would upcast it to fp32 on load unless told not to
    reloaded = PeftModel.from_pretrained(base_model(argv), out, autocast_adapter_dtype=not quantized)
    torch.testing.assert_close(probe_logits(reloaded, trainer.processing_class),
                               probe_logits(trainer.model, trainer.processing_class), rtol=0, atol=0)


@pytest.mark.e2e
def test_torch_compile_compiles_each_decoder_layer_and_trains_as_eager(tiny_model_dir, chat_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """`--torch_compile` as the recipe sets it up: each decoder layer compiled on its own, the first not compiled again,
    the losses of eager. Through dynamo and AOTAutograd (`--torch_compile_backend aot_eager`): what the recipe decides
    is all there, and inductor's code generation is not, which on a CPU builds C++ that no GPU run uses (the test took
    nearly twice as long with it). bench/benchmark.py runs `--torch_compile` with inductor and times it."""
    import torch._dynamo

    for name in ("BACKEND", "USE_REGIONAL_COMPILATION", "USE_DYNAMIC"):  # TrainingArguments sets them process-wide
        monkeypatch.setenv(f"ACCELERATE_DYNAMO_{name}", "")
        monkeypatch.delenv(f"ACCELERATE_DYNAMO_{name}")
    runs = {}
    for mode, extra in (("eager", []), ("compiled", ["--torch_compile", "true",
                                                    "--torch_compile_backend", "aot_eager"])):
        argv = tiny_run_args(tiny_model_dir, chat_dir, tmp_path / mode, "--max_steps", "3", "--splits", "train", *extra)
        torch._dynamo.utils.counters.clear()
        torch._dynamo.utils.guard_failures.clear()
        trainer, _ = train.run(argv)
        runs[mode] = losses(trainer.state.log_history)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) == (mode == "compiled"), (mode, graphs)
    assert "torch_compile = each decoder layer" in capsys.readouterr().out
    # The first layer's input needs grad as the others' do: it is not compiled again on its own
    reasons = [reason for failures in torch._dynamo.utils.guard_failures.values() for reason in failures]
    assert not any("requires_grad" in reason for reason in reasons), reasons
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=2e-3)


@pytest.mark.e2e
@pytest.mark.parametrize("repaid", [True, False], ids=["compiles", "stays-eager"])
def test_a_run_left_to_its_default_compiles_its_layers_once_the_steps_left_repay_it(
        tiny_model_dir, chat_dir, tmp_path, capsys, monkeypatch, repaid):
    """--torch_compile unset on one CPU process: after the first step and 3 more, each decoder layer is compiled when
    the steps left save more than compiling costs (here made free, or dear), and the run trains on. Through dynamo
    and AOTAutograd, as the test above (inductor builds C++ that says nothing more here)."""
    from recipe.model import fast_paths

    monkeypatch.setitem(fast_paths.COMPILE_SECONDS, "cpu", 0.0 if repaid else 1e6)
    monkeypatch.setattr(train, "compile_each_layer", lambda model, backend: fast_paths.compile_each_layer(
        model, "aot_eager"))
    trainer, summary = train.run(tiny_run_args(tiny_model_dir, chat_dir, tmp_path / "out", "--max_steps", "6",
                                               "--splits", "train"))
    out = capsys.readouterr().out
    assert "torch_compile = after step 4 if the steps left repay it" in out
    layers = fast_paths.decoder_layers(trainer.model)
    assert len(layers) == 2 and len(losses(trainer.state.log_history)) == 6
    if repaid:
        assert "torch_compile: compiling each of 2 decoder layers now: the 2 steps left" in out
        assert summary["compiled_after_step"] == 4 and all(layer._compiled_call_impl is not None for layer in layers)
    else:
        assert "torch_compile: staying eager: the 2 steps left" in out and summary["compiled_after_step"] is None
        assert all(layer._compiled_call_impl is None for layer in layers)


def test_compiling_repays_when_the_steps_left_save_more_than_twice_its_cost():
    from recipe.model.fast_paths import COMPILE_SECONDS, COMPILED_STEP_RATIO, compile_repays

    saving_per_step = 2.0 * (1 - COMPILED_STEP_RATIO["cpu"])
    enough = int(2 * COMPILE_SECONDS["cpu"] / saving_per_step) + 1
    assert compile_repays(2.0, enough, "cpu")[0] and not compile_repays(2.0, enough - 2, "cpu")[0]
    assert compile_repays(2.0, 10, "cpu")[1] == pytest.approx(10 * saving_per_step)


@pytest.fixture(scope="module")
def tokenizer_without_chatml(tmp_path_factory):
    """A byte-level BPE tokenizer with only <s>, </s>, <unk>: the chatml template must add its two tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    texts = [json.dumps(row) for row in ({"q": f"date {i}", "a": f"{2000 + i}-01-0{i % 9 + 1}"} for i in range(200))]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    out = tmp_path_factory.mktemp("bpe-llama")
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = tiny_llama_config(tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.e2e
def test_added_template_tokens_are_trained_saved_and_reload_without_size_mismatch(tokenizer_without_chatml, chat_dir,
                                                                                 tmp_path):
    argv = tiny_run_args(tokenizer_without_chatml, chat_dir, tmp_path / "out", "--chat_template_format", "chatml")
    facts = configure(argv).facts
    tokenizer, added = facts.tokenizer, facts.added_token_ids
    assert tokenizer.convert_ids_to_tokens(added) == ["<|im_start|>", "<|im_end|>"]
    assert "<s>" not in tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)

    trainer, _ = train.run(argv)
    out = tmp_path / "out"
    rows_before = base_model(argv).get_input_embeddings().weight[added]
    trained = trainer.model.get_input_embeddings()(torch.tensor(added))
    assert not torch.allclose(trained, rows_before)  # the new rows were trained

    base = AutoModelForCausalLM.from_pretrained(tokenizer_without_chatml, dtype=torch.float32)
    base.resize_token_embeddings(len(tokenizer))  # as evaluate.py does from the saved tokenizer's length
    reloaded = PeftModel.from_pretrained(base, out)  # no size mismatch
    saved_tokenizer = type(tokenizer).from_pretrained(out)
    assert len(saved_tokenizer) == len(tokenizer)
    torch.testing.assert_close(probe_logits(reloaded, saved_tokenizer), probe_logits(trainer.model, saved_tokenizer),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
@pytest.mark.native_bf16
def test_default_run_improves_held_out_exact_match(smol_dir, tmp_path):
    """The README's default run, shortened to 6 steps of 4 examples, 8 held-out prompts and an eval loss over 8
    examples: the held-out metric rises and the adapter is saved. (In fp32: 0% before, 75% after, as 6 steps of the
    default 8 examples reach, in 71 s against 123 s on a 2 GHz CPU.) Answers get 16 new tokens, not 32: every answer
    is 10 tokens and the end of turn, so exact match is the same, and the base model's rambling is cut in half."""
    trainer, summary = train.run(["--output_dir", str(tmp_path / "out"), "--max_steps", "6",
                                  "--per_device_train_batch_size", "4", "--eval_num_prompts", "8",
                                  "--eval_max_new_tokens", "16", "--max_eval_samples", "8", "--disable_tqdm", "true"])
    assert summary["exact_match_after"] > summary["exact_match_before"] + 0.2, summary
    assert len(trainer.eval_dataset) == 8 and summary["eval_loss"] > 0  # of the 64 test examples
    # the defaults take fast_paths.py's attention on padding-free batches
    assert trainer.model.config._attn_implementation == "sdpa_varlen" and trainer.padding_free
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    # The adapter names its base by Hub id, not by the converted copy's path, and the folder's card is the recipe's
    adapter_config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "More Information Needed" not in card
    decisions = json.loads((tmp_path / "out" / "run_summary.json").read_text())["decisions"]
    assert {"bf16", "padding_free", "attention"} <= {decision["setting"] for decision in decisions}


def test_shipped_demo_data_is_what_the_generator_makes():
    from data.make_dates_dataset import make_splits
    from recipe.model.model_files import REPO_DIR

    splits = make_splits(n_train=512, n_test=64, seed=0)
    for split, rows in splits.items():
        lines = (REPO_DIR / "data" / "dates" / f"{split}.jsonl").read_text().splitlines()
        shipped = [json.loads(line) for line in lines]
        assert shipped == rows
    answers = {split: {r["messages"][1]["content"] for r in rows} for split, rows in splits.items()}
    assert not answers["train"] & answers["test"]  # held-out dates are never trained on


def test_exact_match_normalises_whitespace_case_and_a_final_period():
    from recipe.reporting.heldout import exact_match

    assert exact_match(["2021-03-05.", " 2021-03-05 ", "March 5, 2021"], ["2021-03-05"] * 3) == pytest.approx(2 / 3)


def test_resume_latest_picks_the_newest_complete_checkpoint(tmp_path):
    from recipe.engines.checkpoints import COMPLETE, resume_point

    assert resume_point("latest", tmp_path) is None
    for step in (4, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / COMPLETE).write_text("{}")
    (tmp_path / "checkpoint-16").mkdir()  # half-written by a kill: no marker
    assert resume_point("latest", tmp_path).endswith("checkpoint-12")
    assert resume_point(str(tmp_path / "checkpoint-4"), tmp_path).endswith("checkpoint-4")


def write_checkpoint(folder: Path, files: dict[str, bytes]) -> Path:
    """A checkpoint folder with its files and a completion marker as the trainer writes it."""
    import json

    from recipe.engines.checkpoints import COMPLETE, file_records

    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / COMPLETE).write_text(json.dumps({"step": 1, "files": file_records(folder)}))
    return folder


def test_a_checkpoint_damaged_after_its_save_is_skipped_by_latest_and_refused_by_name(tmp_path, capsys):
    """A file truncated (a failing disk, a partial copy), changed in place, or lost after the marker was written:
    `latest` falls back to the newest intact checkpoint and says why; preflight, consolidate and merge refuse it by
    name."""
    import export
    from recipe.engines.checkpoints import damage, resume_point

    files = {"adapter_model.safetensors": b"w" * 1000, "pytorch_model_fsdp_0/__0_0.distcp": b"s" * 500}
    intact = write_checkpoint(tmp_path / "checkpoint-2", files)
    damaged = write_checkpoint(tmp_path / "checkpoint-4", files)
    assert damage(intact) is None and damage(damaged) is None
    assert resume_point("latest", tmp_path) == str(damaged)

    (damaged / "adapter_model.safetensors").write_bytes(b"w" * 500)  # truncated to half
    assert damage(damaged) == f"{damaged / 'adapter_model.safetensors'} has 500 bytes, 1000 were written"
    assert resume_point("latest", tmp_path) == str(intact)
    assert f"skipping {damaged}, damaged after it was written: {damaged / 'adapter_model.safetensors'} has 500 " \
           f"bytes" in capsys.readouterr().err
    problem = checks.resume_checkpoint(settled(["--resume_from_checkpoint", str(damaged)]))
    assert problem.level == "error" and "has 500 bytes" in problem.why and str(intact) in problem.fix
    for refused in (lambda: export.consolidate(damaged), lambda: export.merge(damaged, tmp_path / "merged")):
        with pytest.raises(SystemExit, match="checkpoint-4 is damaged: .*has 500 bytes"):
            refused()

    (damaged / "adapter_model.safetensors").write_bytes(b"x" * 1000)  # the same size, other bytes
    assert "SHA-256 differs" in damage(damaged)
    (damaged / "pytorch_model_fsdp_0" / "__0_0.distcp").unlink()
    assert damage(damaged).endswith("__0_0.distcp is missing")
    for path in intact.rglob("*"):  # nothing intact left: a fresh start, said
        if path.is_file() and path.name != "checkpoint_complete":
            path.write_bytes(b"")
    assert resume_point("latest", tmp_path) is None
    assert "resuming from the start (no intact checkpoint)" in capsys.readouterr().err
    assert "no other intact checkpoint" in checks.resume_checkpoint(
        settled(["--resume_from_checkpoint", str(damaged)])).fix


def test_remote_code_runs_only_when_asked(tiny_model_dir, monkeypatch):
    """trust_remote_code runs the model repository's own Python: off unless --trust_remote_code true."""
    import utils
    from recipe.settings.configuration import configure

    seen = []
    monkeypatch.setattr(utils, "load_causal_lm", lambda name, **kwargs: seen.append(kwargs["trust_remote_code"]) or
                        (_ for _ in ()).throw(RuntimeError("stop before loading")))
    for extra, expected in (([], False), (["--trust_remote_code", "true"], True)):
        with pytest.raises(RuntimeError, match="stop before loading"):
            train.build_base_model(configure(["--model_name_or_path", str(tiny_model_dir), *extra]))
        assert seen[-1] is expected


def test_the_command_closes_its_process_group_before_python_exits(tmp_path, monkeypatch):
    """`python train.py` destroys the process group after a run that ended well (process.finish), never after a failure.
    A one-process gloo group stands in for a launch's; the run itself is replaced, as only the order matters here."""
    import torch.distributed as dist

    ran = []
    monkeypatch.setattr(train, "run", lambda argv: ran.append(dist.is_initialized()))
    monkeypatch.setattr(process, "AT_EXIT", {"skip_teardown": False})  # this test process keeps its teardown
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        train.main([])
        assert ran == [True] and not dist.is_initialized() and process.AT_EXIT["skip_teardown"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


ENDING = """
import atexit, os, sys, threading, time
sys.path.insert(0, {repo!r})
import train
import torch.distributed as dist

class Teardown:
    def __del__(self, write=os.write):  # bound now: the teardown empties the module first
        write(1, b" torn down")

kept = Teardown()  # freed by the interpreter's teardown
atexit.register(print, " exit handler", flush=True)  # registered after train's, as every library's is
threading.Thread(target=lambda: (time.sleep(0.5), print(" thread", end=""))).start()
if {group}:
    dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
train.run = lambda argv: print("ran", end="")  # unflushed, as a run's last words may be
train.main([])
"""


@pytest.mark.e2e
@pytest.mark.parametrize("group", [True, False], ids=["process-group", "one-process"])
def test_a_finished_rank_leaves_without_the_interpreters_teardown_and_loses_nothing(tmp_path, group):
    """Left to the interpreter's teardown, gloo's threads can abort a rank that trained and saved (process.finish): a
    process that had a group leaves once Python has joined its threads and run every exit handler, with its output;
    a one-process run, which has no group, keeps the teardown."""
    script = ENDING.format(repo=str(REPO_DIR), group=group, store=tmp_path / "store")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ran thread exit handler")
    assert ("torn down" in result.stdout) is not group, result.stdout


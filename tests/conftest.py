"""Shared fixtures and helpers: the real SmolLM2 tokenizer (converted once from the packaged GGUF), a tiny random Llama,
a small copy of the demo data, and the few steps every training test repeats (its arguments, the configuration and
base model train.py would build, the logits of a probe prompt).

Tiers (markers, see pytest.ini): unmarked tests are the unit tier (`make test-fast`, under a minute); `e2e` tests train
or start the recipe's commands; `multiprocess` tests launch 2 processes over gloo.
"""

import gc
import os
import sys
from pathlib import Path

import pytest

gc.disable()  # while the test modules import the libraries, as train.py does; frozen and enabled once collected

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

PROBE = "Convert this date to ISO format (YYYY-MM-DD): May 1, 2000"


def tiny_run_args(model_dir, data_dir, out, *extra) -> list[str]:
    """A short, deterministic fp32 run of train.py without held-out generation; `extra` flags override these."""
    return ["--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir), "--output_dir", str(out),
            "--max_steps", "6", "--per_device_train_batch_size", "8", "--learning_rate", "3e-2", "--logging_steps", "1",
            "--bf16", "false", "--eval_num_prompts", "0", "--disable_tqdm", "true", "--warmup_steps", "0", *extra]


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range: every connection and every `bind` to port 0
    (gloo's pairs, the stores of launches with --main_process_port 0) takes its port from that range, so a port chosen
    there could be taken by another test's run before the launch binds it, and the other machine would then wait out
    the static rendezvous (600 s). Each xdist worker draws from its own share of the range, with its own random
    source: the global one is seeded by every Trainer (transformers' set_seed), so two workers drew the same ports."""
    import random
    import socket

    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = (low - low // 2) // workers
    start = low // 2 + worker * share
    for port in random.SystemRandom().sample(range(start, start + share), 100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + share - 1}")


def end_together(processes, timeout: float) -> list[int]:
    """Wait for every process; the first to fail, or the timeout, kills the others and everything under them, as
    `srun --kill-on-bad-exit` does: a machine whose partner failed before the rendezvous would otherwise wait out its
    timeout (600 s) without a word. Returns the exit codes."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while (any(process.poll() is None for process in processes) and not any(process.returncode for process in processes)
           and time.monotonic() < deadline):
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            signal_tree(process.pid, signal.SIGKILL)
            process.wait()
    return [process.returncode for process in processes]


def node_launch(config, machine_rank: int, port: int, mixed_precision="no") -> list[str]:
    """`accelerate launch` of one machine of two on this host, one process each, through a shipped multi-machine
    config: only the process count, the machine rank, the address and the precision change."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
            "--num_machines", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), "--mixed_precision", mixed_precision]


def machine_launch(config, mixed_precision="no") -> list[str]:
    """`accelerate launch` of two processes on this machine through a shipped config: only the process count, the
    precision and the port (any free one) change."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
            "--mixed_precision", mixed_precision, "--main_process_port", "0"]


def launch_two_processes(script, args, config="configs/fsdp2_config.yaml", mixed_precision="no", machines=1):
    """`accelerate launch` of `script` with a shipped accelerate config, as on GPUs, with only the process count and
    precision changed (the configs' bf16 is emulated, many times slower, on CPUs without it): 2 processes on one
    machine, or (machines=2, a multi-machine config) one process on each of two machines, found through the
    rendezvous on 127.0.0.1. (The recipe fixes glibc's mmap threshold itself when a run starts, so host RAM follows
    what it holds: run_memory.return_freed_memory. Setting MALLOC_MMAP_THRESHOLD_ for the whole launch as well, imports
    and agent included, changed no phase's verdict and made launches slower: the SLURM script's test took 35 s with
    it and 18 s without.)"""
    import subprocess
    import tempfile

    if machines == 1:
        commands = [machine_launch(config, mixed_precision)]
    else:
        port = free_port()
        commands = [node_launch(config, rank, port, mixed_precision) for rank in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tempfile.TemporaryFile("w+") for _ in commands]  # files, not pipes: no machine waits on an unread pipe
    launches = [subprocess.Popen([*command, str(script), *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 text=True, env=env) for command, log in zip(commands, logs)]
    codes = end_together(launches, timeout=600)
    for log in logs:
        log.seek(0)
    assert codes == [0] * len(launches), "\n".join(f"launch {index}, exit {code}:\n{log.read()[-6000:]}"
                                                   for index, (code, log) in enumerate(zip(codes, logs)))


def signal_tree(pid: int, signum: int) -> None:
    """Signal a launch and every process under it, as SLURM signals a job step on a node or a node failure kills it:
    torchrun starts each worker in a session of its own, out of reach of a signal to the launcher's process group."""
    import psutil

    try:
        tree = psutil.Process(pid)
        members = [tree, *tree.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in members:
        try:
            member.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def settled(argv=(), **facts):
    """The configuration settle() makes of `argv` with the given facts (default: one CPU process, no native bf16,
    nothing read from disk), so a unit test's verdict never depends on the machine it runs on."""
    from recipe.settings.arguments import parse_arguments
    from recipe.settings.configuration import settle
    from recipe.settings.facts import Facts

    return settle(parse_arguments(list(argv)), Facts(**facts))


def base_model(argv):
    """The base model exactly as train.py builds it for `argv`, before any training."""
    import train
    from recipe.settings.configuration import configure

    return train.build_base_model(configure(list(argv))).eval()


def probe_logits(model, tokenizer):
    import torch

    with torch.no_grad():
        return model.eval()(**tokenizer([PROBE], return_tensors="pt")).logits.float()


def tiny_llama_config(tokenizer, **overrides):
    """The tests' Llama: 2 layers of 64, grouped attention, the tokenizer's vocabulary and special tokens, tied
    embeddings; `overrides` change any of it."""
    from transformers import LlamaConfig

    values = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    return LlamaConfig(**{**values, **overrides})


def losses(log_history, with_grad_norm: bool = False) -> list:
    """Each logged step's training loss (with its grad norm: pairs) from a Trainer's log history."""
    return [(entry["loss"], entry["grad_norm"]) if with_grad_norm else entry["loss"]
            for entry in log_history if "loss" in entry]


def losses_by_step(out_dir) -> dict[int, float]:
    """A finished run's training losses by step, from the run_summary.json in its output folder."""
    import json

    history = json.loads((Path(out_dir) / "run_summary.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def pytest_collection_modifyitems(items):
    """The tests that mostly wait first, then those that train or launch, the unit tier last (a stable sort: file order
    otherwise). The Makefile's workers take one test at a time, in this order: a waiting test beside the other worker's
    launches keeps both cores busy, and short tests at the end fill both cores until the last moment. The 2-process
    launches stay in file order among the one-process runs: two launches at a time on two cores cost more CPU each."""
    def order(item):
        if item.get_closest_marker("waits"):
            return 0
        return 1 if item.get_closest_marker("multiprocess") or item.get_closest_marker("e2e") else 2
    items.sort(key=order)


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


def pytest_generate_tests(metafunc):
    """Where this machine runs bf16 natively, each test marked native_bf16 runs twice in the same session: as it is,
    and as on a CPU without native bf16 (hardware.NATIVE_BF16_SWITCH=0, which the recipe's subprocesses inherit)."""
    if metafunc.definition.get_closest_marker("native_bf16") is None:
        return
    from recipe.platform.hardware import native_bf16_supported

    if "repeat_without_native_bf16" not in metafunc.fixturenames:
        metafunc.fixturenames.append("repeat_without_native_bf16")
    paths = ["native-bf16", "no-native-bf16"] if native_bf16_supported() else ["no-native-bf16"]
    metafunc.parametrize("repeat_without_native_bf16", paths, indirect=True)


@pytest.fixture
def repeat_without_native_bf16(request, monkeypatch) -> bool:
    """True in the second pass of a native_bf16 test on a machine with native bf16, where the probe now says no."""
    from recipe.platform.hardware import NATIVE_BF16_SWITCH, native_bf16_supported

    if request.param == "no-native-bf16" and native_bf16_supported():
        monkeypatch.setenv(NATIVE_BF16_SWITCH, "0")
        return True
    return False


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from recipe.model.model_files import convert_default_model

    return convert_default_model()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A 2-layer Llama with SmolLM2's vocabulary and tokenizer, randomly initialised: trains in seconds."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    # initializer_range wider than 0.02, so logits are not flat and LoRA moves the loss fast
    config = tiny_llama_config(smol_tokenizer, initializer_range=0.2)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    smol_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def wide_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A 2-layer Llama whose weights are mostly its 512-wide embedding (0.1 GiB in fp32): big enough for memory to be
    measured above the runtime's noise, small enough to step in a second."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(smol_tokenizer, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                               num_key_value_heads=4)
    out = tmp_path_factory.mktemp("wide-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    smol_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory) -> Path:
    """A small copy of the demo data: 64 train and 8 test conversations."""
    out = tmp_path_factory.mktemp("dates")
    for split, n in (("train", 64), ("test", 8)):
        lines = (REPO / "data" / "dates" / f"{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def recipe_examples(smol_tokenizer):
    """The first n train examples of a data folder, tokenized as the recipe tokenizes them (input_ids, labels)."""
    from recipe.data.training_data import drop_bad, load_splits, tokenize_splits

    def tokenize(source: Path, n: int) -> list[dict]:
        raw, _, data_format, _ = load_splits(str(source), ["train"])
        raw["train"] = raw["train"].select(range(n))
        tokenized, _ = tokenize_splits(raw, data_format, smol_tokenizer, max_length=512, truncate=True)
        return list(drop_bad(tokenized, [])["train"])

    return tokenize

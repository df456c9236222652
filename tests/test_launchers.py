"""Every launcher, run by bash as users run it, with a stand-in `accelerate` that records its arguments: the
accelerate config builds its plugin and the train.py arguments parse into the real dataclasses."""

import json
import os
import re
import stat
import sys
import subprocess

import pytest
from conftest import settled

from recipe.platform.launch import launch_environment
from recipe.model.model_files import REPO_DIR

LAUNCHERS = sorted(REPO_DIR.glob("run_*.sh"))
RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["ARGV_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "node": os.environ.get("SLURM_NODEID"),
                        "grace": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}}) + "\\n")
"""


@pytest.fixture
def fake_bin(tmp_path):
    """A folder with stand-ins for the commands a launcher calls, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def add(name, text):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)

    add("accelerate", RECORDER)
    # SLURM: two nodes; srun runs its command once per node, as SLURM does with one task per node
    # the first node is this machine: machine rank 0's check binds the rendezvous port on it
    add("scontrol", "#!/usr/bin/env bash\nprintf 'localhost\\ngpu-node-b\\n'\n")
    add("srun", "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                "for node in 0 1; do SLURM_NODEID=$node SLURM_NNODES=2 \"$@\" || exit 1; done\n")
    return bin_dir


def run(script, fake_bin, *args, **env) -> list[dict]:
    log = fake_bin.parent / "argv.jsonl"
    log.unlink(missing_ok=True)
    result = subprocess.run(["bash", str(script), *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "ARGV_LOG": str(log),
                                 "SLURM_JOB_NODELIST": "gpu-node-[a-b]", **env})
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """accelerate's own arguments and train.py's."""
    assert argv[0] == "launch"
    at = argv.index("train.py")
    return argv[1:at], argv[at + 1 :]


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_runs_one_accelerate_command_with_the_recipe(script, fake_bin):
    (call,) = run(script, fake_bin, "--max_steps", "7", MODEL="org/other-model", DATASET="org/other-data")
    launch_args, train_args = split(call["argv"])
    assert int(call["grace"]) >= 120  # the launcher waits for the step and the save after a signal (not 30 s)
    config = launch_args[launch_args.index("--config_file") + 1]
    assert (REPO_DIR / config).is_file()

    settled_run = settled(train_args, cuda=True, here=False, native_bf16=True)  # as on the launchers' GPU machines
    model_args, data_args, training_args = settled_run.model, settled_run.data, settled_run.training
    assert (model_args.model_name_or_path, data_args.dataset_name) == ("org/other-model", "org/other-data")
    assert training_args.max_steps == 7  # "$@" comes last and wins
    assert (model_args.lora_r, model_args.lora_alpha, model_args.lora_targets) == (8, 16, "all-linear")
    assert training_args.packing and training_args.bf16 and training_args.activation_checkpointing
    assert training_args.max_length == 2048 and model_args.chat_template_format == "zephyr"

    qlora = "qlora" in script.name
    deepspeed = "deepspeed" in config
    assert model_args.use_4bit_quantization is qlora
    if qlora:  # storage dtype == load dtype == compute dtype: FSDP / ZeRO-3 flatten one dtype
        assert model_args.bnb_4bit_quant_storage_dtype == model_args.bnb_4bit_compute_dtype == "bfloat16"
        assert str(settled_run.dtype) == "torch.bfloat16"
    # reentrant checkpointing for QLoRA and for ZeRO-3 (non-reentrant fails there); LoRA + FSDP keeps the reference's
    assert model_args.use_reentrant is (qlora or deepspeed)
    env = launch_environment([*launch_args, "train.py"])
    assert env["ACCELERATE_USE_DEEPSPEED" if deepspeed else "ACCELERATE_USE_FSDP"] == "true"


def test_accelerate_config_can_be_swapped_without_editing(fake_bin):
    (call,) = run(REPO_DIR / "run_peft_fsdp.sh", fake_bin, ACCELERATE_CONFIG="configs/fsdp_config.yaml")
    launch_args, _ = split(call["argv"])
    assert launch_args[launch_args.index("--config_file") + 1] == "configs/fsdp_config.yaml"


@pytest.mark.parametrize("config, reentrant", [(None, False), ("configs/deepspeed_config_multinode.yaml", True)])
def test_slurm_script_starts_accelerate_on_every_node(fake_bin, config, reentrant):
    env = {"ACCELERATE_CONFIG": config} if config else {}
    calls = run(REPO_DIR / "slurm" / "run_peft_fsdp_multinode.sbatch", fake_bin, "--max_steps", "3", **env)
    assert [c["node"] for c in calls] == ["0", "1"]
    script = (REPO_DIR / "slurm" / "run_peft_fsdp_multinode.sbatch").read_text()
    warning = int(re.search(r"--signal=TERM@(\d+)", script)[1])
    assert all(120 <= int(c["grace"]) < warning for c in calls)  # the step and the save, before SLURM's hard kill
    for rank, call in enumerate(calls):
        launch_args, train_args = split(call["argv"])
        flags = dict(zip(launch_args[::2], launch_args[1::2]))
        assert flags["--machine_rank"] == str(rank) and flags["--main_process_ip"] == "localhost"
        assert flags["--num_machines"] == "2" and flags["--num_processes"] == "16"
        assert flags["--config_file"] == (config or "configs/fsdp2_config_multinode.yaml")
        settled_run = settled(train_args)
        assert settled_run.training.max_steps == 3 and settled_run.model.use_reentrant is reentrant
        env = launch_environment([*launch_args, "train.py"])
        assert env["ACCELERATE_USE_DEEPSPEED" if config else "ACCELERATE_USE_FSDP"] == "true"


def test_gpu_smoke_script_says_so_without_a_gpu(fake_bin):
    """On CPU hosts it stops at once with one clear line (nvidia-smi fails here: the stand-in exits non-zero)."""
    (fake_bin / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    result = subprocess.run([sys.executable, "bench/gpu_smoke.py"], cwd=REPO_DIR, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert result.returncode == 1 and "error: no NVIDIA GPU found" in result.stderr

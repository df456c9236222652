"""Past one machine, on this host: two machines of one process each, every machine its own launch through
preemptible.sh and a shipped multi-machine config, found through a static rendezvous on 127.0.0.1 (gloo). The SLURM
script run unmodified with stand-ins for srun and scontrol only; a machine killed, a machine preempted, and the resume
on two machines that reaches the uninterrupted run; a machine started with a wrong rank or a taken port.

(tests/test_distributed.py trains FSDP2 LoRA and QLoRA and ZeRO-3 LoRA on two machines against one process.)"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import end_together, free_port, losses_by_step, machine_launch, node_launch, signal_tree, tiny_run_args
from safetensors.torch import load_file
from test_reliability import recipe, straight_run

from recipe.engines.checkpoints import COMPLETE, checkpoints, latest_complete
from recipe.platform.launch import machine_settings, node_problems
from recipe.model.model_files import REPO_DIR

MULTINODE_FSDP2 = REPO_DIR / "configs" / "fsdp2_config_multinode.yaml"


class Machine:
    """One machine's launch: `preemptible.sh accelerate launch ... --machine_rank R`, in its own process group (what
    SLURM signals on one node), its output in a file."""

    def __init__(self, rank: int, port: int, argv: list[str], log: Path, script="train.py", launch=None, **env):
        """`launch`: another launch command than machine `rank` of two (two processes of one machine, say)."""
        self.log = log
        self.process = subprocess.Popen(
            ["bash", "preemptible.sh", *(launch or node_launch(MULTINODE_FSDP2, rank, port)), script, *argv],
            cwd=REPO_DIR,
            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env})

    @property
    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout=300) -> int:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_every_process(signal.SIGKILL)
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-4000:]}") from None
        return self.process.returncode

    def signal_every_process(self, signum) -> None:
        signal_tree(self.process.pid, signum)  # the launcher script, torchrun's agent and the workers


def two_machines(argv, folder: Path, script="train.py", **env) -> list[Machine]:
    port = free_port()
    folder.mkdir()
    return [Machine(rank, port, argv, folder / f"machine{rank}.log", script, **env) for rank in (0, 1)]


def wait_until(predicate, machines, timeout=300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        for machine in machines:
            assert machine.process.poll() is None, machine.output[-4000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_a_wrong_machine_rank_or_a_taken_port_is_named_before_anything_starts():
    """Under a static rendezvous each machine is the rank it is given and machine rank 0 hosts the rendezvous: any of
    these would leave the other machines waiting until the rendezvous times out."""
    def launch(rank, port=29555, address="127.0.0.1", machines=2):
        return ["accelerate", "launch", "--config_file", str(MULTINODE_FSDP2), "--num_machines", str(machines),
                "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", address,
                "--main_process_port", str(port), "train.py", "--max_steps", "1"]

    port = free_port()
    assert node_problems(launch(0, port), {}) == [] and node_problems(launch(1, port), {"SLURM_NODEID": "1"}) == []
    (problem,) = node_problems(launch(2), {})
    assert "--machine_rank 2 with --num_machines 2" in problem
    (problem,) = node_problems(launch(0), {"SLURM_NODEID": "1", "SLURM_NNODES": "2"})  # every node told rank 0
    assert "--machine_rank 0, but SLURM says SLURM_NODEID=1" in problem
    (problem,) = node_problems(launch(0, address="192.0.2.1"), {})  # a documentation address, never this machine's
    assert "not an address of this machine" in problem
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        (problem,) = node_problems(launch(0, port), {})
        assert f"--main_process_port {port} is already in use" in problem
        assert node_problems(launch(1, port), {}) == []  # only machine rank 0 binds it


def test_only_a_lost_rank_or_a_collective_timeout_is_reported_as_one():
    """Those end the run with one line and the resume; any other error keeps its traceback."""
    from recipe.engines.failures import lost_rank

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18823. This is "
                        "typically caused by a remote worker crashing.\nmore")
    assert lost_rank(gloo) == "RuntimeError: " + str(gloo).splitlines()[0]
    assert lost_rank(RuntimeError("[pair.cc:598] Timed out waiting 120000ms for recv operation to complete"))
    assert lost_rank(torch.distributed.DistBackendError("Watchdog caught collective operation timeout"))
    assert lost_rank(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


@pytest.mark.parametrize("config", sorted((REPO_DIR / "configs").glob("*config*.yaml")), ids=lambda p: p.name)
def test_the_machine_settings_are_read_as_accelerate_reads_them(config):
    """launch.machine_settings reads the flags and the config file without accelerate (which imports torch); accelerate
    1.15's own reading must agree, flags over the config, and its rendezvous is static whatever the config says."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    for flags in ([], ["--machine_rank", "1", "--num_machines", "3", "--main_process_ip", "10.0.0.7",
                       "--main_process_port", "29611"]):
        command = ["--config_file", str(config), "--num_processes", "2", *flags, "train.py", "--machine_rank", "9"]
        ours = machine_settings(["accelerate", "launch", *command], {})
        theirs, _, _ = _validate_launch_command(launch_command_parser().parse_args(command))
        assert ours == {key: getattr(theirs, key) for key in ours}
        assert theirs.rdzv_backend == "static"  # preemptible.sh's check relies on each machine being its given rank


@pytest.mark.multiprocess
def test_a_taken_port_stops_the_launch_script_at_once(tiny_model_dir, chat_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        machine = Machine(0, port, tiny_run_args(tiny_model_dir, chat_dir, tmp_path / "out"), tmp_path / "m0.log")
        assert machine.wait(timeout=60) == 2
    assert f"error: --main_process_port {port} is already in use" in machine.output
    assert "Traceback" not in machine.output and not (tmp_path / "out").exists()


SRUN = f"""#!{sys.executable}
# srun --kill-on-bad-exit=1 CMD...: the command once per node, concurrently, with the variables SLURM sets for a task;
# the first task to fail ends the others, as that flag does
import os, subprocess, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import end_together

command = sys.argv[1:]
while command[0].startswith("--"):
    command.pop(0)
def task(node):
    variables = {{"SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_NNODES": "2"}}
    log = open(os.path.join(os.environ["SRUN_LOGS"], f"node{{node}}.log"), "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={{**os.environ, **variables}})


codes = end_together([task(0), task(1)], timeout=300)
sys.exit(next((code for code in codes if code), 0))
"""


@pytest.mark.multiprocess
def test_the_slurm_script_unmodified_trains_on_two_nodes(tiny_model_dir, chat_dir, tmp_path):
    """sbatch's part is played by the environment it gives the batch script (SLURM_JOB_NODELIST, SLURM_SUBMIT_DIR);
    srun starts the per-node command on each "node" and scontrol names the nodes (both this host). The real
    preemptible.sh, accelerate launch and train.py run; the shared 70B flags are overridden by the user's flags after
    the script, as a user would on a small model."""
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir(), logs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", "#!/usr/bin/env bash\nprintf 'localhost\\nlocalhost\\n'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run"
    flags = tiny_run_args(tiny_model_dir, chat_dir, out, "--max_steps", "2", "--per_device_train_batch_size", "2",
                          "--gradient_accumulation_steps", "1", "--splits", "train", "--eval_strategy", "no",
                          "--save_strategy", "no", "--max_length", "256", "--use_flash_attn", "false",
                          "--activation_checkpointing", "false")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_NODELIST": "node-[0-1]",
                   "SLURM_SUBMIT_DIR": str(REPO_DIR),
                   "GPUS_PER_NODE": "1", "MAIN_PORT": str(free_port()), "SRUN_LOGS": str(logs),
                   "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(REPO_DIR / "slurm" / "run_peft_fsdp_multinode.sbatch"), *flags],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, env=environment)
    node_logs = [(logs / f"node{node}.log").read_text() for node in (0, 1)]
    assert result.returncode == 0, result.stderr[-2000:] + node_logs[0][-3000:] + node_logs[1][-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["results"]["train_steps"] == 2 and len(summary["results"]["memory_by_rank"]) == 2
    assert "2 x cpu" in node_logs[0]  # both machines in one run of two ranks
    assert load_file(out / "adapter_model.safetensors")


@pytest.mark.multiprocess
def test_a_killed_machine_stops_the_other_and_a_preempted_one_stops_both_then_two_machines_resume_exactly(
        tiny_model_dir, chat_dir, tmp_path, tmp_path_factory):
    """1. Machine 1 killed (SIGKILL to all its processes, as a node failure) after checkpoint 4: machine 0 stops with
    an error naming the lost ranks, the collective timeout and the resume, well within that timeout. Then the newest
    checkpoint's FSDP2 shards are truncated on disk (tests/test_reliability.py does the same on one process and
    ZeRO-3).
    2. Resumed on two machines from the intact checkpoint before it; SIGTERM to machine 0 alone (as SLURM's warning,
    or preemption of one node): both machines save the same step and both launches exit 143.
    3. Resumed again: the losses after the resume point and the final adapter are the uninterrupted run's."""
    straight_out = straight_run(tiny_model_dir, chat_dir, tmp_path_factory)
    out = tmp_path / "run"
    argv = recipe(tiny_model_dir, chat_dir, out, 8, "--per_device_train_batch_size", "4", "--ddp_timeout", "120")
    slow = {"SLOW_STEP_SECONDS": "0.5"}  # room to act between two checkpoints
    machines = two_machines(argv, tmp_path / "killed", script="tests/slow_step_worker.py", **slow)
    wait_until(lambda: (out / "checkpoint-4" / COMPLETE).is_file(), machines)
    machines[1].signal_every_process(signal.SIGKILL)
    killed = time.time()
    assert machines[0].wait(timeout=150) not in (0, 143)
    assert time.time() - killed < 60  # gloo sees the closed connections; the timeout bounds what it would not see
    output = machines[0].output
    assert "collective timeout 120 s" in output  # said at the start
    assert "lost the other ranks" in output and "(--ddp_timeout)" in output, output[-4000:]
    assert "--resume_from_checkpoint latest (last complete checkpoint:" in output
    machines[1].wait()
    completed = sorted(step for step, _, done in checkpoints(out) if done)
    damaged = out / f"checkpoint-{completed[-1]}"
    shard = max(damaged.glob("pytorch_model_fsdp_0/*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])

    resumed = [*argv, "--resume_from_checkpoint", "latest"]
    machines = two_machines(resumed, tmp_path / "preempted", script="tests/slow_step_worker.py", **slow)
    wait_until(lambda: losses_in(machines[0]), machines)  # a step of the resumed run done, the next begun
    assert f"skipping {damaged}, damaged after it was written: {shard} has" in machines[0].output
    assert f"resuming from {out / f'checkpoint-{completed[-2]}'}" in machines[0].output
    machines[0].signal_every_process(signal.SIGTERM)
    codes = [machine.wait(timeout=120) for machine in machines]
    assert codes == [143, 143], [m.output[-3000:] for m in machines]
    stopped = [line for line in machines[0].output.splitlines() if "stopped by signal 15 at step" in line]
    assert stopped, machines[0].output[-3000:]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert (out / f"checkpoint-{step}" / COMPLETE).is_file() and step < 8
    assert {p.name for p in (out / f"checkpoint-{step}").glob("rng_state_*.pth")} == {"rng_state_0.pth",
                                                                                     "rng_state_1.pth"}

    machines = two_machines(resumed, tmp_path / "finished")
    codes = end_together([machine.process for machine in machines], timeout=300)
    assert codes == [0, 0], [machine.output[-3000:] for machine in machines]
    assert f"resuming from {out / f'checkpoint-{step}'}" in machines[0].output
    straight, final = losses_by_step(straight_out), losses_by_step(out)
    after = [s for s in straight if s > step]
    assert after and all(abs(final[s] - straight[s]) <= 1e-5 * abs(straight[s]) for s in after), (straight, final)
    a, b = load_file(straight_out / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    for name in a:  # two processes differ from one by reduction order, amplified by AdamW (as tests/test_reliability)
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("machines", [1, 2])
def test_one_ranks_full_disk_ends_every_rank_and_the_run_resumes(tiny_model_dir, chat_dir, tmp_path, machines):
    """Rank 1's disk fills during its part of a checkpoint (tests/full_disk_worker.py), on two processes of one machine
    and on two machines, where no launcher stops the other: every rank exits, non-zero, within seconds; the error that
    names the disk is printed once in each machine's log; the checkpoint before is complete and the run resumes from
    it to the end."""
    out = tmp_path / "run"
    argv = recipe(tiny_model_dir, chat_dir, out, 6, "--per_device_train_batch_size", "4")
    mark = tmp_path / "disk-full-at"  # a checkpoint is two writes (model, optimizer): the 3rd is checkpoint-4's first
    env = {"FULL_DISK_RANK": "1", "FULL_DISK_FROM_WRITE": "3", "FULL_DISK_MARK": str(mark)}
    one_machine = machine_launch(REPO_DIR / "configs" / "fsdp2_config.yaml")
    launches = (two_machines(argv, tmp_path / "full", script="tests/full_disk_worker.py", **env) if machines == 2 else
                [Machine(0, 0, argv, tmp_path / "full.log", "tests/full_disk_worker.py", one_machine, **env)])
    codes = [launch.wait(timeout=300) for launch in launches]
    ended = time.time()
    logs = [launch.output for launch in launches]
    assert all(code not in (0, None) for code in codes), logs
    assert ended - float(mark.read_text()) < 60
    for log in logs:
        said = [line for line in log.splitlines() if "No space left on device" in line]
        assert len(said) == 1 and f"cannot write to {out}" in said[0], log[-4000:]
        assert "]: Traceback" not in log, log[-4000:]  # no rank's traceback ("[rank1]: Traceback ...")
    assert f"(last complete checkpoint: {out / 'checkpoint-2'})" in logs[-1]
    assert latest_complete(out) == str(out / "checkpoint-2") and not (out / "checkpoint-4" / COMPLETE).exists()

    resumed = [*argv, "--resume_from_checkpoint", "latest"]
    launches = (two_machines(resumed, tmp_path / "resumed") if machines == 2 else
                [Machine(0, 0, resumed, tmp_path / "resumed.log", launch=one_machine)])
    assert [launch.wait(timeout=300) for launch in launches] == [0] * machines, [m.output[-3000:] for m in launches]
    assert f"resuming from {out / 'checkpoint-2'}" in launches[0].output
    assert (out / "checkpoint-6" / COMPLETE).is_file()


def losses_in(machine: Machine) -> list[str]:
    """The loss lines machine rank 0 has logged so far."""
    return [line for line in machine.output.splitlines() if "'loss'" in line]

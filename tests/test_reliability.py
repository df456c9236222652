"""Reliability with real processes and real signals: exact resume after SIGKILL, half-written checkpoints,
preemption by SIGTERM / SIGINT, rotation, unwritable output, and tokens kept out of every file."""

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import losses_by_step, signal_tree, tiny_run_args
from safetensors.torch import load_file

from recipe.engines.checkpoints import COMPLETE, checkpoints, latest_complete, rotate
from recipe.model.model_files import REPO_DIR


def recipe(model_dir, data_dir, out, steps=8, *extra):
    return tiny_run_args(model_dir, data_dir, out, "--max_steps", str(steps), "--save_strategy", "steps",
                         "--save_steps", "2", "--splits", "train", "--learning_rate", "1e-2", *extra)


def start(argv, launcher=()):
    return subprocess.Popen([*launcher, sys.executable, "train.py", *argv] if not launcher else [*launcher, *argv],
                            cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for(predicate, process, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.02)
    raise AssertionError("timed out")


def finish(argv, launcher=()):
    process = start(argv, launcher)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-3000:]
    return output


def kill_after_checkpoint(argv, out, step, launcher=()):
    process = start(argv, launcher)
    wait_for(lambda: (out / f"checkpoint-{step}" / COMPLETE).is_file(), process)
    signal_tree(process.pid, signal.SIGKILL)  # the launch and its workers, as a node failure would
    process.wait()
    assert process.returncode == -signal.SIGKILL


def straight_run(model_dir, data_dir, tmp_path_factory) -> Path:
    """The uninterrupted 8-step run on one process: the reference of every resume test, run once per test session
    (the pytest-xdist workers share it through a lock). Two processes of half the batch train the same steps
    (tests/test_distributed.py: losses within 1e-5, here 1e-7)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has a folder of its own under the session's
        shared = shared.parent
    out = shared / "straight-run"
    with FileLock(f"{out}.lock"):
        if not (out / "run_summary.json").is_file():  # in this process: `python train.py ARGS` is train.run(ARGS)
            import train

            train.run(recipe(model_dir, data_dir, out, 8, "--overwrite_output_dir", "true"))
    return out


# FSDP2: the same on two machines, with its sharded checkpoint damaged (tests/test_multinode.py)
@pytest.mark.parametrize("config", [pytest.param(None, marks=pytest.mark.e2e, id="one-process"),
                                    pytest.param("deepspeed_config.yaml", marks=pytest.mark.multiprocess,
                                                 id="zero3-2-processes")])
def test_killed_run_resumes_to_the_same_losses_and_weights(tiny_model_dir, chat_dir, tmp_path, tmp_path_factory,
                                                            config, capsys):
    distributed = config is not None
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/{config}",
                "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0", "train.py") \
        if distributed else ()
    batch = ["--per_device_train_batch_size", "4"] if distributed else []
    straight_out = straight_run(tiny_model_dir, chat_dir, tmp_path_factory)

    out = tmp_path / "killed"
    kill_after_checkpoint(recipe(tiny_model_dir, chat_dir, out, 8, *batch), out, 4, launcher)
    completed = [step for step, _, done in checkpoints(out) if done]
    assert len(completed) >= 2 and max(completed) < 8, completed  # killed between checkpoints, before the end
    partial = out / "checkpoint-99"  # what a kill during a save leaves: files, no completion marker
    partial.mkdir()
    (partial / "optimizer.pt").write_bytes(b"truncated")
    assert latest_complete(out).endswith(f"checkpoint-{max(completed)}")
    # The newest complete checkpoint then damaged on disk: its weights (one process: the adapter; ZeRO-3: the largest
    # of the adapter and the partitioned model states) truncated to half. `latest` falls back to the one before.
    damaged = out / f"checkpoint-{max(completed)}"
    weights = max((p for p in damaged.rglob("*") if p.suffix == ".safetensors" or "model_states" in p.name),
                  key=lambda p: p.stat().st_size)
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    completed.remove(max(completed))

    resume = recipe(tiny_model_dir, chat_dir, out, 8, *batch, "--resume_from_checkpoint", "latest")
    if distributed:
        output = finish(resume, launcher)
    else:  # in this process: `python train.py ARGS` is train.run(ARGS)
        import train

        train.run(resume)
        output = "".join(capsys.readouterr())
    assert f"skipping {damaged}, damaged after it was written: {weights} has" in output
    assert f"resuming from {out / f'checkpoint-{max(completed)}'}" in output
    straight, resumed = losses_by_step(straight_out), losses_by_step(out)
    after = [step for step in straight if step > max(completed)]
    assert after and all(abs(resumed[s] - straight[s]) <= 1e-5 * abs(straight[s]) for s in after), (straight, resumed)
    a, b = load_file(straight_out / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    # Every shard and the AdamW state restored: a reset half or reset moments would move weights by ~1e-2 (the
    # learning rate); 2 processes differ from one by reduction order, amplified by AdamW to 2e-6 (measured)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5 if distributed else 1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("signum", [signal.SIGINT], ids=["SIGINT"])  # SIGTERM: through a launch, below
def test_signal_saves_a_checkpoint_and_exits_cleanly(tiny_model_dir, chat_dir, tmp_path, signum):
    out = tmp_path / "run"
    argv = recipe(tiny_model_dir, chat_dir, out, 400, "--save_steps", "1000")  # only the checkpoint the signal asks for
    process = start(argv)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    wait_for(lambda: sum("'loss'" in line for line in lines) >= 2, process, 180)  # mid-training
    sent = time.time()
    os.killpg(process.pid, signum)
    process.wait(timeout=60)
    reader.join(timeout=10)
    output = "".join(lines)
    assert time.time() - sent < 30, "the run must stop within a bounded time"
    assert process.returncode == 128 + signum, output[-2000:]
    assert "stopped by signal" in output and "--resume_from_checkpoint latest" in output
    checkpoint = latest_complete(out)
    assert checkpoint is not None
    step = int(Path(checkpoint).name.split("-")[1])
    assert 0 < step < 400  # a checkpoint like any other (the tests above resume from them)


@pytest.mark.multiprocess
@pytest.mark.waits  # 35 s of its step asleep
def test_sigterm_to_a_launch_saves_every_rank_at_one_step_past_the_default_grace(tiny_model_dir, chat_dir, tmp_path):
    """SLURM's warning reaches every process of the job: the launcher script, `accelerate launch` (torchrun's agent),
    which forwards its own copy to the workers, and the workers themselves. With a step longer than the agent's
    default 30 s grace, preemptible.sh's grace lets each rank finish the step and save, the repeated SIGTERM
    interrupts nothing, the checkpoint is complete, and the launch exits 143 (the agent alone would exit 1). (Two
    SIGTERMs close together may reach Python as one; test_a_repeated_signal_interrupts_no_save sends them apart.)"""
    out = tmp_path / "run"
    launch = ["bash", "preemptible.sh", sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              "configs/fsdp2_config.yaml", "--num_processes", "2", "--mixed_precision", "no",
              "--main_process_port", "0", "tests/slow_step_worker.py"]
    argv = recipe(tiny_model_dir, chat_dir, out, 50, "--save_steps", "1000", "--per_device_train_batch_size", "4")
    environment = {key: value for key, value in os.environ.items() if key != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    process = subprocess.Popen([*launch, *argv], cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True,
                               env={**environment, "OMP_NUM_THREADS": "1", "SLOW_STEP_SECONDS": "35"})
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    wait_for(lambda: any("'loss'" in line for line in lines), process, 240)  # step 1 done, the slow step 2 begun
    signal_tree(process.pid, signal.SIGTERM)  # every process, as SLURM signals a job step
    process.wait(timeout=180)
    reader.join(timeout=10)
    output = "".join(lines)
    assert process.returncode == 143, output[-3000:]
    assert "stopped by signal 15 at step 2" in output
    checkpoint = latest_complete(out)
    assert checkpoint is not None and Path(checkpoint).name == "checkpoint-2", output[-3000:]
    assert {p.name for p in Path(checkpoint).glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}


def test_a_repeated_signal_interrupts_no_save(capsys):
    """The launcher's forwarded SIGTERM after SLURM's own is ignored, and so is any signal while a checkpoint is being
    saved; the first one alone decides (this process signals itself; its handlers are restored afterwards)."""
    from recipe.engines.checkpoints import StopOnSignal

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopOnSignal()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again: still running
        with stop.saving_checkpoint():
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C during the save: the save goes on
        assert stop.received == signal.SIGTERM and capsys.readouterr().err.count("again: ignored") == 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_rotation_keeps_the_limit_the_newest_and_the_resumed_one(tmp_path):
    for step, done in [(2, True), (4, True), (5, False), (6, True), (8, True), (10, False)]:
        (tmp_path / f"checkpoint-{step}").mkdir()
        if done:
            (tmp_path / f"checkpoint-{step}" / COMPLETE).write_text("{}")
    removed = rotate(tmp_path, 1, protected={tmp_path / "checkpoint-2"})
    assert sorted(p.name for p in removed) == ["checkpoint-4", "checkpoint-5", "checkpoint-6"]
    assert [p.name for _, p, _ in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8", "checkpoint-10"]


@pytest.mark.e2e
def test_rotation_never_deletes_the_best_checkpoint(tiny_model_dir, chat_dir, tmp_path):
    """load_best_model_at_end + save_total_limit 1: the best checkpoint (here, by choice, the one with the highest eval
    loss: the first) survives every rotation, and the run ends with its weights, not the last ones."""
    import train

    out = tmp_path / "run"
    trainer, _ = train.run(tiny_run_args(
        tiny_model_dir, chat_dir, out, "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2",
        "--eval_strategy", "steps", "--eval_steps", "2", "--save_total_limit", "1", "--load_best_model_at_end", "true",
        "--metric_for_best_model", "eval_loss", "--greater_is_better", "true", "--learning_rate", "1e-2"))
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e and e["step"] <= 6}
    best = max(evals, key=evals.get)
    assert best < 6 and trainer.state.best_model_checkpoint == str(out / f"checkpoint-{best}")
    # Every rotation kept it; at the end transformers removes the last checkpoint itself (a limit of 1, best kept)
    assert [p.name for _, p, _ in checkpoints(out)] == [f"checkpoint-{best}"]
    best_adapter = load_file(out / f"checkpoint-{best}" / "adapter_model.safetensors")
    final = load_file(out / "adapter_model.safetensors")
    assert all(torch.equal(final[name], best_adapter[name]) for name in best_adapter)


@pytest.mark.e2e
def test_output_dir_with_another_run_is_kept_unless_asked(tiny_model_dir, chat_dir, tmp_path, capsys):
    import train

    out = tmp_path / "run"
    train.run(recipe(tiny_model_dir, chat_dir, out, 2))
    # what `python train.py` exits with (tests/test_errors.py: the command)
    with pytest.raises(SystemExit) as exit_info:
        train.run(recipe(tiny_model_dir, chat_dir, out, 2))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "already holds a run" in err and "--overwrite_output_dir" in err
    trainer, _ = train.run([*recipe(tiny_model_dir, chat_dir, out, 2), "--overwrite_output_dir", "true"])
    assert trainer.state.global_step == 2


@pytest.mark.e2e
def test_unwritable_output_is_refused_before_training(tmp_path, capsys):
    import train  # `python train.py ARGS` is train.run(ARGS); the exit code is SystemExit's

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        train.run(["--output_dir", str(blocker / "out")])
    assert exit_info.value.code == 2 and "cannot be created or written" in capsys.readouterr().err


@pytest.mark.e2e
def test_disk_full_during_a_save_is_reported(tiny_model_dir, chat_dir, tmp_path, monkeypatch, capsys):
    import errno

    import train
    from recipe.engines.checkpoints import CompleteCheckpointsMixin

    def full(self, model, trial):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoint-2"))

    monkeypatch.setattr(CompleteCheckpointsMixin, "_save_checkpoint", full)
    with pytest.raises(SystemExit) as exit_info:
        train.run(recipe(tiny_model_dir, chat_dir, tmp_path / "run", 2))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "--resume_from_checkpoint latest" in err


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 32 MiB filesystem (tmpfs): mounting one needs root, as on the CI machines."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated full disk above still runs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(folder: Path) -> Path:
    """Write zeros until the filesystem under `folder` has no space left."""
    ballast = folder / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return ballast


@pytest.mark.e2e
def test_a_real_full_disk_during_a_save_keeps_the_last_checkpoint_and_resumes(tiny_model_dir, chat_dir,
                                                                               small_filesystem, monkeypatch):
    out = small_filesystem / "run"
    argv = recipe(tiny_model_dir, chat_dir, out, 8)  # a checkpoint every 2 steps
    monkeypatch.setenv("SLOW_STEP_SECONDS", "1.5")  # time to fill the disk between two checkpoints
    process = start(argv, (sys.executable, str(REPO_DIR / "tests" / "slow_step_worker.py")))
    wait_for(lambda: (out / "checkpoint-2" / COMPLETE).is_file(), process)
    ballast = fill(small_filesystem)  # the next save (step 4) finds no space
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 2, output[-3000:]
    assert "No space left on device" in output and "Traceback" not in output, output[-3000:]
    assert f"last complete checkpoint: {out / 'checkpoint-2'}" in output, output[-3000:]
    assert latest_complete(out) == str(out / "checkpoint-2")
    load_file(out / "checkpoint-2" / "adapter_model.safetensors")  # intact

    ballast.unlink()  # space freed: the run continues where the last complete checkpoint left it
    output = finish(recipe(tiny_model_dir, chat_dir, out, 8, "--resume_from_checkpoint", "latest"))
    assert f"resuming from {out / 'checkpoint-2'}" in output
    assert max(losses_by_step(out)) == 8 and (out / "checkpoint-8" / COMPLETE).is_file()


def test_a_full_disk_is_recognised_whichever_library_hits_it(small_filesystem):
    """safetensors and torch.save do not raise OSError on a full disk (SafetensorError, RuntimeError "unexpected
    pos"); the run still reports it as a full disk, not as a crash."""
    from safetensors.torch import save_file

    from recipe.engines.failures import write_failure

    fill(small_filesystem)
    tensors = {"w": torch.zeros(100_000)}
    for save in (lambda: save_file(tensors, small_filesystem / "a.safetensors"),
                 lambda: torch.save(tensors, small_filesystem / "b.pt"),
                 lambda: (small_filesystem / "c.json").write_text("{}" * 100_000)):
        with pytest.raises(Exception) as caught:
            save()
        assert write_failure(caught.value, str(small_filesystem)).startswith("No space left on device")
    assert write_failure(ValueError("unrelated"), str(REPO_DIR)) is None


@pytest.mark.e2e
def test_a_planted_token_is_in_no_written_file(tiny_model_dir, chat_dir, tmp_path, capsys):
    import train

    planted = "hf_PLANTEDsecret9876543210abcdef"
    out = tmp_path / "run"
    train.run([*recipe(tiny_model_dir, chat_dir, out, 2), "--hub_token", planted])
    printed = capsys.readouterr()
    assert planted not in printed.out + printed.err and "--hub_token on the command line" in printed.err
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in written)  # the pickled arguments are among them
    for path in written:
        assert planted.encode() not in path.read_bytes(), path
    assert not [p for p in written if p.suffix in (".bin", ".pt", ".pth") and "model" in p.name]  # weights: safetensors


def test_a_rank_that_fails_stops_the_ranks_of_every_machine_through_the_rendezvous_store(monkeypatch, capsys):
    """What ends a rank whose main thread waits in a collective that NCCL would wait out: the failed rank's error,
    announced in the launch's store, read by the watch of every other rank, which leaves at once (exit code 1); a
    rank on another machine than the failed one says the error once."""
    from datetime import timedelta

    from recipe.engines import failures
    from conftest import free_port
    from recipe.platform.launch import Launch

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    exits = []
    stopped = threading.Event()

    def leave(code):
        exits.append(code)
        stopped.set()
        threading.Event().wait()  # as os._exit never returns

    monkeypatch.setattr(failures.os, "_exit", leave)
    monkeypatch.setattr(failures, "FAILED_RANK_LEAVES_S", 0.0)
    monkeypatch.setattr(failures, "STOPPING", threading.Lock())

    def rank(number: int, machine: int) -> Launch:
        return Launch({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(number),
                       "LOCAL_RANK": "0", "GROUP_RANK": str(machine), "TORCHELASTIC_USE_AGENT_STORE": "True"}, 2)

    assert failures.RankFailures.of(Launch({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, 2)) is None  # no
    # agent's store before the process group: none to watch
    watching = failures.RankFailures.of(rank(0, 0))
    failed = failures.RankFailures(rank(1, 1))
    assert watching.announced() is None and not stopped.wait(2 * failures.RankFailures.FAILURE_POLL_S)
    failed.announce("cannot write to /out: No space left on device (/out/checkpoint-4)")
    assert stopped.wait(5 * failures.RankFailures.FAILURE_POLL_S) and exits == [1]
    err = capsys.readouterr().err
    assert "error: rank 1 (machine 1) failed: cannot write to /out: No space left on device" in err
    assert "rank 0 stopped: rank 1 failed" in err
    assert failed.announced() is None  # its own announcement does not stop the failed rank
    del store

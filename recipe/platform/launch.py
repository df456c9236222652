"""The launch in effect: what `accelerate launch` gives each process (or would give it, for `train.py --check
--accelerate_config`), and the rest of the environment the recipe reads (the Hub's offline switch, the benchmarks'
phase marks). `Launch` is the one reader of the environment (what the recipe writes there for a library to read is
a patch in compat.py); everyone else is handed the settled launch. (platform/hardware.py reads the one switch that
settles a hardware fact.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


STORE_WAIT_S = 600  # what a rank waits for a key another rank sets in the rendezvous store


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    return env.get(name, str(default)).lower() in ("1", "true", "yes")


@dataclass
class Launch:
    """The distributed settings in effect, read from the environment `accelerate launch` gives each process (or
    would give it, for `train.py --check --accelerate_config`). The one place that reads those variables."""

    env: Mapping[str, str] = field(default_factory=dict)
    num_processes: int = 1

    @classmethod
    def current(cls) -> Launch:
        return cls(dict(os.environ), int(os.environ.get("WORLD_SIZE", 1)))

    @property
    def fsdp(self) -> bool:
        return _flag(self.env, "ACCELERATE_USE_FSDP")

    @property
    def deepspeed(self) -> bool:
        return _flag(self.env, "ACCELERATE_USE_DEEPSPEED")

    @property
    def fsdp_version(self) -> int:
        return int(self.env.get("FSDP_VERSION", "1"))

    @property
    def zero_stage(self) -> int | None:
        """From the accelerate config, or from the DeepSpeed JSON it points to."""
        if not self.deepspeed:
            return None
        if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in self.env:
            return int(self.env["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
        json_file = self.env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if json_file != "none" and Path(json_file).is_file():
            import json

            return json.loads(Path(json_file).read_text()).get("zero_optimization", {}).get("stage")
        return None

    @property
    def sharded(self) -> bool:
        """Parameters are flattened and split across ranks (FSDP, or ZeRO-3)."""
        return self.fsdp or self.zero_stage == 3

    def fsdp_setting(self, name: str, default: bool = False) -> bool:
        return _flag(self.env, f"FSDP_{name}", default)

    @property
    def mixed_precision(self) -> str:
        return self.env.get("ACCELERATE_MIXED_PRECISION", "no")

    @property
    def fsdp_sharding_strategy(self) -> str:
        """FSDP1's strategy: accelerate's launcher always exports one (FULL_SHARD unless the config says)."""
        return self.env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()

    @property
    def fsdp_reshard_after_forward(self) -> str:
        """FSDP2's setting as written ("" when the config has none; FSDP1 configs may carry a strategy name here)."""
        return self.env.get("FSDP_RESHARD_AFTER_FORWARD", "").upper()

    @property
    def fsdp_shards_gradients_only(self) -> bool:
        """SHARD_GRAD_OP (FSDP1) or reshard_after_forward false (FSDP2): parameters stay gathered between forward and
        backward."""
        if self.fsdp_version == 1:
            return self.fsdp_sharding_strategy == "SHARD_GRAD_OP"
        return self.fsdp_reshard_after_forward == "FALSE"

    @property
    def fsdp_wrap_policy(self) -> str:
        return self.env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")

    @property
    def fsdp_layer_classes(self) -> list[str]:
        """The decoder-layer classes the config names for FSDP to wrap (empty: the model's own _no_split_modules)."""
        return [name.strip() for name in self.env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if name.strip()]

    @property
    def deepspeed_offload(self) -> bool:
        return self.env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", "")

    def deepspeed_setting(self, name: str) -> str:
        """A DeepSpeed value the accelerate config wrote (ACCELERATE_<NAME>), "auto" where it wrote none."""
        return self.env.get(f"ACCELERATE_{name}", "auto")

    @property
    def is_rank0(self) -> bool:
        """Rank 0 of the whole launch: the process that logs, writes the run's files and sends the weights it read.
        The one way the recipe asks."""
        return self.rank == 0

    @property
    def hub_offline(self) -> bool:
        """HF_HUB_OFFLINE: the Hub is not reached; names resolve from its cache only."""
        return _flag(self.env, "HF_HUB_OFFLINE")

    @property
    def phase_marks(self) -> str | None:
        """The file where each process appends the start of each phase of its run (RECIPE_PHASE_MARKS, set by
        bench/memory_grid.py, which samples the processes from outside)."""
        return self.env.get("RECIPE_PHASE_MARKS") or None

    @property
    def mmap_threshold_set(self) -> bool:
        """MALLOC_MMAP_THRESHOLD_ is set: glibc took it at start-up, and it wins over run_memory's own."""
        return "MALLOC_MMAP_THRESHOLD_" in self.env

    @property
    def local_rank(self) -> int:
        return int(self.env.get("LOCAL_RANK", 0))

    @property
    def rank(self) -> int:
        return int(self.env.get("RANK", 0))

    @property
    def machine_rank(self) -> int:
        """This machine's rank among the launch's machines (torchrun's GROUP_RANK)."""
        return int(self.env.get("GROUP_RANK", 0))

    @property
    def store_address(self) -> tuple[str, int] | None:
        """Where the launch's rendezvous store listens, which every rank of every machine reaches (torchrun's
        MASTER_ADDR and MASTER_PORT); None where no launcher agent holds one before the workers start (a launch that
        sets MASTER_ADDR for rank 0's process group to host: its store exists only once the group starts)."""
        if "MASTER_ADDR" not in self.env or "MASTER_PORT" not in self.env:
            return None
        if self.env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        return self.env["MASTER_ADDR"], int(self.env["MASTER_PORT"])

    def store(self):
        """A client of the launch's rendezvous store (store_address), which exists before the process group."""
        from datetime import timedelta

        import torch.distributed as dist

        host, port = self.store_address
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_WAIT_S))

    @property
    def restart(self) -> int:
        """How many times torchrun has restarted this launch's workers (TORCHELASTIC_RESTART_COUNT)."""
        return int(self.env.get("TORCHELASTIC_RESTART_COUNT", 0))

    @property
    def local_processes(self) -> int:
        """The ranks on this machine (torchrun's LOCAL_WORLD_SIZE), which share its cores."""
        return int(self.env.get("LOCAL_WORLD_SIZE", self.num_processes))

    @property
    def stop_report(self) -> str | None:
        """The file where a run stopped by a signal writes the signal's number, for preemptible.sh to exit 128 + it on
        every node, the nodes that were not signalled included (their launchers see only the workers' exit)."""
        return self.env.get("RECIPE_STOP_REPORT") or None

    @property
    def weights_from_rank0(self) -> bool:
        """FSDP's RAM-efficient loading, or ZeRO-3's partitioning at load (zero3_init_flag): rank 0 reads the
        checkpoint, the others receive their shards (sharding.py)."""
        if self.fsdp:
            return self.fsdp_setting("CPU_RAM_EFFICIENT_LOADING")
        return self.zero_stage == 3 and _flag(self.env, "ACCELERATE_DEEPSPEED_ZERO3_INIT")


def launch_environment(launch_args: list[str]) -> dict[str, str]:
    """The environment `accelerate launch <launch_args>` gives each training process, computed by accelerate's own
    launcher code without starting anything: what FullyShardedDataParallelPlugin / DeepSpeedPlugin then read."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(launch_args))
    if args.use_deepspeed:  # as accelerate's launch_command does before starting DeepSpeed
        fields = list(defaults.deepspeed_config) if defaults else []
        fields += ["mixed_precision"] if mp_from_config else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return prepare_deepspeed_cmd_env(args)[1]
    if args.use_fsdp or args.multi_gpu:
        return prepare_multi_gpu_env(args)
    return {}


def machine_settings(command: list[str], env: Mapping[str, str]) -> dict | None:
    """num_machines, machine_rank, main_process_ip and main_process_port of a launch command, as accelerate's launcher
    takes them: its flags, else its config file (--config_file, else accelerate's default config), else its defaults.
    Read without importing accelerate (which imports torch: seconds on every node); tests/test_multinode.py compares
    the result with accelerate's own reading. None when `command` is no `accelerate launch`."""
    import argparse

    import yaml

    start = next((i + 1 for i, word in enumerate(command) if word in ("launch", "accelerate.commands.launch")), None)
    if start is None:
        return None
    script = next((i for i in range(start, len(command)) if command[i].endswith(".py")), len(command))
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("config_file", "num_machines", "machine_rank", "main_process_ip", "main_process_port"):
        parser.add_argument(f"--{name}")
    flags, _ = parser.parse_known_args(command[start:script])
    home = os.path.expanduser(env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
    config_file = Path(flags.config_file or os.path.join(home, "accelerate", "default_config.yaml"))
    config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.is_file() else {}

    def setting(name: str, default):
        value = getattr(flags, name)
        return value if value is not None else config.get(name, default)

    port = setting("main_process_port", None)
    return {"num_machines": int(setting("num_machines", 1)), "machine_rank": int(setting("machine_rank", 0)),
            "main_process_ip": setting("main_process_ip", None), "main_process_port": int(port) if port else None}


def node_problems(command: list[str], env: Mapping[str, str]) -> list[str]:
    """What is wrong with this node's part of a multi-machine launch, found before anything starts: `command` is the
    launch as preemptible.sh runs it (`accelerate launch [flags] script [script flags]`, or `python -m
    accelerate.commands.launch ...`).

    accelerate's launcher starts torchrun with a static rendezvous (accelerate 1.15 ignores a config file's
    `rdzv_backend`: its own argparse default, "static", is not None, and only unset arguments take the config's
    values): each node is the machine rank it is given, and machine rank 0 hosts the rendezvous on main_process_ip and
    main_process_port. A node given the wrong rank, or a port already taken, would leave the others waiting for the
    rendezvous until it times out."""
    import errno
    import socket

    settings = machine_settings(command, env)
    if settings is None:
        return []
    machines, rank = settings["num_machines"], settings["machine_rank"]
    address, port = settings["main_process_ip"], settings["main_process_port"]
    if not 0 <= rank < machines:
        return [f"--machine_rank {rank} with --num_machines {machines}: each node needs its own rank, from 0 to "
                f"{machines - 1}"]
    problems = []
    slurm = {"SLURM_NODEID": (rank, "--machine_rank"), "SLURM_NNODES": (machines, "--num_machines")}
    for variable, (value, flag) in slurm.items():
        if variable in env and int(env[variable]) != value:
            problems.append(f"{flag} {value}, but SLURM says {variable}={env[variable]}: the rank expression was "
                            "evaluated once for every node (in double quotes, by the batch shell) instead of on each "
                            f"node; quote it so each node's shell expands ${variable} "
                            "(slurm/run_peft_fsdp_multinode.sbatch)")
    if problems or rank != 0 or not port:
        return problems
    host = address if machines > 1 and address else "0.0.0.0"
    with socket.socket() as probe:
        # Another probe of the same port does not conflict (Linux lets sockets with SO_REUSEADDR share a port none of
        # them listens on); a listener, such as a rendezvous store, does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror:
            return [f"--main_process_ip {address} does not resolve to an address on this machine, where machine rank "
                    "0 runs the rendezvous: pass machine rank 0's address, or give this node its own --machine_rank"]
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                return [f"--machine_rank 0 runs the rendezvous on --main_process_ip {address}, which is not an "
                        "address of this machine: start machine rank 0 on that machine, or give this node its own "
                        "--machine_rank"]
            if err.errno == errno.EADDRINUSE:
                return [f"--main_process_port {port} is already in use on this machine (another run or job, or a "
                        "second node started as machine rank 0 here): choose a free port (--main_process_port, "
                        "MAIN_PORT for the SLURM script), or give each node its own --machine_rank"]
            raise
    return problems


if __name__ == "__main__":
    # python -m recipe.platform.launch check-node accelerate launch [flags] script ...: preemptible.sh's check
    import sys

    if sys.argv[1:2] != ["check-node"]:
        raise SystemExit("usage: python -m recipe.platform.launch check-node accelerate launch [accelerate flags] "
                         "script [flags]")
    found = node_problems(sys.argv[2:], os.environ)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    sys.exit(2 if found else 0)

"""Every accelerate config builds the real accelerate plugin it describes; FSDP <-> DeepSpeed translation."""


import pytest
import torch
import yaml
from conftest import settled

from distributed import deepspeed_to_fsdp, fsdp_to_deepspeed, translate
from recipe.platform.launch import launch_environment
from recipe.model.model_files import REPO_DIR

CONFIG_FILES = sorted((REPO_DIR / "configs").glob("*.yaml"))
ACCELERATE_CONFIGS = [p for p in CONFIG_FILES if "distributed_type" in yaml.safe_load(p.read_text())]
FSDP_CONFIGS = [p for p in ACCELERATE_CONFIGS if yaml.safe_load(p.read_text())["distributed_type"] == "FSDP"]
DEEPSPEED_CONFIGS = [p for p in ACCELERATE_CONFIGS if p not in FSDP_CONFIGS]
COUNTERPARTS = [("fsdp2_config.yaml", "deepspeed_config.yaml"),
                ("fsdp2_config_multinode.yaml", "deepspeed_config_multinode.yaml")]


def load(path):
    return yaml.safe_load(path.read_text())


@pytest.fixture
def device_standin(monkeypatch):
    """FSDP1's plugin asks for the current GPU to build its param_init_fn; nothing else here needs one."""
    import accelerate.utils.dataclasses as accelerate_dataclasses

    monkeypatch.setattr(accelerate_dataclasses, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def plugin_for(config_path, monkeypatch, *launch_flags):
    """The plugin a training process would build under `accelerate launch --config_file config_path`."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    env = launch_environment(["--config_file", str(config_path), *launch_flags, "train.py"])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env, (FullyShardedDataParallelPlugin() if env.get("ACCELERATE_USE_FSDP") == "true" else DeepSpeedPlugin())


def test_the_configs_the_launchers_run_are_among_those_tested_here():
    """Each launcher's and the SLURM script's default accelerate config is one of the configs every test below
    builds."""
    import re

    scripts = [*REPO_DIR.glob("run_*.sh"), REPO_DIR / "slurm" / "run_peft_fsdp_multinode.sbatch"]
    run_by_default = {name for script in scripts
                      for name in re.findall(r"ACCELERATE_CONFIG:-configs/([\w.]+\.yaml)", script.read_text())}
    assert len(run_by_default) == len(scripts)
    assert run_by_default <= {path.name for path in ACCELERATE_CONFIGS}


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_every_key_is_known_to_accelerate(path):
    """accelerate refuses unknown top-level keys but copies unknown fsdp_/deepspeed_ keys silently; check both."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    ClusterConfig.from_yaml_file(str(path))
    destinations = {action.dest for action in launch_command_parser()._actions}
    nested = {**load(path).get("fsdp_config", {}), **load(path).get("deepspeed_config", {})}
    assert set(nested) <= destinations, set(nested) - destinations


@pytest.mark.parametrize("path", FSDP_CONFIGS, ids=lambda p: p.name)
def test_fsdp_configs_build_the_plugin_they_describe(path, monkeypatch, device_standin):
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy, StateDictType

    settings = load(path)["fsdp_config"]
    env, plugin = plugin_for(path, monkeypatch)
    assert plugin.fsdp_version == settings["fsdp_version"]
    assert plugin.cpu_ram_efficient_loading is True
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    offload = settings["fsdp_offload_params"]
    if plugin.fsdp_version == 1:
        assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD
        assert plugin.sync_module_states is True and plugin.use_orig_params is False
        assert plugin.cpu_offload == CPUOffload(offload_params=offload)
    else:
        assert plugin.reshard_after_forward is True
        assert type(plugin.cpu_offload).__name__ == ("CPUOffloadPolicy" if offload else "OffloadPolicy")
    assert plugin.activation_checkpointing is False  # the Trainer's checkpointing is used; both together raise
    qlora = "qlora" in path.name
    assert env["ACCELERATE_MIXED_PRECISION"] == ("no" if qlora else "bf16")  # QLoRA: the Trainer sets the storage dtype
    assert int(env.get("WORLD_SIZE", load(path)["num_processes"])) == load(path)["num_processes"]


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=lambda p: p.name)
def test_deepspeed_configs_take_accumulation_and_clipping_from_the_training_flags(path, monkeypatch):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    env, plugin = plugin_for(path, monkeypatch)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    config = plugin.deepspeed_config
    assert plugin.zero_stage == 3 and config["zero_optimization"]["stage"] == 3
    assert plugin.zero3_init_flag is True
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["gradient_accumulation_steps"] == "auto" and config["gradient_clipping"] == "auto"
    # What the Trainer does with it: fill "auto" from the training flags; nothing may disagree.
    training_args = settled(["--gradient_accumulation_steps", "4", "--max_grad_norm", "0.5",
                             "--per_device_train_batch_size", "2", "--bf16", "true"]).training
    hf_config = HfTrainerDeepSpeedConfig(config)
    hf_config.trainer_config_process(training_args)
    assert hf_config.mismatches == []
    assert hf_config.config["gradient_accumulation_steps"] == 4 and hf_config.config["gradient_clipping"] == 0.5
    assert hf_config.config["train_micro_batch_size_per_gpu"] == 2


def test_hard_coded_accumulation_that_disagrees_is_caught_by_transformers(monkeypatch, tmp_path):
    """Why the shipped configs leave these keys out: written in two places, they can disagree."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = load(REPO_DIR / "configs" / "deepspeed_config.yaml")
    config["deepspeed_config"]["gradient_accumulation_steps"] = 8
    path = tmp_path / "ds.yaml"
    path.write_text(yaml.safe_dump(config))
    _, plugin = plugin_for(path, monkeypatch)
    training_args = settled(["--gradient_accumulation_steps", "4"]).training
    hf_config = HfTrainerDeepSpeedConfig(plugin.deepspeed_config)
    hf_config.trainer_config_process(training_args)
    assert any("gradient_accumulation_steps" in m for m in hf_config.mismatches)


def test_fsdp1_takes_its_sharding_from_sharding_strategy_not_reshard_after_forward(monkeypatch, device_standin,
                                                                                  tmp_path):
    """accelerate's launcher always exports FSDP_SHARDING_STRATEGY, so on FSDP1 a reshard_after_forward strategy is
    silently overridden: the FSDP1 configs use fsdp_sharding_strategy, the key that is honoured."""
    from torch.distributed.fsdp import ShardingStrategy

    config = load(REPO_DIR / "configs" / "fsdp_config.yaml")
    config["fsdp_config"]["fsdp_sharding_strategy"] = "SHARD_GRAD_OP"
    path = tmp_path / "honoured.yaml"
    path.write_text(yaml.safe_dump(config))
    assert plugin_for(path, monkeypatch)[1].sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    del config["fsdp_config"]["fsdp_sharding_strategy"]
    config["fsdp_config"]["fsdp_reshard_after_forward"] = "SHARD_GRAD_OP"
    path.write_text(yaml.safe_dump(config))
    assert plugin_for(path, monkeypatch)[1].sharding_strategy == ShardingStrategy.FULL_SHARD  # ignored


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_round_trip_keeps_every_setting(path):
    config = load(path)
    version = config.get("fsdp_config", {}).get("fsdp_version", 2)
    there, _ = translate(config)
    back, _ = translate(there, fsdp_version=version)
    assert back == config


@pytest.mark.parametrize("fsdp_name, deepspeed_name", COUNTERPARTS)
def test_translating_a_shipped_config_gives_its_counterpart(fsdp_name, deepspeed_name):
    fsdp, deepspeed = load(REPO_DIR / "configs" / fsdp_name), load(REPO_DIR / "configs" / deepspeed_name)
    assert fsdp_to_deepspeed(fsdp)[0] == deepspeed
    assert deepspeed_to_fsdp(deepspeed, fsdp_version=2)[0] == fsdp


def test_what_does_not_translate_is_reported():
    config = load(REPO_DIR / "configs" / "deepspeed_config.yaml")
    config["deepspeed_config"].update(offload_param_device="nvme", offload_optimizer_device="cpu",
                                      gradient_accumulation_steps=8)
    fsdp, notes = deepspeed_to_fsdp(config)
    assert fsdp["fsdp_config"]["fsdp_offload_params"] is True
    text = " ".join(notes)
    assert "NVMe" in text and "all or nothing" in text and "--gradient_accumulation_steps 8" in text
    assert "fp32 master weights" in text  # the precision difference is always stated

    _, notes = fsdp_to_deepspeed(load(REPO_DIR / "configs" / "fsdp_config.yaml"))
    assert any(n.startswith("fsdp_backward_prefetch") for n in notes)


@pytest.mark.e2e
def test_translate_command_writes_a_config_accelerate_loads(tmp_path, capsys, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig

    from distributed import main  # `python distributed.py ARGS` is main(ARGS), in-process here

    out = tmp_path / "ds.yaml"
    monkeypatch.chdir(REPO_DIR)
    main(["translate", "configs/fsdp_config_qlora.yaml", "-o", str(out)])
    assert "note: precision differs" in capsys.readouterr().err
    config = ClusterConfig.from_yaml_file(str(out))
    assert config.deepspeed_config["offload_param_device"] == "cpu" and config.num_processes == 2

"""Preflight: one test per rule, with a configuration that triggers it and one that does not."""

import pytest
from conftest import free_port, settled

from recipe.settings import checks
from recipe.settings.checks import preflight
from recipe.platform.launch import Launch, launch_environment
from recipe.planning.memory import load_config
from recipe.model.model_files import REPO_DIR

CONFIGS = REPO_DIR / "configs"


def launch(config: str | None = None, **overrides) -> Launch:
    """The environment of a process started by `accelerate launch --config_file configs/<config>`, edited."""
    env = launch_environment(["--config_file", str(CONFIGS / config), "train.py"]) if config else {}
    env.update({key: str(value) for key, value in overrides.items()})
    return Launch(env, int(overrides.pop("WORLD_SIZE", 2 if config else 1)))


def setup(argv=(), launch_=None, **facts):
    """The settled configuration of `argv` under a launch, with the given facts (see conftest.settled)."""
    return settled(argv, launch=launch_ or Launch(), **facts)


def fired(rule, config):
    problem = rule(config)
    return problem and problem.level


QLORA = ["--use_4bit_quantization", "true", "--bf16", "true"]
MISTRAL = load_config("configs/models/Mistral-7B-v0.1")  # a sliding window of 4096

CASES = [
    # rule, (argv, launch, facts) that triggers it, the same that does not, the level
    (checks.quant_storage_dtype,
     (QLORA + ["--bnb_4bit_quant_storage_dtype", "uint8"], launch("fsdp_config_qlora.yaml"), {}),
     (QLORA, launch("fsdp_config_qlora.yaml"), {}), "error"),
    (checks.quant_storage_dtype,  # fp16 mixed precision needs float32 storage
     (["--use_4bit_quantization", "true", "--bf16", "false"], launch("fsdp_config_qlora.yaml",
                                                                    ACCELERATE_MIXED_PRECISION="fp16"), {}),
     (["--use_4bit_quantization", "true", "--bf16", "false", "--bnb_4bit_quant_storage_dtype", "float32"],
      launch("fsdp_config_qlora.yaml", ACCELERATE_MIXED_PRECISION="fp16"), {}), "error"),
    (checks.fsdp2_mixed_precision_casts_4bit,  # FSDP2's bf16 policy would cast the packed bytes stored as float32
     (["--use_4bit_quantization", "true", "--bf16", "false", "--bnb_4bit_quant_storage_dtype", "float32"],
      launch("fsdp2_config.yaml", ACCELERATE_MIXED_PRECISION="bf16"), {}),
     (["--use_4bit_quantization", "true", "--bf16", "false"], launch("fsdp2_config.yaml",
                                                                    ACCELERATE_MIXED_PRECISION="bf16"), {}), "error"),
    (checks.eight_bit_with_fsdp,
     (["--use_8bit_quantization", "true"], launch("fsdp2_config.yaml"), {}),
     (["--use_8bit_quantization", "true"], launch("deepspeed_config.yaml"), {}), "error"),
    (checks.bnb_optimizer_with_fsdp,
     (["--optim", "paged_adamw_8bit"], launch("fsdp2_config.yaml"), {}),
     (["--optim", "adamw_torch"], launch("fsdp2_config.yaml"), {}), "error"),
    (checks.qlora_fsdp_loading,
     (QLORA, launch("fsdp_config_qlora.yaml", FSDP_CPU_RAM_EFFICIENT_LOADING="false"), {}),
     (QLORA, launch("fsdp_config_qlora.yaml"), {}), "error"),
    (checks.qlora_fsdp_loading,
     (QLORA, launch("fsdp_config_qlora.yaml", FSDP_USE_ORIG_PARAMS="true"), {}),
     (QLORA, launch("fsdp_config_qlora.yaml", FSDP_USE_ORIG_PARAMS="false"), {}), "error"),
    (checks.ram_efficient_without_sync,
     ([], launch("fsdp_config.yaml", FSDP_SYNC_MODULE_STATES="false"), {}),
     ([], launch("fsdp_config.yaml"), {}), "error"),
    (checks.host_ram_by_phase,
     ([], launch("fsdp2_config.yaml"), {"model_config": load_config("smollm2-135m"), "host_gib": 0.5}),
     ([], launch("fsdp2_config.yaml"), {"model_config": load_config("smollm2-135m"), "host_gib": 64}), "warning"),
    (checks.compile_with_fsdp1,
     (["--torch_compile", "true"], launch("fsdp_config.yaml"), {}),
     (["--torch_compile", "true"], launch("fsdp2_config.yaml"), {}), "error"),
    (checks.two_activation_checkpointings,
     (["--activation_checkpointing", "true"], launch("fsdp2_config.yaml", FSDP_ACTIVATION_CHECKPOINTING="true"), {}),
     (["--activation_checkpointing", "false"], launch("fsdp2_config.yaml", FSDP_ACTIVATION_CHECKPOINTING="true"), {}),
     "error"),
    (checks.fsdp1_reshard_after_forward_ignored,
     ([], launch("fsdp_config.yaml", FSDP_RESHARD_AFTER_FORWARD="SHARD_GRAD_OP"), {}),
     ([], launch("fsdp_config.yaml"), {}), "warning"),
    (checks.fsdp1_on_one_process,
     (QLORA, launch("fsdp_config_qlora.yaml", WORLD_SIZE=1), {"cuda": True, "here": False}),
     (QLORA, launch("fsdp_config_qlora.yaml"), {"cuda": True, "here": False}), "warning"),
    (checks.deepspeed_set_twice,
     (["--gradient_accumulation_steps", "4"], launch("deepspeed_config.yaml", ACCELERATE_GRADIENT_ACCUMULATION_STEPS=8),
      {}),
     (["--gradient_accumulation_steps", "4"], launch("deepspeed_config.yaml"), {}), "error"),
    (checks.deepspeed_set_twice,
     (["--max_grad_norm", "1.0"], launch("deepspeed_config.yaml", ACCELERATE_GRADIENT_CLIPPING="0.3"), {}),
     (["--max_grad_norm", "0.3"], launch("deepspeed_config.yaml", ACCELERATE_GRADIENT_CLIPPING="0.3"), {}), "error"),
    (checks.zero3_non_reentrant,
     (["--activation_checkpointing", "true", "--use_reentrant", "false"], launch("deepspeed_config.yaml"), {}),
     (["--activation_checkpointing", "true", "--use_reentrant", "true"], launch("deepspeed_config.yaml"), {}),
     "warning"),
    (checks.single_process_generation,
     (["--eval_num_prompts", "8"], launch("fsdp2_config.yaml"), {}),
     (["--eval_num_prompts", "0"], launch("fsdp2_config.yaml"), {}), "warning"),
    (checks.added_tokens_under_fsdp,
     ([], launch("fsdp_config.yaml"), {"added_token_ids": [7, 8]}),
     ([], launch("fsdp_config.yaml"), {"added_token_ids": []}),
     "warning"),
    (checks.added_tokens_under_fsdp,
     (QLORA, launch("fsdp2_config_qlora.yaml"), {"added_token_ids": [7, 8]}),
     (QLORA, launch("deepspeed_config_z3_qlora.yaml"), {"added_token_ids": [7, 8]}), "warning"),
    (checks.flash_attention,
     (["--use_flash_attn", "true"], None, {"cuda": False}), (["--use_flash_attn", "false"], None, {"cuda": False}),
     "error"),
    (checks.flash_attention,  # a GPU here, but neither flash-attn nor a torch with its varlen kernel
     (["--use_flash_attn", "true"], None, {"cuda": True}),
     (["--use_flash_attn", "true"], None, {"cuda": True, "torch_varlen": True}), "error"),
    (checks.flash_attention,  # a sliding window, and an older torch's kernel without one
     (["--use_flash_attn", "true"], None, {"cuda": True, "torch_varlen": True, "model_config": MISTRAL}),
     (["--use_flash_attn", "true"], None, {"cuda": True, "torch_varlen": True, "torch_varlen_windows": True,
                                           "model_config": MISTRAL}), "error"),
    (checks.flash_attention,  # flash-attn alone is enough too
     (["--use_flash_attn", "true"], None, {"cuda": True}),
     (["--use_flash_attn", "true"], None, {"cuda": True, "flash_attn": True}), "error"),
    (checks.liger_kernels,
     (["--use_liger_kernels", "true"], None, {"cuda": False}),
     (["--use_liger_kernels", "false"], None, {"cuda": False}),
     "error"),
    (checks.liger_kernels,  # a GPU here, but no liger-kernel package
     (["--use_liger_kernels", "true"], None, {"cuda": True}),
     (["--use_liger_kernels", "true"], None, {"cuda": True, "here": False}), "error"),
    (checks.fp16_without_gpu,
     (["--fp16", "true", "--bf16", "false"], None, {"cuda": False}),
     (["--fp16", "true", "--bf16", "false"], None, {"cuda": True}), "error"),
    (checks.evaluation_without_split,  # the shared 70B config evaluates every epoch
     (["configs/llama2_70b_chat_sft.yaml", "--splits", "train"], None, {}),
     (["configs/llama2_70b_chat_sft.yaml", "--splits", "train", "--eval_strategy", "no"], None, {}), "error"),
    (checks.resume_checkpoint,
     (["--resume_from_checkpoint", "/nonexistent/checkpoint-3"], None, {}),
     (["--resume_from_checkpoint", "latest"], None, {}), "error"),
    (checks.dataset_source,
     (["--dataset_name", "/nonexistent/data.jsonl"], None, {}),
     (["--dataset_name", str(REPO_DIR / "data" / "dates")], None, {}), "error"),
]


@pytest.mark.parametrize("rule, bad, good, level", CASES,
                         ids=[f"{case[0].__name__}-{i}" for i, case in enumerate(CASES)])
def test_rule_fires_on_its_trap_and_only_there(rule, bad, good, level):
    argv, launch_, fields = bad
    assert fired(rule, setup(argv, launch_, **fields)) == level
    argv, launch_, fields = good
    assert fired(rule, setup(argv, launch_, **fields)) is None


def test_bf16_rule_follows_the_hardware():
    assert fired(checks.bf16_support, setup(["--bf16", "true"], native_bf16=False)) == "error"
    assert fired(checks.bf16_support, setup(["--bf16", "true"], native_bf16=True)) is None
    assert fired(checks.bf16_support, setup(["--bf16", "false"])) is None
    assert fired(checks.bf16_support, setup(["--bf16", "true"], here=False)) is None  # checking a GPU launch


def test_layer_class_to_wrap_is_the_models_own(tiny_model_dir, monkeypatch):
    from transformers import AutoConfig

    from recipe.planning import memory

    config = AutoConfig.from_pretrained(tiny_model_dir)
    fsdp = launch("fsdp2_config.yaml")
    assert fired(checks.no_layer_class_to_wrap, setup([], fsdp, model_config=config)) is None
    named = launch("fsdp2_config.yaml", FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer")
    assert fired(checks.no_layer_class_to_wrap, setup([], named, model_config=config)) is None
    copied = launch("fsdp2_config.yaml", FSDP_TRANSFORMER_CLS_TO_WRAP="MistralDecoderLayer")  # another family's config
    problem = checks.no_layer_class_to_wrap(setup([], copied, model_config=config))
    assert problem.level == "error" and "MistralDecoderLayer" in str(problem) and "LlamaDecoderLayer" in problem.fix

    build = memory.meta_model

    def without_layer_classes(model_config):  # as many remote-code models are
        model = build(model_config)
        model._no_split_modules = None
        return model

    monkeypatch.setattr(memory, "meta_model", without_layer_classes)
    assert fired(checks.no_layer_class_to_wrap, setup([], fsdp, model_config=config)) == "error"
    assert fired(checks.no_layer_class_to_wrap, setup([], named, model_config=config)) is None


def test_every_problem_is_reported_at_once_errors_first():
    # a GPU here: the SFTConfig is still built on this host, so without bf16 (TrainingArguments refuses it on CPU)
    s = setup(["--use_4bit_quantization", "true", "--bf16", "false", "--bnb_4bit_quant_storage_dtype", "uint8",
               # no varlen kernel
               "--optim", "paged_adamw_8bit", "--use_flash_attn", "true", "--eval_num_prompts", "4"],
              launch("fsdp2_config_qlora.yaml", FSDP_CPU_RAM_EFFICIENT_LOADING="false"), cuda=True)
    problems = preflight(s)
    levels = [p.level for p in problems]
    assert levels == sorted(levels, key=lambda level: level != "error")
    names = " | ".join(str(p) for p in problems)
    for expected in ("uint8", "paged_adamw_8bit", "no FlashAttention varlen kernel",
                     "QLoRA + FSDP without RAM-efficient", "--eval_num_prompts"):
        assert expected in names
    assert all(" Fix: " in str(p) for p in problems)


def test_shipped_launchers_pass_their_own_check(tiny_model_dir, chat_dir):
    """Each shipped accelerate config with the recipe preset: no error (warnings allowed for QLoRA trade-offs)."""
    for config in ("fsdp2_config.yaml", "fsdp_config.yaml", "fsdp_config_qlora.yaml", "deepspeed_config.yaml",
                   "deepspeed_config_z3_qlora.yaml"):
        qlora = "qlora" in config
        argv = [str(CONFIGS / "llama2_70b_chat_sft.yaml"), "--model_name_or_path", str(tiny_model_dir),
                "--dataset_name", str(chat_dir), "--use_reentrant", "true",
                *(["--use_4bit_quantization", "true", "--bnb_4bit_quant_storage_dtype", "bfloat16"] if qlora else [])]
        from transformers import AutoConfig

        problems = preflight(setup(argv, launch(config), here=False, cuda=True, native_bf16=True,
                                   model_config=AutoConfig.from_pretrained(tiny_model_dir)))
        assert [p for p in problems if p.level == "error"] == [], (config, problems)


@pytest.mark.e2e
def test_check_command_reports_everything_and_loads_no_weights(tiny_model_dir, chat_dir, capsys, monkeypatch):
    import train  # `python train.py ARGS` is train.run(ARGS), in-process here; the exit code is SystemExit's

    monkeypatch.chdir(REPO_DIR)
    base = ["--check", "--accelerate_config", "configs/fsdp_config_qlora.yaml", "configs/llama2_70b_chat_sft.yaml",
            "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(chat_dir), "--use_4bit_quantization",
            "true", "--use_reentrant", "true"]
    with pytest.raises(SystemExit) as exit_info:
        train.run([*base, "--bnb_4bit_quant_storage_dtype", "uint8", "--optim", "paged_adamw_8bit"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "uint8" in errors[0] and "paged_adamw_8bit" in errors[1]
    trainer, _ = train.run(base)
    good = capsys.readouterr()
    assert trainer is None and "check passed" in good.out and "Loading weights" not in good.err + good.out
    assert "settled:" in good.out and "activation_checkpointing_kwargs = {'use_reentrant': True}" in good.out


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["deepspeed_config.yaml", "deepspeed_config_z3_qlora.yaml"])
def test_check_passes_in_a_zero3_launch_environment(tiny_model_dir, tmp_path, config):
    """In ZeRO-3's launch environment (what `accelerate launch` gives each process, computed by its own code)
    transformers builds models inside deepspeed.zero.Init; the memory planner's meta model stays out of it, so the
    check settles (with the plan's decision) and passes on CPU, where the recipe keeps DeepSpeed, instead of dying
    with "Cannot copy out of meta tensor"."""
    import os
    import subprocess
    import sys

    qlora = ["--use_4bit_quantization", "true"] if "qlora" in config else []
    launched = launch_environment(["--config_file", f"configs/{config}", "--num_processes", "1", "--mixed_precision",
                                   "no", "train.py"])
    env = {**os.environ, **launched, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # for the one-process group the training arguments start
    result = subprocess.run([sys.executable, "train.py", "--check", "--model_name_or_path", str(tiny_model_dir),
                             "--output_dir", str(tmp_path), *qlora],
                            cwd=REPO_DIR, capture_output=True, text=True, timeout=300, env=env)
    assert launched["ACCELERATE_USE_DEEPSPEED"] == "true" and launched["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert result.returncode == 0 and "check passed" in result.stdout, result.stderr[-3000:]
    assert "activation_checkpointing = False: the memory plan needs" in result.stdout
    assert "engine on CPU = deepspeed" in result.stdout and "Loading weights" not in result.stdout + result.stderr


def test_fsdp2_mixed_precision_casts_packed_4bit_weights_unless_stored_in_its_dtype():
    """What fsdp2_mixed_precision_casts_4bit guards: FSDP2 with a bf16 policy (one gloo process) casts a 4-bit weight
    stored as float32 to bf16 as numbers, and bitsandbytes fails on what is left; stored as bf16 it is not cast, and
    the layer computes as it did before sharding."""
    import bitsandbytes as bnb
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recipe.engines.sharding import hand_to_the_engine

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        for storage in (torch.float32, torch.bfloat16):
            layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_storage=storage,
                                      quant_type="nf4").to("cpu")  # quantized here
            x = torch.randn(2, 64)
            before = layer(x)
            model = torch.nn.Sequential(layer)
            hand_to_the_engine(model)  # as train.py readies a 4-bit model for FSDP
            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            if storage == torch.float32:
                with pytest.raises(RuntimeError, match="is invalid for input of size"):
                    model(x.bfloat16())
            else:
                torch.testing.assert_close(model(x.bfloat16()).float(), before, rtol=0, atol=0.02)
    finally:
        dist.destroy_process_group()


def test_unsafe_or_unpublishable_inputs_are_refused_before_anything_loads(tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    from recipe.engines.checkpoints import COMPLETE

    # A checkpoint another script wrote (or a kill left): its pickles are read only if trusted
    unmarked = tmp_path / "checkpoint-4"
    unmarked.mkdir()
    assert fired(checks.resume_checkpoint, setup(["--resume_from_checkpoint", str(unmarked)])) == "error"
    assert fired(checks.resume_checkpoint, setup(["--resume_from_checkpoint", str(unmarked),
                                                  "--trust_checkpoint", "true"])) is None
    (unmarked / COMPLETE).write_text("{}")
    assert fired(checks.resume_checkpoint, setup(["--resume_from_checkpoint", str(unmarked)])) is None

    # A model folder with pickled weights only
    pickled = tmp_path / "pickled-model"
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.save_pretrained(pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    problem = checks.model_source(setup(["--model_name_or_path", str(pickled)], model_config=config))
    assert problem.level == "error" and "pickles only" in problem.what and "save_pretrained" in problem.fix

    # Publishing an adapter of a local folder of unknown origin; the token in the process table
    local = setup(["--model_name_or_path", str(tiny_model_dir), "--push_to_hub", "true"])
    assert fired(checks.publishing_a_local_path, local) == "error"
    named = setup(["--model_name_or_path", str(tiny_model_dir), "--push_to_hub", "true", "--base_model_id", "me/m"])
    assert fired(checks.publishing_a_local_path, named) is None and named.base_model_id == "me/m"
    # the default model: its id is known
    assert fired(checks.publishing_a_local_path, setup(["--push_to_hub", "true"])) is None
    assert fired(checks.token_on_command_line, setup(["--hub_token", "hf_x"])) == "warning"

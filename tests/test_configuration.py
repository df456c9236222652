"""settle(): the one place that decides. Each recipe default and derived setting, with its reason, from explicit facts
(so no verdict depends on the machine); an explicit user choice is never overridden; gather() reads the facts."""

import pytest
import torch
from conftest import settled

from recipe.settings.arguments import RECIPE_DEFAULTS, ConfigError
from recipe.settings.checks import preflight
from recipe.settings.facts import gather
from recipe.platform.launch import Launch
from recipe.planning.memory import load_config


def decided(config) -> dict:
    return {decision.setting: decision for decision in config.decisions}


def test_recipe_defaults_apply_where_nothing_is_set_and_each_decision_says_why():
    config = settled([])
    training = config.training
    assert training.learning_rate == RECIPE_DEFAULTS["learning_rate"] and training.hub_private_repo is True
    assert training.activation_checkpointing is False  # TRL's default is True
    assert training.padding_free and training.use_cpu
    decisions = decided(config)
    assert {"use_cpu", "bf16", "padding_free", "activation_checkpointing", "attention"} <= set(decisions)
    assert all(decision.why for decision in config.decisions)


@pytest.mark.parametrize("native", [False, True])
def test_bf16_default_follows_the_hardware_fact_and_fp16_replaces_it(native):
    assert settled([], native_bf16=native).training.bf16 is native
    assert "natively" in decided(settled([], native_bf16=True))["bf16"].why
    assert settled(["--fp16", "true"], native_bf16=True, cuda=True).training.bf16 is False
    assert settled(["--bf16", "false"], native_bf16=True).training.bf16 is False
    assert "bf16" not in decided(settled(["--bf16", "false"], native_bf16=True))  # the user decided


def test_wrapped_packing_turns_the_padding_free_default_off_but_not_an_explicit_choice():
    wrapped = ["--packing", "true", "--packing_strategy", "wrapped"]
    assert not settled(wrapped).training.padding_free
    assert settled([*wrapped, "--padding_free", "true"]).training.padding_free
    assert settled(["--packing", "true"]).training.padding_free  # bfd packing is padding-free anyway


def test_padding_free_batches_are_truncated_by_the_recipe_not_by_trl():
    config = settled(["--max_length", "128"])
    assert config.max_length == 128 and config.training.max_length is None
    packed = settled(["--max_length", "128", "--packing", "true"])
    assert packed.max_length == packed.training.max_length == 128  # packing cuts its own rows


def test_the_memory_plan_decides_activation_checkpointing_when_the_user_did_not():
    """Llama-2-7B LoRA, 2 x 4096 tokens: about 128 GiB planned with checkpointing off. On one 80 GB GPU it goes on
    (and says why); on a 141 GB GPU, or at 1 x 2048 tokens (45 GiB), it stays off; unknown GPU memory decides
    nothing; an explicit flag is never overridden."""
    # GPUs elsewhere (here=False): this CPU host can still build the SFTConfig a GPU run gets
    llama = {"cuda": True, "here": False, "model_config": load_config("llama-2-7b")}
    big = ["--per_device_train_batch_size", "2", "--max_length", "4096", "--bf16", "true"]
    config = settled(big, gpu_gib=80, **llama)
    why = decided(config)["activation_checkpointing"].why
    assert config.training.activation_checkpointing and "without it" in why and "80 GiB" in why
    assert config.training.activation_checkpointing_kwargs == {"use_reentrant": True}
    assert not settled(big, gpu_gib=141, **llama).training.activation_checkpointing
    small = ["--per_device_train_batch_size", "1", "--max_length", "2048", "--bf16", "true"]
    assert not settled(small, gpu_gib=80, **llama).training.activation_checkpointing
    unknown = settled(big, gpu_gib=None, **llama)
    assert not unknown.training.activation_checkpointing
    assert "unknown" in decided(unknown)["activation_checkpointing"].why
    kept = settled([*big, "--activation_checkpointing", "false"], gpu_gib=80, **llama)
    assert not kept.training.activation_checkpointing and "activation_checkpointing" not in decided(kept)
    old_name = settled([*big, "--gradient_checkpointing", "false"], gpu_gib=80, **llama)
    assert not old_name.training.activation_checkpointing


def test_publishing_and_the_token_are_taken_out_of_what_the_trainer_receives():
    config = settled(["--push_to_hub", "true", "--hub_token", "hf_secret", "--output_dir", "outputs/my-run"])
    assert config.training.push_to_hub is False and config.publish_to == "my-run"
    assert config.training.hub_token is None and config.hub_token == "hf_secret"
    assert "hf_secret" not in " ".join(map(str, config.decisions)) and "hf_secret" not in repr(config)
    assert settled(["--push_to_hub", "true", "--hub_model_id", "me/x"]).publish_to == "me/x"


def test_placement_and_engine_follow_the_launch():
    qlora = ["--use_4bit_quantization", "true", "--bf16", "false"]  # bf16 on "a GPU" here would be refused on CPU
    one_gpu = settled(qlora, cuda=True, launch=Launch({"LOCAL_RANK": "1"}))
    assert one_gpu.device_map == {"": 1}  # bitsandbytes quantizes while placing on this rank's GPU
    fsdp = Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, 2)
    assert settled(qlora, cuda=True, launch=fsdp).device_map is None  # FSDP places the weights
    assert settled([], launch=fsdp).cpu_engine == "fsdp" and settled([], cuda=True, launch=fsdp).cpu_engine is None
    fsdp1 = Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_OFFLOAD_PARAMS": "true"}, 2)
    on_cpu = {d.setting: d.value for d in settled([], launch=fsdp1).decisions}  # what a CPU cannot do, said
    assert on_cpu["fsdp_offload_params on CPU"] == "off" and "fsdp_sync_module_states on CPU" not in on_cpu
    zero3 = Launch({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, 2)
    assert settled([], launch=zero3).cpu_engine == "deepspeed"
    gpus = dict(here=False, cuda=True, native_bf16=True)  # a launch checked for GPUs: bf16
    buffers = {name: {d.setting: d.value for d in settled([], launch=launch, **gpus).decisions}
               .get("fsdp1 buffer dtype") for name, launch in (("fsdp1", fsdp1), ("fsdp2", fsdp), ("zero3", zero3))}
    assert buffers == {"fsdp1": "float32", "fsdp2": None, "zero3": None}  # only FSDP1 casts buffers
    assert "fsdp1 buffer dtype" not in {d.setting for d in settled(["--bf16", "false"], launch=fsdp1).decisions}
    # transformers sets a 4-bit model's FSDP policy to its float storage dtype, bf16 flag or not; uint8 storage: none
    assert "fsdp1 buffer dtype" in {d.setting for d in settled(qlora, launch=fsdp1).decisions}
    assert "fsdp1 buffer dtype" not in {d.setting for d in settled(
        [*qlora, "--bnb_4bit_quant_storage_dtype", "uint8"], launch=fsdp1).decisions}
    assert str(settled(qlora).dtype) == "torch.bfloat16"  # the bf16 quant storage dtype


def test_each_precision_a_user_may_set_reaches_the_engine_in_a_form_it_takes():
    """The settings behind three launches that failed after loading (bench/dtype_grid.py has every combination)."""
    qlora = ["--use_4bit_quantization", "true", "--bf16", "false"]
    # FSDP2's parameter offload needs an accelerator (accelerate's load asked for one and raised): off on CPU, said
    fsdp2 = Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}, 2)
    assert {d.setting: d.value for d in settled(qlora, launch=fsdp2).decisions}["fsdp_offload_params on CPU"] == "off"
    assert "fsdp_offload_params on CPU" not in {d.setting for d in settled(qlora, cuda=True, launch=fsdp2).decisions}
    # TRL casts a 4-bit model's adapters to bf16; under float32 storage they stay float32 (FSDP1 computes them so)
    fp32_storage = settled([*qlora, "--bnb_4bit_quant_storage_dtype", "float32"])
    assert fp32_storage.adapter_dtype == torch.float32
    assert settled(qlora).adapter_dtype is None and settled(["--bf16", "false"]).adapter_dtype is None
    # DeepSpeed's config takes the launch's bf16 (transformers writes it there), so the Trainer's flag follows it
    zero3_bf16 = Launch({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                         "ACCELERATE_MIXED_PRECISION": "bf16"}, 2)
    assert settled(["--bf16", "false"], launch=zero3_bf16, native_bf16=True).training.bf16
    assert settled(["--fp16", "true"], launch=zero3_bf16, cuda=True).training.fp16  # a flag that asks one: taken
    fsdp_bf16 = Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "bf16"}, 2)
    assert not settled(["--bf16", "false"], launch=fsdp_bf16).training.bf16  # FSDP reads the launch's own setting
    refused = [str(p) for p in preflight(settled(["--bf16", "false"], launch=zero3_bf16, native_bf16=False))]
    assert any("without native bf16" in p and "launch with --mixed_precision no" in p for p in refused)


def test_torch_compile_exports_per_layer_settings_unless_the_launch_sets_them():
    config = settled(["--torch_compile", "true"])
    assert config.environment == {"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true",
                                  "ACCELERATE_DYNAMO_USE_DYNAMIC": "true"}
    assert decided(config)["torch_compile"].value == "each decoder layer" and config.compile_each_layer
    whole = settled(["--torch_compile", "true"], launch=Launch({"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "false"}))
    assert whole.environment == {"ACCELERATE_DYNAMO_USE_DYNAMIC": "true"}
    assert decided(whole)["torch_compile"].value == "the whole model" and not whole.compile_each_layer


def test_the_native_bf16_switch_overrides_the_probe(monkeypatch):
    from recipe.platform.hardware import native_bf16_supported

    for value, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("RECIPE_NATIVE_BF16", value)
        assert native_bf16_supported() is expected
    monkeypatch.setenv("RECIPE_NATIVE_BF16", "maybe")
    with pytest.raises(ValueError, match="RECIPE_NATIVE_BF16"):
        native_bf16_supported()


def test_gather_reads_the_model_the_tokenizer_and_the_switch(tiny_model_dir, monkeypatch):
    from recipe.settings.arguments import parse_arguments

    monkeypatch.setenv("RECIPE_NATIVE_BF16", "0")
    facts = gather(parse_arguments(["--model_name_or_path", str(tiny_model_dir)]))
    assert facts.here and not facts.native_bf16 and facts.model_config.num_hidden_layers == 2
    assert facts.tokenizer is not None and facts.added_token_ids == [] and facts.host_gib > 0
    missing = gather(parse_arguments(["--model_name_or_path", str(tiny_model_dir / "nothing")]))
    assert missing.model_config is None and missing.tokenizer is None
    elsewhere = gather(parse_arguments(["--accelerate_config", "configs/fsdp2_config.yaml", "--model_name_or_path",
                                        str(tiny_model_dir)]))
    assert not elsewhere.here and elsewhere.cuda and elsewhere.native_bf16 and elsewhere.launch.fsdp
    monkeypatch.setenv("RECIPE_NATIVE_BF16", "yes")
    with pytest.raises(ConfigError, match="use 0 .* or 1"):  # train.py prints it as one error line
        gather(parse_arguments(["--model_name_or_path", str(tiny_model_dir)]))


LLAMA = {"model_config": "llama-2-7b"}
MIXTRAL = {"model_config": "configs/models/Mixtral-8x7B-v0.1"}
FSDP2_FROM_RANK0 = Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                           "WORLD_SIZE": "2"}, 2)
GPU_HERE = {"cuda": True, "here": True, "gpu_gib": 80}
# Each of settle's decisions: (the setting it records, where it fires: flags and facts, where it does not)
DECISIONS = [
    ("use_cpu", ([], {}), ([], GPU_HERE)),
    ("bf16", ([], {}), (["--bf16", "false"], {})),
    ("padding_free", ([], {}), (["--padding_free", "false"], {})),
    ("base model recorded as", (["--model_name_or_path", "models/x", "--base_model_id", "org/x"], {}),
     (["--model_name_or_path", "org/x"], {})),
    ("activation_checkpointing", ([], {**GPU_HERE, **LLAMA}), (["--activation_checkpointing", "false"],
                                                             {**GPU_HERE, **LLAMA})),
    ("activation_checkpointing_kwargs", (["--activation_checkpointing", "true"], {}), ([], {})),
    ("max_length (TRL)", ([], {}), (["--padding_free", "false"], {})),
    ("device_map", (["--use_4bit_quantization", "true"], GPU_HERE), ([], GPU_HERE)),
    ("experts", ([], MIXTRAL), ([], LLAMA)),
    ("loading", ([], {"launch": FSDP2_FROM_RANK0}), ([], {})),
    ("engine on CPU", ([], {"launch": FSDP2_FROM_RANK0}), ([], {})),
    ("torch_compile", (["--torch_compile", "true"], {}), (["--torch_compile", "false"], {})),
    ("per_device_train_batch_size", (["--gradient_accumulation_steps", "4"], {**GPU_HERE, **LLAMA}),
     (["--gradient_accumulation_steps", "4", "--per_device_train_batch_size", "8"], {**GPU_HERE, **LLAMA})),
    ("fused layers", ([], GPU_HERE), ([], {})),
    ("publish to", (["--push_to_hub", "true"], {}), ([], {})),
    ("hub_token", (["--hub_token", "hf_x"], {}), ([], {})),
]


def settled_with(argv, facts):
    facts = dict(facts)
    if "model_config" in facts:
        facts["model_config"] = load_config(facts["model_config"])
    return settled(argv, **facts)


@pytest.mark.parametrize("setting, fires, quiet", DECISIONS, ids=[d[0] for d in DECISIONS])
def test_each_decision_fires_where_it_applies_and_not_elsewhere(setting, fires, quiet):
    assert setting in decided(settled_with(*fires))
    assert setting not in decided(settled_with(*quiet))


def test_the_trainers_arguments_are_built_once_from_what_was_decided():
    """settle's decisions land in the SFTConfig the Trainer receives, which is built after them."""
    config = settled(["--activation_checkpointing", "true", "--push_to_hub", "true", "--hub_token", "hf_x"])
    assert config.decided == {"activation_checkpointing_kwargs": {"use_reentrant": True}, "max_length": None,
                              "push_to_hub": False, "hub_token": None}
    training = config.training
    assert training.activation_checkpointing_kwargs == {"use_reentrant": True} and training.max_length is None
    assert training.push_to_hub is False and training.hub_token is None and config.hub_token == "hf_x"


def test_the_collective_timeout_covers_rank0s_planned_load_then_shortens_once_the_weights_are_in_place():
    """While rank 0 reads (and quantizes) the base, the other ranks wait in their first collective: the timeout set
    before the process group starts covers twice rank 0's planned load, and the training timeout applies once the
    weights are in place; a --ddp_timeout shorter than the plan is refused before loading, with the fix."""
    from recipe.settings.configuration import COLLECTIVE_TIMEOUT_S
    from recipe.planning.memory import LoadRates

    two = Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                  "FSDP_SYNC_MODULE_STATES": "true"}, 2)
    facts = {"launch": two, "model_config": load_config("llama-2-7b")}
    qlora = ["--use_4bit_quantization", "true", "--bf16", "false"]
    slow = settled(qlora, **facts, load_rates=LoadRates(read=0.2, quantize=0.02, source="measured"))
    plan = slow.load_plan
    assert plan["read_gib"] == pytest.approx(12.55, abs=0.1) and plan["quantize"] > plan["read"] > 0  # 7B in fp16
    seconds = plan["read"] + plan["quantize"]
    assert 2 * seconds <= slow.training.ddp_timeout <= 2 * seconds + 60
    assert slow.training_timeout == COLLECTIVE_TIMEOUT_S
    said = {d.setting: d.why for d in slow.decisions}["ddp_timeout"]
    assert "2x its planned load" in said and "quantizing" in said and f"{COLLECTIVE_TIMEOUT_S} s" in said
    lora = settled(["--bf16", "false"], **facts, load_rates=LoadRates(read=2.0, quantize=0.02, source="measured"))
    assert lora.load_plan["quantize"] == 0 and lora.training.ddp_timeout == COLLECTIVE_TIMEOUT_S
    assert lora.training_timeout is None
    assert settled(qlora, model_config=facts["model_config"]).load_plan is None  # one process: nobody waits

    short = settled([*qlora, "--ddp_timeout", "300"], **facts, load_rates=LoadRates(0.2, 0.02, "measured"))
    assert short.training.ddp_timeout == 300 and short.training_timeout is None  # the user's, throughout
    refused = [p for p in preflight(short) if p.level == "error" and "--ddp_timeout 300" in p.what]
    assert refused and f"--ddp_timeout {slow.training.ddp_timeout}" in refused[0].fix


def test_the_load_probes_measure_this_machine(tmp_path):
    from recipe.platform.hardware import cold_read_gib_per_s, quantize_gib_per_s

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(8 * 2**20))
    assert cold_read_gib_per_s([weights]) > 0 and cold_read_gib_per_s([tmp_path / "absent"]) is None
    assert quantize_gib_per_s() > 0


def _fsdp(version: str, **more) -> Launch:
    return Launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": version, **more}, 2)


ABSENT = "no decision"
LLAMA_7B = load_config("llama-2-7b")
QLORA_ARGS = ["--use_4bit_quantization", "true"]
# Each rule of configuration.SETTLING: the setting it decides, then a setup (argv, launch, facts) where it decides one
# value and one where it decides another or nothing (ABSENT).
SETTLING_CASES = [
    ("base_model_id", "base model recorded as",
     ([], None, {}), "HuggingFaceTB/SmolLM2-135M-Instruct", (["--model_name_or_path", "org/model"], None, {}), ABSENT),
    ("attention", "attention",
     (["--use_flash_attn", "true"], None, {"cuda": True}), "kernel_varlen", ([], None, {"cuda": True}), "sdpa_varlen"),
    ("micro_batch", "per_device_train_batch_size",  # of the 8 examples a step, 4 at a time fit 80 GiB unchecked
     ([], None, {"cuda": True, "here": False, "gpu_gib": 80, "model_config": LLAMA_7B}), 4,
     (["--per_device_train_batch_size", "2"], None, {"cuda": True, "here": False, "gpu_gib": 80,
                                                     "model_config": LLAMA_7B}), ABSENT),
    ("activation_checkpointing", "activation_checkpointing",
     ([], None, {"cuda": True, "here": False, "gpu_gib": 16, "model_config": LLAMA_7B}), True,
     ([], None, {"cuda": True, "here": False, "gpu_gib": 80, "model_config": LLAMA_7B}), False),
    ("checkpointing_kwargs", "activation_checkpointing_kwargs",
     (["--activation_checkpointing", "true"], Launch({"ACCELERATE_USE_DEEPSPEED": "true",
                                                      "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, 2), {"cuda": True}),
     {"use_reentrant": True}, ([], None, {}), ABSENT),
    ("lengths", "max_length (TRL)", ([], None, {}), None, (["--packing", "true"], None, {}), ABSENT),
    ("placement", "device_map", (QLORA_ARGS, None, {"cuda": True}), {"": 0}, ([], None, {"cuda": True}), ABSENT),
    ("mixture_of_experts", "experts",
     ([], None, {"model_config": load_config("configs/models/Mixtral-8x7B-v0.1")}),
     "one linear module per expert matrix", ([], None, {"model_config": LLAMA_7B}), ABSENT),
    ("loading", "loading", ([], _fsdp("2", FSDP_CPU_RAM_EFFICIENT_LOADING="true"), {}),
     "rank 0 reads, the other ranks receive", ([], _fsdp("2"), {}), ABSENT),
    ("cpu_engine", "engine on CPU", ([], _fsdp("2"), {}), "fsdp", ([], _fsdp("2"), {"cuda": True}), ABSENT),
    ("fsdp1_buffers", "fsdp1 buffer dtype", ([], _fsdp("1", ACCELERATE_MIXED_PRECISION="bf16"), {}), "float32",
     ([], _fsdp("2", ACCELERATE_MIXED_PRECISION="bf16"), {}), ABSENT),
    ("adapter_dtype", "LoRA weights", (QLORA_ARGS + ["--bnb_4bit_quant_storage_dtype", "float32"], None, {}),
     "float32", (QLORA_ARGS, None, {}), ABSENT),
    ("fused_layers", "fused layers", (["--use_liger_kernels", "true"], None, {}),
     "Liger Kernel (RMSNorm, SwiGLU/GeGLU, RoPE)", ([], None, {}), ABSENT),
    ("compile_layers", "torch_compile", (["--torch_compile", "true"], None, {}), "each decoder layer",
     (["--torch_compile", "false"], None, {}), ABSENT),
    ("data_processes", "tokenizing processes per rank", (["--dataset_num_proc", "3"], None, {"cores": 4}), 3,
     ([], None, {"cores": 4}), 4),
    ("publishing", "publish to", (["--push_to_hub", "true", "--hub_model_id", "me/dates"], None, {}), "me/dates",
     ([], None, {}), ABSENT),
]


def decision_of(setting: str, setup) -> object:
    argv, launch, facts = setup
    config = settled(argv, launch=launch or Launch(), **facts)
    values = [d.value for d in config.decisions if d.setting == setting]
    return values[-1] if values else ABSENT


@pytest.mark.parametrize("rule, setting, one, first, other, second", SETTLING_CASES,
                         ids=[case[0] for case in SETTLING_CASES])
def test_each_settling_rule_decides_where_it_applies_and_only_there(rule, setting, one, first, other, second):
    assert decision_of(setting, one) == first
    assert decision_of(setting, other) == second


def test_every_settling_rule_has_its_cases():
    from recipe.settings import configuration

    assert [rule.__name__ for rule in configuration.SETTLING] == [case[0] for case in SETTLING_CASES]

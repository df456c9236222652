"""Supervised fine-tuning with LoRA or QLoRA, on one CPU or many GPUs, through TRL's SFTTrainer.

    python train.py                                   # LoRA on SmolLM2-135M-Instruct, offline, CPU, ~3 minutes
    python train.py my_run.yaml --learning_rate 2e-4  # keys of the file are the flags; flags override the file
    accelerate launch --config_file configs/fsdp_config.yaml train.py --model_name_or_path meta-llama/Llama-2-70b-hf ...

Every SFTConfig / TrainingArguments flag works (`python train.py --help`). The configuration is checked as a whole
before any weights load; a problem stops the run with a message that names the fix.
"""

from __future__ import annotations

import errno
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, set_seed

from arguments import ConfigError, parse_arguments
from checkpoints import StopOnSignal, latest_complete
from checks import Launch, Problem, Setup, added_tokens_under_fsdp, choose_activation_checkpointing, memory_plan
from checks import preflight, read_model_config
from data_validation import DataError, summarize
from distributed import launch_environment, trainer_class
from evaluate import evaluate_exact_match, heldout_examples
from export import publish
from fast_paths import compile_per_layer_by_default, score_labelled_positions_only
from report import TRAINING_KEYS, write_run_report
from utils import DEFAULT_MODEL_DIR, attention_implementation, build_datasets, build_model, build_peft_config
from utils import build_tokenizer, convert_default_model, drop_bad, load_raw_datasets, token_counts


class StepTimes(TrainerCallback):
    """Wall seconds from one optimizer step's end to the next (the first from the start of training, so it carries the
    warm-up and any compiling): what a step really costs, logging and data included."""

    def __init__(self):
        self.seconds: list[float] = []
        self._last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(round(now - self._last, 4))
        self._last = now

    def steady(self) -> float | None:
        """Median seconds per step after the first, or None with fewer than three steps."""
        return statistics.median(self.seconds[1:]) if len(self.seconds) >= 3 else None


def log(message: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(message, flush=True)


def fail(problems: list[str]) -> None:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    sys.exit(2)


def report(problems: list[Problem]) -> None:
    """Every problem on its own line (rank 0 only); stop with exit code 2 if any is an error."""
    if int(os.environ.get("RANK", 0)) == 0:
        for problem in problems:
            print(f"{problem.level}: {problem}", file=sys.stderr, flush=True)
    if any(problem.level == "error" for problem in problems):
        sys.exit(2)


def report_added_tokens(setup: Setup, added_token_ids: list[int]) -> None:
    setup.added_tokens = len(added_token_ids)
    report([problem for problem in [added_tokens_under_fsdp(setup)] if problem])


def keep_token_out_of_files(training_args) -> None:
    """The Trainer pickles its arguments into every checkpoint (training_args.bin): a --hub_token there would be
    written to disk. Hand it to huggingface_hub through the environment instead, and clear the field."""
    if training_args.hub_token:
        os.environ["HF_TOKEN"] = training_args.hub_token
        training_args.hub_token = None


def take_mode_flags(argv: list[str]) -> tuple[list[str], bool, str | None, float | None]:
    """`--check` (check and exit), and for it `--accelerate_config FILE` (the launch to assume) and `--gpu_gib N`
    (the memory of its GPUs), are modes of this script, not training arguments: take them out before parsing."""
    argv, check = list(argv), "--check" in argv
    if check:
        argv.remove("--check")
    values = {}
    for flag, example in (("--accelerate_config", "configs/fsdp2_config.yaml"), ("--gpu_gib", "80")):
        if flag in argv:
            at = argv.index(flag)
            if at + 1 >= len(argv):
                fail([f"{flag} needs a value: {flag} {example}"])
            values[flag] = argv[at + 1]
            del argv[at : at + 2]
    gpu_gib = values.get("--gpu_gib")
    try:
        gpu_gib = float(gpu_gib) if gpu_gib is not None else None
    except ValueError:
        fail([f"--gpu_gib {gpu_gib}: not a number of GiB, e.g. --gpu_gib 80"])
    return argv, check, values.get("--accelerate_config"), gpu_gib


def launch_in_effect(accelerate_config: str | None) -> tuple[Launch, bool]:
    """The distributed settings of this process, or those `accelerate launch --config_file FILE` would give it; and
    whether they are meant for GPU machines other than this one (a launcher checked from a laptop)."""
    if accelerate_config is None:
        return Launch.current(), False
    if not os.path.isfile(accelerate_config):
        fail([f"--accelerate_config {accelerate_config}: no such file; pass one of configs/*.yaml"])
    import yaml

    config = yaml.safe_load(open(accelerate_config))
    launch = Launch(launch_environment(["--config_file", accelerate_config, "train.py"]), config.get("num_processes", 1))
    return launch, not config.get("use_cpu", False)


def resolve_resume_checkpoint(training_args) -> str | None:
    """`latest` means the newest complete checkpoint in output_dir, or a fresh start when there is none."""
    resume = training_args.resume_from_checkpoint
    return latest_complete(training_args.output_dir) if resume == "latest" else resume


def finish_check(setup: Setup, elsewhere: bool) -> None:
    """--check: what can be known without weights or data, then stop."""
    if setup.model_config is not None:
        plan = memory_plan(setup)
        where = f"{plan.per_gpu_total:.1f} GiB per GPU, " if plan.per_gpu else ""
        log(f"memory plan: {where}{plan.host_total:.1f} GiB host RAM (`python memory.py` for the breakdown)")
        # the tokenizer is readable too: does the chat template add tokens?
        report_added_tokens(setup, build_tokenizer(setup.model, setup.training.trust_remote_code)[1])
    log("check passed: no error in this configuration (data and weights were not read"
        + ("; this machine's hardware was not checked: the launch targets GPUs)" if elsewhere else ")"))


@dataclass
class PreparedData:
    tokenizer: Any
    added_token_ids: list[int]  # tokens the chat template added to the vocabulary
    raw: Any  # the checked, untokenized splits (held-out prompts come from here)
    datasets: dict  # the tokenized splits, bad examples left out
    counts: dict  # examples, tokens and supervised tokens of the train split
    skipped: int  # bad examples left out (--bad_examples skip)


def prepare_data(setup: Setup) -> PreparedData:
    """Tokenizer and data, before the weights: a data problem stops the run while it is still cheap."""
    model_args, data_args, training_args = setup.model, setup.data, setup.training
    try:
        if model_args.model_name_or_path == DEFAULT_MODEL_DIR:
            convert_default_model()
        tokenizer, added_token_ids = build_tokenizer(model_args, training_args.trust_remote_code)
        report_added_tokens(setup, added_token_ids)
        raw, bad, data_format = load_raw_datasets(data_args, training_args.dataset_text_field)
        tokenized, cut = build_datasets(raw, data_format, tokenizer, data_args, training_args)
        bad += cut
        if bad and data_args.bad_examples == "stop":
            raise DataError(bad, sum(len(split) for split in raw.values()) + len(bad) - len(cut))
    except (ValueError, FileNotFoundError) as err:
        fail([str(err)])
    except Exception as err:  # datasets' own parse errors: name the source
        fail([f"could not read dataset {data_args.dataset_name}: {type(err).__name__}: {err}"])
    if bad:
        log(f"skipped {len(bad)} bad examples ({summarize(bad)}), first: {bad[0]}")
    datasets = drop_bad(tokenized, bad)
    counts = token_counts(datasets["train"])
    log(f"data: {data_args.dataset_name} ({data_format}), "
        + ", ".join(f"{split} {len(ds)} examples" for split, ds in datasets.items())
        + f"; training on {counts['examples']} examples, {counts['tokens']} tokens "
          f"({counts['supervised_tokens']} supervised) per epoch")
    return PreparedData(tokenizer, added_token_ids, raw, datasets, counts, len(bad))


def run(argv: list[str] | None = None):
    """The whole recipe; returns the trainer and a summary of the run (losses, held-out exact match, seconds)."""
    started = time.time()
    argv, check_only, accelerate_config, gpu_gib = take_mode_flags(sys.argv[1:] if argv is None else argv)
    try:
        model_args, data_args, training_args, explicit = parse_arguments(argv)
    except ConfigError as err:
        fail([str(err)])
    launch, elsewhere = launch_in_effect(accelerate_config)
    keep_token_out_of_files(training_args)
    setup = Setup(model_args, data_args, training_args, launch, here=not elsewhere,
                  cuda=torch.cuda.is_available() or elsewhere,
                  model_config=read_model_config(model_args.model_name_or_path, training_args.trust_remote_code))
    if gpu_gib is None and setup.here and setup.cuda:
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    setup.gpu_gib = gpu_gib
    if not explicit & {"activation_checkpointing", "gradient_checkpointing"}:
        if reason := choose_activation_checkpointing(setup):
            log(reason)
    report(preflight(setup))
    if check_only:
        finish_check(setup, elsewhere)
        return None, {}

    set_seed(training_args.seed)
    compiled = compile_per_layer_by_default() if training_args.torch_compile else "no"
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "fp32"
    batches = "packed" if training_args.packing else "padding-free" if training_args.padding_free else "padded"
    log(f"device: {world_size} x {device}, precision: {precision}, activation checkpointing: "
        f"{training_args.activation_checkpointing}, torch threads: {torch.get_num_threads()}, attention: "
        f"{attention_implementation(model_args)}, batches: {batches}, compiled: {compiled}")

    data = prepare_data(setup)
    tokenizer, added_token_ids, datasets = data.tokenizer, data.added_token_ids, data.datasets
    eval_split = data_args.eval_split
    heldout = None
    if eval_split and data_args.eval_num_prompts > 0 and world_size == 1:
        heldout = heldout_examples(data.raw[eval_split], data_args.eval_num_prompts)

    model = build_model(model_args, training_args, tokenizer, added_token_ids)
    if training_args.activation_checkpointing:
        training_args.activation_checkpointing_kwargs = {"use_reentrant": model_args.use_reentrant}

    summary: dict = {}
    if heldout is not None:
        summary["exact_match_before"], _ = evaluate_exact_match(model, tokenizer, heldout, data_args.eval_max_new_tokens)
        log(f"held-out exact match before training: {summary['exact_match_before']:.1%} "
            f"({len(heldout.references)} {eval_split} prompts)")

    # The recipe publishes once, at the end, a folder it has built and checked (export.publish); not the Trainer.
    stop_on_signal = StopOnSignal()  # SIGTERM / SIGINT: save a checkpoint at the end of the step, then stop
    step_times = StepTimes()
    publish_to = (training_args.hub_model_id or Path(training_args.output_dir).name) if training_args.push_to_hub else None
    training_args.push_to_hub = False
    arguments = {**asdict(model_args), **asdict(data_args),
                 **{key: getattr(training_args, key) for key in TRAINING_KEYS}}
    if training_args.padding_free and not training_args.packing:
        training_args.max_length = None  # prepare_data truncated already; TRL refuses a length it would not enforce
    score_labelled_positions_only()
    trainer = trainer_class()(
        model=model,
        args=training_args,
        train_dataset=datasets["train"],
        eval_dataset=datasets.get(eval_split) if eval_split else None,
        processing_class=tokenizer,
        peft_config=build_peft_config(model_args, added_token_ids),
        callbacks=[stop_on_signal, step_times],
    )
    if model_args.use_peft_lora and trainer.accelerator.is_main_process:
        trainer.model.print_trainable_parameters()

    trainer.resumed_from = resolve_resume_checkpoint(training_args)
    if trainer.resumed_from:
        log(f"resuming from {trainer.resumed_from}")
    try:
        result = trainer.train(resume_from_checkpoint=trainer.resumed_from)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            raise
        last = latest_complete(training_args.output_dir)
        fail([f"cannot write to {training_args.output_dir}: {err.strerror} ({err.filename or 'while saving'}). Free "
              "space or fix permissions, then continue with --resume_from_checkpoint latest"
              + (f" (last complete checkpoint: {last})" if last else " (no complete checkpoint yet)")])
    if stop_on_signal.received:
        log(f"stopped by signal {stop_on_signal.received} at step {trainer.state.global_step}: checkpoint saved in "
            f"{training_args.output_dir}; continue with --resume_from_checkpoint latest")
        sys.exit(128 + stop_on_signal.received)

    if trainer.is_fsdp_enabled:  # gather the adapter on rank 0 so the final folder is a plain PEFT adapter
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model()
    summary.update(trained_examples=data.counts["examples"], trained_tokens=data.counts["tokens"],
                   skipped_examples=data.skipped)
    summary["train_loss"] = result.training_loss
    summary["train_steps"] = result.global_step
    summary["step_seconds"] = step_times.seconds
    if eval_split and training_args.eval_strategy == "no" and world_size == 1:
        summary["eval_loss"] = trainer.evaluate()["eval_loss"]
    if heldout is not None:
        summary["exact_match_after"], predictions = evaluate_exact_match(
            trainer.model, tokenizer, heldout, data_args.eval_max_new_tokens)
        for prompt, reference, prediction in list(zip(heldout.prompts, heldout.references, predictions))[:3]:
            question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
            log(f"  {question!r} -> {prediction!r} (reference {reference!r})")
        log(f"held-out exact match: {summary['exact_match_before']:.1%} before, {summary['exact_match_after']:.1%} after")
    summary["seconds"] = time.time() - started
    if trainer.accelerator.is_main_process:
        hardware = f"{world_size} x {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}"
        write_run_report(training_args.output_dir, arguments, summary, trainer.state.log_history, hardware)
        if publish_to:
            log(f"published to {publish(Path(training_args.output_dir), publish_to, training_args.hub_private_repo)}")
    steady = step_times.steady()
    log(f"done in {summary['seconds']:.0f} s"
        + (f" ({steady:.2f} s per step after the first, which took {step_times.seconds[0]:.1f} s)" if steady else "")
        + f": train loss {summary['train_loss']:.4f}"
        + (f", eval loss {summary['eval_loss']:.4f}" if not math.isnan(summary.get("eval_loss", math.nan)) else "")
        + f"; adapter and tokenizer in {training_args.output_dir}")
    return trainer, summary


if __name__ == "__main__":
    run()

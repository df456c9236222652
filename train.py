"""Supervised fine-tuning with LoRA or QLoRA, on one CPU or many GPUs, through TRL's SFTTrainer.

    python train.py                                   # LoRA on SmolLM2-135M-Instruct, offline, CPU, ~3 minutes
    python train.py my_run.yaml --learning_rate 2e-4  # keys of the file are the flags; flags override the file
    accelerate launch --config_file configs/fsdp_config.yaml train.py --model_name_or_path meta-llama/Llama-2-70b-hf ...
    python train.py --check --accelerate_config configs/fsdp_config_qlora.yaml configs/llama2_70b_chat_sft.yaml ...

Every SFTConfig / TrainingArguments flag works (`python train.py --help`). The configuration is settled once
(configuration.py) and checked as a whole (checks.py) before any data or weights are read; a problem stops the run
with a message that names the fix.
"""

from __future__ import annotations

from recipe.platform import process

process.before_imports()  # no collection while the libraries import; the exit handler that runs after theirs
from recipe import compat  # first: it imports bitsandbytes before transformers and peft do (compat.py says why)
import math
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import TrainerCallback, set_seed

from recipe.settings.arguments import ConfigError, parse_arguments
from recipe.engines.checkpoints import StopOnSignal, latest_complete
from recipe.settings.checks import Problem, preflight
from recipe.settings.configuration import Configuration, load_text, memory_plan, planned_run, settle
from recipe.settings.facts import gather
from recipe.engines import failures
from recipe.reporting.heldout import HeldOut, evaluate_exact_match, heldout_examples
from export import publish
from recipe.model.fast_paths import EAGER_STEPS_MEASURED, compile_each_layer, compile_repays
from recipe.platform.launch import Launch
from recipe.model.moe import mark_zero3_leaves
from recipe.reporting.report import TRAINING_KEYS, write_run_report
from recipe.planning.run_memory import PhasePeaks, return_freed_memory
from recipe.engines.sharding import gather_adapter, hand_to_the_engine, write_adapter, zero3_config
from recipe.engines.trainers import trainer_class
from recipe.data.training_data import DataError, TrainingData, prepare, summarize
from utils import build_model, build_peft_config

process.after_imports()


def run(argv: list[str]):
    """The whole recipe; returns the trainer and a summary of the run (None and {} with --check)."""
    started = time.time()
    # First: building the memory plan's meta model allocates each weight on the CPU before moving it to meta
    # (accelerate's init_empty_weights), and with glibc's rising threshold those went to the heap, which kept them
    # as ~0.7 GiB of free space the weights were later carved from and held in, past what the run held.
    this_process = Launch.current()  # the environment, read once
    return_freed_memory(this_process.mmap_threshold_set)
    try:
        request = parse_arguments(argv)
        config = settle(request, gather(request, this_process))
    except ConfigError as err:
        stop([str(err)])
    SPEAKER["rank0"] = config.launch.is_rank0
    failures.WATCH["watch"] = failures.RankFailures.of(config.launch)
    timeout = (f", collective timeout {config.training.ddp_timeout} s" + (
        f" while loading, then {config.training_timeout} s" if config.training_timeout else "")
        if config.launch.num_processes > 1 else "")
    log(f"{config.launch.num_processes} x {'cuda' if config.facts.cuda else 'cpu'}, {config.facts.threads} torch "
        f"threads, {config.precision}{timeout}; settled:\n  " + "\n  ".join(map(str, config.decisions)))
    report_problems(preflight(config))
    if request.check:
        return finish_check(config), {}

    set_seed(config.training.seed)
    data = load_data(config)
    # loading: read (from_pretrained), wrap (PEFT, Trainer), shard (until the engine placed it)
    peaks = PhasePeaks(config.launch.phase_marks, config.launch.rank)
    peaks.start("read")
    model = build_base_model(config)
    peaks.start("wrap")
    heldout = heldout_prompts(config, data)
    summary = {}
    if heldout:
        summary["exact_match_before"], _ = evaluate_exact_match(model, config.facts.tokenizer, heldout,
                                                                config.data.eval_max_new_tokens)
        log(f"held-out exact match before training: {summary['exact_match_before']:.1%} "
            f"({len(heldout.references)} {config.data.eval_split} prompts)")
    trainer, step_times = build_trainer(config, model, data)
    trainer.add_callback(TrainPhase(peaks, config.training_timeout))
    peaks.start("shard")
    result = train(trainer, config)
    peaks.start("save")
    save_adapter(trainer, config.launch)
    peaks.end()
    summary.update(trained_examples=data.counts["examples"], trained_tokens=data.counts["tokens"],
                   skipped_examples=len(data.skipped), truncated_examples=len(data.truncated),
                   truncated_supervised_tokens=sum(t.lost for t in data.truncated), train_loss=result.training_loss,
                   train_steps=result.global_step,
                   step_seconds=step_times.seconds, seconds_to_first_step=step_times.seconds_to_first_step(),
                   compiled_after_step=next((c.compiled_after_step for c in trainer.callback_handler.callbacks
                                             if isinstance(c, CompileWhenRepaid)), None),
                   memory_by_rank=every_rank(peaks.phases), load_plan=config.load_plan,
                   memory_plan=planned_phases(config, data))
    if config.data.eval_split and config.training.eval_strategy == "no" and config.launch.num_processes == 1:
        summary["eval_loss"] = trainer.evaluate()["eval_loss"]
    if heldout:
        summary["exact_match_after"], predictions = evaluate_exact_match(trainer.model, config.facts.tokenizer, heldout,
                                                                         config.data.eval_max_new_tokens)
        for prompt, reference, prediction in list(zip(heldout.prompts, heldout.references, predictions))[:3]:
            log(f"  {prompt[-1]['content'] if isinstance(prompt, list) else prompt!r} -> {prediction!r} "
                f"(reference {reference!r})")
        log(f"held-out exact match: {summary['exact_match_before']:.1%} before, "
            f"{summary['exact_match_after']:.1%} after")
    summary["seconds"] = time.time() - started
    if config.launch.is_rank0:
        write_report(config, trainer, summary)
    log_done(config, summary, step_times)
    return trainer, summary


# ---------------------------------------------------------------------------------------------------------------------
# The steps of the story, in its order


SPEAKER = {"rank0": True}  # whether this process speaks: rank 0 of the settled launch (run sets it)


def log(message: str) -> None:
    if SPEAKER["rank0"]:
        print(message, flush=True)


def stop(problems: list[str]) -> None:
    failures.WATCH["error"] = problems[0] if problems else None
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    sys.exit(2)


def report_problems(problems: list[Problem]) -> None:
    """Every problem on its own line (rank 0 only); stop with exit code 2 if any is an error."""
    if SPEAKER["rank0"]:
        for problem in problems:
            print(f"{problem.level}: {problem}", file=sys.stderr, flush=True)
    if any(problem.level == "error" for problem in problems):
        sys.exit(2)


def planned_phases(config: Configuration, data: TrainingData) -> dict | None:
    """The memory plan of each phase, GiB, for this run's data: beside memory_by_rank in run_summary.json, so every
    run can be held against its plan. The data sets the labelled fraction and, unpacked, the row length: a batch holds
    at most its size times the longest example (packed rows fill --max_length; the plan before the data assumes that
    of every row)."""
    if config.facts.model_config is None:
        return None
    counts = data.counts
    labelled = counts["supervised_tokens"] / max(counts["tokens"], 1)
    rows = {} if config.training.packing or not counts["longest"] else {
        "seq": min(planned_run(config).seq, counts["longest"])}
    return memory_plan(config, labelled=labelled, **rows).phases


def finish_check(config: Configuration) -> None:
    """--check: what can be known without weights or data."""
    if config.facts.model_config is not None:
        phases = memory_plan(config).phases
        gpu = ", ".join(f"{phase} {peaks['gpu']:.1f}" for phase, peaks in phases.items()) if config.facts.cuda else ""
        host = ", ".join(f"{phase} {peaks['host machine']:.1f}" for phase, peaks in phases.items())
        log("memory plan, GiB: " + (f"per GPU {gpu}; " if gpu else "") + f"host RAM per machine {host} "
            "(`python memory.py` for the breakdown and its assumptions)")
    if config.load_plan is not None:
        log(f"rank 0's load, planned: {load_text(config.load_plan)}; the other ranks wait up to "
            f"{config.training.ddp_timeout} s for it")
    log("check passed: no error in this configuration (data and weights were not read"
        + ("; this machine's hardware was not checked: the launch targets GPUs)" if not config.facts.here else ")"))


def load_data(config: Configuration) -> TrainingData:
    """Tokenized and checked before the weights: a data problem stops the run while it is still cheap."""
    data_args, training = config.data, config.training
    try:
        # bfd packing (TRL's default) truncates what does not fit as padding-free batches do; its other strategies
        # carry the rest of a long example on into another row, so nothing is lost there
        cuts = not training.packing or training.packing_strategy == "bfd"
        data = prepare(data_args.dataset_name, data_args.split_names, config.facts.tokenizer,
                       max_length=config.max_length if cuts else None, truncate=not training.packing,
                       bad_examples=data_args.bad_examples, long_examples=data_args.long_examples,
                       text_field=training.dataset_text_field, add_special_tokens=data_args.add_special_tokens,
                       append_concat_token=data_args.append_concat_token, token=config.hub_token,
                       num_proc=config.data_processes)
    except (DataError, ValueError, FileNotFoundError) as err:
        stop([str(err)])
    except Exception as err:  # datasets' own parse errors: name the source
        stop([f"could not read dataset {data_args.dataset_name}: {type(err).__name__}: {err}"])
    if data.data_format == "conversational" and not data_args.append_concat_token:
        log("note: --append_concat_token false does not apply to chat data, which ends each turn with its template's "
            "end-of-turn token either way (it is the reference recipe's value for chat)")
    if data.truncated:
        log(f"truncated {len(data.truncated)} examples longer than --max_length {config.max_length}, losing "
            f"{sum(t.lost for t in data.truncated)} supervised tokens (--long_examples: truncate; skip or stop "
            f"instead), first: {data.truncated[0]}")
    if data.skipped:
        log(f"skipped {len(data.skipped)} bad examples ({summarize(data.skipped)}), first: {data.skipped[0]}")
    if data.conversion:
        log(f"data converted: {data.conversion}")
    log(f"data: {data_args.dataset_name} ({data.data_format}), "
        + ", ".join(f"{split} {len(ds)} examples" for split, ds in data.datasets.items())
        + f"; training on {data.counts['examples']} examples, {data.counts['tokens']} tokens "
          f"({data.counts['supervised_tokens']} supervised) per epoch")
    return data


def build_base_model(config: Configuration):
    model = build_model(config.model, config.facts.tokenizer, config.facts.added_token_ids, dtype=config.dtype,
                        attention=config.attention, device_map=config.device_map,
                        weights_from_rank0=config.weights_from_rank0, rank0=config.launch.is_rank0,
                        device=config.training.device,
                        trust_remote_code=config.training.trust_remote_code, token=config.hub_token,
                        place_on=config.place_on)
    if config.model.use_liger_kernels:
        from recipe.model.fast_paths import apply_liger_kernels

        log(f"Liger Kernel replaced: {', '.join(apply_liger_kernels(model))}")
    return model


def heldout_prompts(config: Configuration, data: TrainingData) -> HeldOut | None:
    """Held-out chat prompts for exact match before and after training: single-process runs only."""
    split, count = config.data.eval_split, config.data.eval_num_prompts
    if not (split and count > 0 and config.launch.num_processes == 1):
        return None
    return heldout_examples(data.raw[split], count)


class StepTimes(TrainerCallback):
    """Wall seconds from one optimizer step's end to the next (the first from the start of training, so it carries the
    warm-up and any compiling): what a step really costs, logging and data included."""

    def __init__(self):
        self.seconds: list[float] = []
        self._last = 0.0
        self.first_step_began: float | None = None  # time.time() as the first step began

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step_began is None:
            self.first_step_began = time.time()

    def seconds_to_first_step(self) -> float | None:
        """From the process's start (imports, data, weights, engine) to its first step: what the GPU waited."""
        import psutil

        return self.first_step_began - psutil.Process().create_time() if self.first_step_began else None

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(round(now - self._last, 4))
        self._last = now

    def steady(self) -> float | None:
        """Median seconds per step after the first, or None with fewer than three steps."""
        return statistics.median(self.seconds[1:]) if len(self.seconds) >= 3 else None


class CompileWhenRepaid(TrainerCallback):
    """--torch_compile left unset on one CPU process: after the first step and EAGER_STEPS_MEASURED more (timed by
    `step_times`, a callback before this one), compile each decoder layer if the steps left repay it
    (fast_paths.compile_repays), and say why either way."""

    def __init__(self, step_times: StepTimes, device: str, backend: str):
        self.step_times, self.device, self.backend = step_times, device, backend
        self.compiled_after_step: int | None = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        seconds = self.step_times.seconds
        if len(seconds) != 1 + EAGER_STEPS_MEASURED:
            return
        eager, left = statistics.median(seconds[1:]), state.max_steps - state.global_step
        repays, saved, cost = compile_repays(eager, left, self.device)
        figures = (f"the {left} steps left at {eager:.2f} s each would save about {saved:.0f} s, compiling costs "
                   f"about {cost:.0f} s (counted twice)")
        if repays:
            log(f"torch_compile: compiling each of {compile_each_layer(model, self.backend)} decoder layers now: "
                + figures)
            self.compiled_after_step = state.global_step
        else:
            log(f"torch_compile: staying eager: {figures}")


class TrainPhase(TrainerCallback):
    """The train phase of PhasePeaks starts once the engine has placed the weights and ends with the last step; from
    there the collectives wait `training_timeout` (shorter than the load's, configuration.LOAD_MARGIN), if set."""

    def __init__(self, peaks: PhasePeaks, training_timeout: int | None = None):
        self.peaks, self.training_timeout = peaks, training_timeout

    def on_train_begin(self, args, state, control, **kwargs):
        if self.training_timeout is not None and torch.distributed.is_initialized():
            compat.set_collective_timeout(self.training_timeout)
        self.peaks.start("train")

    def on_train_end(self, args, state, control, **kwargs):
        self.peaks.end()


def every_rank(value):
    """`value` from each rank, in rank order (every rank must call this)."""
    if not torch.distributed.is_initialized():
        return [value]
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def build_trainer(config: Configuration, model, data: TrainingData):
    compat.dynamo_settings_for_accelerate(config.environment)  # read as the Trainer builds its Accelerator
    compat.TRL_SCORES_LABELLED_POSITIONS_ON_CPU.apply()  # the LM head at labelled positions only, on CPU too
    compat.ACCELERATE_ASKS_DEEPSPEED_ONLY_ONCE_IMPORTED.apply()  # no deepspeed import outside ZeRO-3 runs
    if config.launch.deepspeed:  # without torch's inductor, which the engine's optimizer check imports
        compat.import_compiling_later(compat.DEEPSPEED_MUON)
    if config.compile_each_layer:  # the first decoder layer's input then needs grad as every other layer's does: one
        # compiled graph serves them all (it had its own: 30 s more of compiling on a 2 GHz CPU, measured)
        model.enable_input_require_grads()
    step_times = StepTimes()
    callbacks = [step_times]
    if config.compile_when_repaid:
        callbacks.append(CompileWhenRepaid(step_times, config.training.device.type,
                                           config.training.torch_compile_backend or "inductor"))
    trainer = trainer_class(config.cpu_engine, config.launch)(
        signals=StopOnSignal(),  # SIGTERM / SIGINT: save a checkpoint at the end of the step, then stop
        resume=config.training.resume_from_checkpoint,
        model=model,
        args=config.training,
        train_dataset=data.datasets["train"],
        eval_dataset=data.evaluation(config.data.eval_split, config.data.max_eval_samples),
        processing_class=config.facts.tokenizer,
        peft_config=build_peft_config(config.model, config.facts.added_token_ids, model),
        callbacks=callbacks,
    )
    if config.adapter_dtype is not None:  # TRL cast them to bf16 (configuration.adapter_dtype)
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.data = param.data.to(config.adapter_dtype)
    if config.uses_peft and config.base_model_id:  # what adapter_config.json records: not a path on this disk
        for peft_config in trainer.model.peft_config.values():
            peft_config.base_model_name_or_path = config.base_model_id
    if config.launch.zero_stage == 3:
        mark_zero3_leaves(trainer.model)  # before DeepSpeed sets its hooks (engine start or partition_from_rank0)
    if config.weights_from_rank0 and config.launch.fsdp and config.launch.fsdp_version == 2:
        compat.ACCELERATE_FSDP2_RELEASES_EACH_SENT_TENSOR.apply()  # about one base on rank 0's host, not two
    if config.weights_from_rank0:  # the engine broadcasts rank 0's weights (sharding.py)
        hand_to_the_engine(trainer.model, zero3_config() if config.launch.zero_stage == 3 else None,
                           config.training.device)
    if config.uses_peft and config.launch.is_rank0:
        trainer.model.print_trainable_parameters()
        log("LoRA adapts: " + ", ".join(f"{name} x {count}" for name, count in adapted_matrices(trainer.model).items()))
    return trainer, step_times


def adapted_matrices(model) -> dict[str, int]:
    """How many matrices of each name LoRA adapts (q_proj x 2, w1 x 16, gate.weight x 2 ...): nothing left out
    unseen."""
    from collections import Counter

    from peft.tuners.lora import LoraLayer, ParamWrapper

    counts = Counter()
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            counts[f"{name.rsplit('.', 1)[-1]}.{module.parameter_name}"] += 1
        elif isinstance(module, LoraLayer):
            counts[name.rsplit(".", 1)[-1]] += 1
    return dict(sorted(counts.items()))


def train(trainer, config: Configuration):
    """trainer.train, resumed where asked; a full disk, a lost rank or a signal ends the run with what to do next."""
    output_dir = config.training.output_dir
    if trainer.resumed_from:
        log(f"resuming from {trainer.resumed_from}")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        result = trainer.train(resume_from_checkpoint=trainer.resumed_from)
    except (Exception, CheckpointException) as err:
        if failure := failures.failed_elsewhere(err, config.launch, output_dir):
            failures.stop_for(config.launch, failure)
        last = latest_complete(output_dir)
        resume = "--resume_from_checkpoint latest" + (f" (last complete checkpoint: {last})" if last else
                                                      " (no complete checkpoint yet)")
        if why := failures.write_failure(err, output_dir):
            stop([f"cannot write to {output_dir}: {why}. Free space or fix permissions, then continue with {resume}"])
        if config.launch.num_processes > 1 and (why := failures.lost_rank(err)):
            if (watch := failures.WATCH["watch"]) and (failure := watch.announced()):
                failures.stop_for(config.launch, failure)  # the rank that failed first says why
            failures.WATCH["error"] = f"lost the other ranks ({why})"
            print(f"error: rank {config.launch.rank} lost the other ranks at step {trainer.state.global_step} ({why}). "
                  "Another process or node stopped (killed, lost, out of memory: see its own log), or a collective "
                  f"waited longer than the collective timeout, {config.training.ddp_timeout} s (--ddp_timeout). "
                  f"Start every node again with {resume}.", file=sys.stderr, flush=True)
            sys.exit(1)
        raise
    if received := trainer.signals.received:
        log(f"stopped by signal {received} at step {trainer.state.global_step}: checkpoint saved in "
            f"{output_dir}; continue with --resume_from_checkpoint latest")
        if config.launch.stop_report:  # every rank of every node stopped for it: each node's launcher exits 128 + N
            Path(config.launch.stop_report).write_text(str(received))
        sys.exit(128 + received)
    return result


def save_adapter(trainer, launch: Launch) -> None:
    """The final folder: a plain PEFT adapter, the tokenizer and the training arguments, written once by rank 0
    (sharding.write_adapter). Under FSDP and ZeRO-3 only the trainable parameters are gathered, onto rank 0
    (sharding.gather_adapter), never the frozen base."""
    state = gather_adapter(trainer.model, launch.is_rank0) if launch.sharded else None  # every rank gathers
    if not launch.is_rank0:
        return
    output_dir = Path(trainer.args.output_dir)
    write_adapter(trainer.accelerator.unwrap_model(trainer.model), output_dir, state)
    trainer.processing_class.save_pretrained(output_dir)
    torch.save(trainer.args, output_dir / "training_args.bin")


def write_report(config: Configuration, trainer, summary: dict) -> None:
    """run_summary.json and the curves (rank 0); then publish, if asked."""
    arguments = {**asdict(config.model), **asdict(config.data),
                 **{key: getattr(config.training, key) for key in TRAINING_KEYS}, "max_length": config.max_length,
                 "base_model": config.base_model_id or config.model.model_name_or_path}
    hardware = f"{config.launch.num_processes} x " + (torch.cuda.get_device_name(0) if config.facts.gpu_here else "CPU")
    write_run_report(config.training.output_dir, arguments, summary, trainer.state.log_history, hardware,
                     [decision.said() for decision in config.decisions])
    if config.publish_to:
        url = publish(Path(config.training.output_dir), config.publish_to, config.training.hub_private_repo,
                      token=config.hub_token)
        log(f"published to {url}")


def log_done(config: Configuration, summary: dict, step_times: StepTimes) -> None:
    steady, first = step_times.steady(), summary.get("seconds_to_first_step")
    timing = ([f"first step {first:.0f} s after the start"] if first is not None else []) + (
        [f"{steady:.2f} s per step after the first, which took {step_times.seconds[0]:.1f} s"] if steady else [])
    log(f"done in {summary['seconds']:.0f} s" + (f" ({'; '.join(timing)})" if timing else "")
        + f": train loss {summary['train_loss']:.4f}"
        + (f", eval loss {summary['eval_loss']:.4f}" if not math.isnan(summary.get("eval_loss", math.nan)) else "")
        + f"; adapter and tokenizer in {config.training.output_dir}")


def main(argv: list[str]) -> None:
    """`python train.py ARGS`."""
    try:
        run(argv)
    except BaseException as err:
        code = err.code if isinstance(err, SystemExit) else 1
        # Not for a signal, which stopped every rank by itself at the same step (exit code 128 + N)
        if (watch := failures.WATCH["watch"]) is None or code in (0, None) or not isinstance(code, int) or code >= 128:
            raise
        watch.announce(failures.WATCH["error"] or f"{type(err).__name__}: {str(err)[:300]}")
        if not isinstance(err, SystemExit):
            traceback.print_exc()
        process.exit_now(code)
    process.finish()


if __name__ == "__main__":
    main(sys.argv[1:])

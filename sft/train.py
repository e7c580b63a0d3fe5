"""Supervised fine-tuning entry point (`sft train` is the same).

    torchrun --nproc_per_node N sft/train.py --config recipes/demo.yaml [--deepspeed ds_configs/zero3.json] [--flag v]
    deepspeed sft/train.py --config ...        python sft/train.py --config ...        sft train --config ...

Parse the recipe, plan batch and memory, load and check the data, build the model, build the trainer, train, save.
"""

from __future__ import annotations

import logging
import os
import sys

from sft.errors import PREEMPTED_EXIT_CODE, ConfigError, SFTError

logger = logging.getLogger("sft")


def main(argv: list[str] | None = None, watch=None) -> None:
    """One training run; `watch` (`sft.run.failsafe.OutOfMemoryWatch`, made here if not given) learns the batch and
    step that an out-of-memory error's message names."""
    from sft.run import failsafe

    watch = watch if watch is not None else failsafe.OutOfMemoryWatch()
    trainer, plan, resume_from, model_path = build(argv, watch)
    trainer.train(resume_from_checkpoint=resume_from)
    if plan.vision and plan.training_args.process_index == 0:
        from sft.data import vision

        vision.save_image_processor(model_path, plan.training_args.output_dir)
    _save(trainer, plan.training_args)


def build(argv: list[str] | None, watch) -> tuple:
    """Everything before the first step: the arguments parsed, the run planned, the data loaded and checked, the
    output directory claimed, the model and the trainer built. Returns (trainer, plan, the checkpoint it resumes or
    None, the model's path). `sft check` builds the same, with its own output directory, and trains nothing."""
    from sft.core import logs
    from sft.parallel import nodes
    from sft.parallel.distributed import init_process_group, timeout_seconds
    from sft.plan.arguments import parse_args

    init_process_group()
    script_args, data_args, training_args, model_args = parse_args(argv)
    logs.setup(training_args)
    nodes.log_table(timeout_seconds())

    from trl import get_peft_config

    from sft.data.load import check_tokenizer, load_datasets
    from sft.model.build import load_model, load_tokenizer
    from sft.run.trainer import Trainer

    plan, resume_from, saved = _plan(training_args, model_args, data_args)  # the run decided once, before any work
    watch.planned(plan)  # the batch an out-of-memory message names
    training_args = plan.training_args
    tokenizer = load_tokenizer(model_args, training_args)
    collator = None
    if plan.vision:  # image+text rows, packed by sft.data.vision
        from sft.data import vision

        train_dataset, eval_dataset, splits = vision.load_datasets(
            script_args, data_args, training_args, tokenizer, model_args.model_name_or_path, plan
        )
    else:
        train_dataset, eval_dataset = load_datasets(script_args, data_args, training_args)
        check_tokenizer(train_dataset, tokenizer, training_args)
    fingerprint = _take_output_dir(plan, (script_args, data_args, model_args), tokenizer, train_dataset, saved)
    if not plan.vision:
        _log_data_figures(train_dataset, tokenizer, plan)
    model = load_model(model_args, plan)
    peft_config = get_peft_config(model_args)
    if peft_config is not None and peft_config.target_modules is None:
        from sft.model import architectures

        peft_config.target_modules = architectures.lora_targets(plan.model_config, plan.vision is not None)
    if plan.vision:
        collator = vision.Collator(vision.packer(model), splits)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      processing_class=tokenizer, data_collator=collator, peft_config=peft_config, plan=plan,
                      fingerprint=fingerprint, watch=watch)  # fmt: skip
    return trainer, plan, resume_from, model_args.model_name_or_path


def _plan(training_args, model_args, data_args):
    """(the RunPlan, the checkpoint it resumes or None, that checkpoint's fingerprint or None); the GPU capped where
    `max_gpu_memory_gib` asks."""
    from sft.core.run import Resume
    from sft.plan import fits as fitting
    from sft.plan.preflight import preflight
    from sft.run import checkpoint as ckpt

    resume_from = ckpt.resolve_resume(training_args)
    saved = ckpt.read_state(resume_from)["fingerprint"] if resume_from else None
    resume = Resume.of(resume_from, saved) if resume_from else None
    plan = preflight(training_args, model_args, resume, data_args.datasets)
    cap = plan.training_args.max_gpu_memory_gib
    if fitting.cap_gpu_memory(cap):
        logger.info("GPU memory capped at %.1f GiB per process (max_gpu_memory_gib)", cap)
    return plan, resume_from, saved


def _take_output_dir(plan, arguments: tuple, tokenizer, train_dataset, saved: dict | None) -> dict:
    """The run's fingerprint, checked against every rank's and the resumed checkpoint's before anything in
    output_dir changes; then the main process claims output_dir and records the settings. Returns the fingerprint."""
    from sft.parallel.distributed import check_ranks_agree
    from sft.run import checkpoint as ckpt

    script_args, data_args, model_args = arguments
    training_args, resume_from = plan.training_args, plan.resume.checkpoint if plan.resume else None
    fingerprint = ckpt.fingerprint(script_args, data_args, plan, model_args, tokenizer, len(train_dataset))
    check_ranks_agree(fingerprint, script_args, data_args, training_args, model_args)
    if resume_from:  # a checkpoint of another run (or model) is refused before anything in output_dir changes
        ckpt.compare_fingerprints(saved, fingerprint, resume_from)
    training_args.distributed_state.wait_for_everyone()  # every rank read output_dir before anyone writes there
    if training_args.process_index == 0:
        ckpt.claim_output_dir(training_args.output_dir)
        ckpt.set_aside_incomplete(training_args.output_dir, resume_from)
        ckpt.record_settings(training_args.output_dir, fingerprint)
    training_args.distributed_state.wait_for_everyone()
    if resume_from:
        plan.engine.convert_for_resume(training_args, resume_from)
    return fingerprint


def _log_data_figures(train_dataset, tokenizer, plan) -> None:
    """The data's figures at the start. Tokenised by TRL's own steps on every rank (their main-process-first barriers
    must match), which the trainer then finds in the datasets cache."""
    from sft.data import stats as datastats

    stats = datastats.for_training(train_dataset, tokenizer, plan)
    if stats is not None:
        logger.info("%s", datastats.describe(stats, long=False))
    else:
        logger.info("No data figures at the start: %s", datastats.skipped(train_dataset, plan.training_args))


def _save(trainer, training_args) -> None:
    """After training: a preempted run leaves with its exit code; a finished one saves the model, marks the output
    finished and writes its report (main process), every rank's last collective done before any teardown."""
    from sft.run import checkpoint as ckpt

    if trainer.preempted:
        logger.warning("Stopped on a signal with a complete checkpoint; run the same command to continue.")
        trainer.end()
        raise SystemExit(PREEMPTED_EXIT_CODE)
    before = set(os.listdir(training_args.output_dir))
    trainer.save_model(training_args.output_dir)
    if training_args.process_index == 0:
        ckpt.mark_finished(
            training_args.output_dir,
            trainer.state.global_step,
            training_args.max_steps,
            training_args.num_train_epochs,
            before,
        )
    logger.info("Saved the model and tokenizer to %s", training_args.output_dir)
    if training_args.process_index == 0 and training_args.report:
        from sft.run import report

        try:
            logger.info("Report (curves, settings, totals): %s", report.write([training_args.output_dir]))
        except Exception as e:  # the model is saved: a report that fails must not fail the run
            logger.warning("The report could not be written (%s: %s); the run is complete.", type(e).__name__, e)
    training_args.distributed_state.wait_for_everyone()  # every rank's last collective is done before any teardown
    trainer.end()


def cli(argv: list[str] | None = None) -> int:
    import torch

    from sft.core import retry
    from sft.run import failsafe

    watch = failsafe.OutOfMemoryWatch()
    try:
        main(argv, watch)
    except failsafe.NonFiniteStep as e:
        from sft.parallel.launch import report_error

        report_error(str(e))
        return retry.NONFINITE_EXIT_CODE
    except SFTError as e:
        from sft.parallel.launch import report_error

        report_error(str(e))
        return 2
    except torch.OutOfMemoryError as e:  # a run that ran out of memory never ends as a success (sft.run.failsafe)
        from sft.parallel.launch import ERROR_FILE_ENV, report_error

        code, message = watch.out_of_memory(e, os.environ.get(ERROR_FILE_ENV), int(os.environ.get("RANK", "0")))
        if code == retry.OOM_EXIT_CODE:
            logger.warning("%s", message)
        else:
            report_error(message, every_rank=True)
        return code
    return 0


def run(argv: list[str] | None = None) -> None:
    """The process entry point: train, then leave with the exit code (see `sft.core.leave`). With
    launcher flags (`--nproc-per-node N`, `sft.parallel.launch`), start that many worker processes that each run this
    instead."""
    from sft.core.recipe import read_recipe_in, with_config
    from sft.parallel import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # the launcher's own errors: its flags, or this node cannot take part (sft.parallel.nodes)
        launcher_args, train_args = launch.split_args(argv)
        argv = train_args = with_config(train_args, "sft train")  # `sft train RECIPE` too
        if {"-h", "--help", "--help-all"} & set(train_args):
            from sft.plan.arguments import parse_args

            parse_args(train_args)  # prints the fields and exits 0, before any process, variable or process group
        read_recipe_in(train_args)  # a missing or malformed recipe said before torch is imported
        if launcher_args:
            if "LOCAL_RANK" in os.environ:
                raise ConfigError("--nproc-per-node starts worker processes; this already is one (under torchrun or "
                                  "deepspeed). Drop the launcher flags.")  # fmt: skip
            sys.exit(launch.launch(launcher_args, train_args))
    except SFTError as e:
        print(f"sft: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    from sft.core.leave import leave
    from sft.parallel.distributed import lone_process_environment

    lone_process_environment()  # no launcher: the variables of a one-process launch (DeepSpeed needs them)
    try:
        code = cli(argv)
    except SystemExit as e:  # a preempted run's exit code
        code = e.code if isinstance(e.code, int) else 1
    leave(code)


if __name__ == "__main__":
    run()

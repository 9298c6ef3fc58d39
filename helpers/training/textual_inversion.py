"""The textual-inversion engine: learn new token embeddings for a concept, lean enough for CPUs.

What differs from diffusers' ``examples/textual_inversion/textual_inversion.py`` (same maths):

* Only the new rows are parameters. The 49,409 x 768 embedding matrix stays frozen; a small
  module (:class:`LearnedEmbeddings`) holds the ``num_vectors x hidden`` trainable values and
  substitutes them into the token-embedding output through a forward hook. So AdamW keeps state
  for those rows only, nothing is restored after each step, and data-parallel training
  all-reduces ``num_vectors x hidden`` floats per step instead of the whole matrix (152 MB).
* The VAE encoder runs once per image view (each image, flipped or not) before training; each
  step samples the latent from the cached mean and std, which is the same distribution as
  re-encoding. The latents are also kept on disk (:mod:`helpers.training.engine.latents`), so a re-run
  with the same pictures and VAE does not even load the VAE; the results stay the same bit for bit.
* Every random draw of a sample (latent noise, diffusion noise, timestep) comes from a generator
  keyed by (seed, epoch, sample index). The run is therefore reproducible, a resumed run equals an
  uninterrupted one, and 2 processes x batch 1 compute the same update as 1 process x batch 2.

:func:`train` reads as the run does: check the inputs, set up, resume, train (one
:func:`training_step` per optimisation step), write the outputs. The parts live in
:mod:`helpers.training.engine`; every public name is importable from here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from helpers.core import cpu
from helpers.core.outputs import (
    HISTORY,
    HISTORY_PARTIAL,
    LEARNED_EMBEDS,
    MODEL_INDEX,
    SAMPLES,
    SUMMARY,
    TRAIN_CONFIG,
)
from helpers.ranks import faults, status
from helpers.training import data, models
from helpers.training.config import TrainConfig
from helpers.training.engine import TrainingDivergedError, TrainingInputError, tracking
from helpers.training.engine.checkpoints import (
    check_not_past_the_end,
    checkpoint_step,
    list_checkpoints,
    load_history,
    load_state,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from helpers.training.engine.folder import (
    FolderLock,
    OutputFolder,
    check_checkpoint_matches,
    check_output_dir,
    checkpoint_settings,
    clear_leftovers,
    clear_run,
    hold_output_dir,
    inspect_output_dir,
)
from helpers.training.engine.rows import (
    EmbeddingHook,
    LearnedEmbeddings,
    add_placeholder_tokens,
    check_tokens,
    placeholder_tokens_for,
    write_rows,
)
from helpers.training.engine.saving import (
    PipelineCopy,
    remove_full_pipeline,
    save_full_pipeline,
    save_learned_embeds,
    save_samples,
    storage_errors,
    write_json,
)
from helpers.training.engine.setup import Run, setup_run
from helpers.training.engine.step import (
    AllreduceCounter,
    EpochSampler,
    StepParts,
    cache_latents,
    check_gradient_reaches,
    diffusion_loss,
    draw_batch,
    draw_sample_noise,
    sample_generator,
    training_step,
)

__all__ = [
    "HISTORY",
    "LEARNED_EMBEDS",
    "SUMMARY",
    "AllreduceCounter",
    "EmbeddingHook",
    "EpochSampler",
    "LearnedEmbeddings",
    "PipelineCopy",
    "Run",
    "StepParts",
    "TrainResult",
    "TrainingDivergedError",
    "TrainingInputError",
    "add_placeholder_tokens",
    "cache_latents",
    "check_gradient_reaches",
    "CheckedInputs",
    "FolderLock",
    "OutputFolder",
    "check_checkpoint_matches",
    "check_inputs",
    "check_output_dir",
    "clear_leftovers",
    "clear_run",
    "hold_output_dir",
    "inspect_output_dir",
    "check_not_past_the_end",
    "checkpoint_settings",
    "checkpoint_step",
    "check_tokens",
    "diffusion_loss",
    "draw_batch",
    "draw_sample_noise",
    "list_checkpoints",
    "placeholder_tokens_for",
    "prune_checkpoints",
    "resolve_checkpoint",
    "sample_generator",
    "save_checkpoint",
    "save_full_pipeline",
    "save_learned_embeds",
    "setup_run",
    "train",
    "training_step",
    "write_json",
    "write_rows",
]

logger = get_logger(__name__)


@dataclass
class TrainResult:
    """What a finished run produced.

    Attributes:
        output_dir: the run's folder.
        learned_embeds_path: ``output_dir/learned_embeds.safetensors``.
        pipeline_dir: ``output_dir`` itself when the full pipeline was saved into it
            (``save_as_full_pipeline``), else None.
        placeholder_tokens: the tokens learned (``<tok>``, ``<tok>_1``, ...).
        history: one record per step (step, loss, lr, seconds).
        summary: what ``run_summary.json`` holds.
    """

    output_dir: Path
    learned_embeds_path: Path
    pipeline_dir: Path | None
    placeholder_tokens: list[str]
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_inputs` found: the images, the output folder's state, the checkpoint to resume."""

    images: list[Path]
    folder: OutputFolder
    checkpoint: Path | None


def check_inputs(config: TrainConfig, tokenizer=None) -> CheckedInputs:
    """Every cheap check of a run, before any model is resolved or loaded.

    IPEX if asked for, the output folder (:func:`helpers.training.engine.folder.check_output_dir`), the images, the checkpoint
    to resume (complete, of the same run, not past the last step) and, given the tokenizer, the tokens.

    Raises:
        TrainingInputError, helpers.training.data.ImageFolderError: one message with the fix.
    """
    if config.train_data_dir is None:
        raise TrainingInputError(
            "train_data_dir is not set. Fix: pass a folder of 3-5 images of your concept, "
            f"or the bundled sample: --train_data_dir {data.sample_concept_dir()}"
        )
    if config.use_ipex and (problem := cpu.ipex_problem()):
        raise TrainingInputError(f"use_ipex: {problem}. Fix: {cpu.IPEX_FIX}, or leave use_ipex off.")
    folder = check_output_dir(config)
    images = data.validate_image_folder(config.train_data_dir, min_size=config.resolution)
    ckpt = None
    if config.resume_from_checkpoint:
        ckpt = resolve_checkpoint(folder.path, config.resume_from_checkpoint)
        check_checkpoint_matches(ckpt, config)
        if config.max_train_steps is not None:
            check_not_past_the_end(ckpt, config.max_train_steps)
    if tokenizer is not None:
        templates = data.prompt_templates(config.learnable_property)
        check_tokens(
            tokenizer, config.placeholder_token, config.initializer_token, config.num_vectors, templates
        )
    return CheckedInputs(images, folder, ckpt)


def train(config: TrainConfig) -> TrainResult:
    """Run textual inversion as configured; return what was produced.

    Works the same in one process and under ``accelerate launch`` / ``torchrun`` / ``mpirun``.
    Only the main process writes outputs, holding ``output_dir``'s lock from before the models load.
    """
    from transformers import CLIPTokenizer

    called = time.perf_counter()
    checked = check_inputs(config)  # the folder, images and checkpoint, before any model work
    model_dir = models.resolve_model(config.pretrained_model_name_or_path, config.revision)
    tokenizer = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
    templates = data.prompt_templates(config.learnable_property)
    check_tokens(tokenizer, config.placeholder_token, config.initializer_token, config.num_vectors, templates)
    with hold_output_dir(config):  # one run per folder: a second one is refused with this one's pid
        return _train(config, called, checked, model_dir, tokenizer)


def _train(
    config: TrainConfig, called: float, checked: CheckedInputs, model_dir: Path, tokenizer
) -> TrainResult:
    run = setup_run(config, model_dir, tokenizer)
    start = resume(run, checked.checkpoint)
    history = prepare_output_dir(run, start)
    tracking.start(run.accelerator, "textual_inversion", dataclasses.asdict(config))
    # The full pipeline's unchanged weights go to disk while the steps run, not after them.
    copied = PipelineCopy(model_dir, run.output_dir) if writes_pipeline(run) else None
    try:
        record_startup(run, called)
        # A run never trains past max_steps: resumed at its last step, it only writes the outputs.
        last = train_loop(run, start, history) if start < run.max_steps else start
        return write_outputs(run, history, last, copied)
    finally:
        if copied is not None:
            copied.discard()


def writes_pipeline(run: Run) -> bool:
    """Whether this process saves the full pipeline at the end (``--save_as_full_pipeline``, main process)."""
    return run.config.save_as_full_pipeline and run.accelerator.is_main_process


def resume(run: Run, ckpt: Path | None) -> int:
    """Load the checkpoint (if any) into the run; return the step training continues after (0: none)."""
    if ckpt is None:
        return 0
    check_not_past_the_end(ckpt, run.max_steps)  # max_steps may come from num_train_epochs
    load_state(run.accelerator, ckpt)
    step = checkpoint_step(ckpt)
    logger.info(f"resumed from {ckpt} at step {step}", main_process_only=True)
    return step


def record_startup(run: Run, called: float) -> None:
    """Note in ``run.startup`` how long start-up took, up to the first step (its own time is in the history).

    Args:
        run: the run, about to take its first step.
        called: ``time.perf_counter()`` when :func:`train` was called.
    """
    run.startup["seconds_to_first_step"] = time.perf_counter() - called
    # the whole process: interpreter start, imports, then train()
    run.startup["process_seconds_to_first_step"] = cpu.process_age()
    logger.info(f"start-up took {run.startup['seconds_to_first_step']:.1f} s", main_process_only=True)


def prepare_output_dir(run: Run, start: int) -> list[dict]:
    """Make ``output_dir`` ready; return the history so far (steps 1..``start``).

    The main process removes what the settings replace (``overwrite_output_dir``: every file of
    an earlier run; always: temporaries of killed writes, and the summary of a run resumed after
    it finished, which is not finished again until its outputs are), then writes the settings.
    """
    config, output_dir = run.config, run.output_dir
    if run.accelerator.is_main_process:
        if config.overwrite_output_dir and not config.resume_from_checkpoint:
            clear_run(output_dir)
        else:
            clear_leftovers(output_dir)
        (output_dir / SUMMARY).unlink(missing_ok=True)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / TRAIN_CONFIG)
    run.accelerator.wait_for_everyone()
    return load_history(output_dir, start) if start else []


def _step_groups(loader: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """The loader's micro-batches, ``size`` per optimisation step (fewer at the end of an epoch)."""
    group: list[dict] = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _schedule(run: Run, start: int) -> Iterator[tuple[int, list[dict]]]:
    """``(epoch, micro_batches)`` of each optimisation step after step ``start``, in order."""
    accumulate = run.config.gradient_accumulation_steps
    first_epoch = start // run.steps_per_epoch
    skip = (start % run.steps_per_epoch) * accumulate  # micro-batches of this epoch already trained
    for epoch in range(first_epoch, run.num_epochs):
        run.sampler.epoch = epoch
        loader = run.loader
        if epoch == first_epoch and skip:
            loader = run.accelerator.skip_first_batches(run.loader, skip)
        for micro_batches in _step_groups(loader, accumulate):
            yield epoch, micro_batches


def train_loop(run: Run, start: int, history: list[dict]) -> int:
    """Train from step ``start`` to ``run.max_steps``, appending to ``history``; return the last step."""
    accelerator, step = run.accelerator, start
    progress = tqdm(
        total=run.max_steps,
        initial=step,
        desc="textual inversion",
        unit="step",
        disable=not accelerator.is_local_main_process,
    )
    step_start = time.perf_counter()
    # Each step allocates and frees gigabytes; keeping freed memory avoids re-faulting it in (cpu.py).
    # The bar is closed however the loop ends, so an error is printed on a line of its own.
    with progress, cpu.keep_freed_memory():
        for epoch, micro_batches in _schedule(run, start):
            local_loss = training_step(run.parts, micro_batches, epoch, step + 1)
            step += 1
            loss = accelerator.reduce(torch.tensor(local_loss), reduction="mean").item()
            history.append(
                {
                    "step": step,
                    "loss": loss,
                    "lr": run.parts.lr_scheduler.get_last_lr()[0],
                    "seconds": time.perf_counter() - step_start,
                }
            )
            tracking.log_step(accelerator, step, {"loss": loss, "lr": history[-1]["lr"]})
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}")
            status.beat("training", step)  # helpers.launch's stall detection
            faults.stall_after_step(accelerator.process_index, step)  # test-only
            _periodic_saves(run, step, history)
            step_start = time.perf_counter()
            if step >= run.max_steps:
                break
    return step


def _periodic_saves(run: Run, step: int, history: list[dict]) -> None:
    config, accelerator = run.config, run.accelerator
    if step % config.save_steps == 0 and accelerator.is_main_process:
        path = run.output_dir / f"learned_embeds-steps-{step}.safetensors"
        save_learned_embeds(path, config.placeholder_token, run.vectors)
    if step % config.checkpointing_steps == 0:
        vectors = run.vectors
        save_checkpoint(
            accelerator,
            config,
            run.output_dir,
            step,
            history,
            lambda folder: save_learned_embeds(folder / LEARNED_EMBEDS, config.placeholder_token, vectors),
        )
    if config.validation_prompt and config.num_validation_images and step % config.validation_steps == 0:
        if accelerator.is_main_process:
            tracking.log_images(
                accelerator, step, save_samples(run, run.output_dir / SAMPLES / f"step-{step}")
            )
        else:
            status.beat(status.WAITING, step)  # rank 0 samples meanwhile
        accelerator.wait_for_everyone()


def _summary(run: Run, history: list[dict], steps: int) -> dict:
    config, accelerator, vectors = run.config, run.accelerator, run.vectors
    gathered = accelerator.gather(vectors.detach()[None])
    identical = bool(all(torch.equal(gathered[0], g) for g in gathered))
    del gathered  # a collective's output: gloo's thread must not be the one to free it at teardown
    timed = [h["seconds"] for h in history[1:]] or [h["seconds"] for h in history]  # step 1 includes warm-up
    seconds_per_step = sum(timed) / max(len(timed), 1)
    images_per_step = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    counter = run.counter
    return {
        "world_size": accelerator.num_processes,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "steps": steps,
        "final_loss": history[-1]["loss"] if history else None,
        "seconds_per_step": seconds_per_step,
        "steps_per_second": 1.0 / seconds_per_step if seconds_per_step else None,
        "images_per_second": images_per_step / seconds_per_step if seconds_per_step else None,
        "precision": run.precision.mixed_precision,
        "precision_reason": run.precision.reason,
        "placeholder_tokens": run.tokens,
        "trainable_parameters": vectors.numel(),
        "allreduce_bytes_per_step": counter.bytes // max(counter.calls, 1),
        "allreduce_calls": counter.calls,  # one per optimizer step, none per accumulated micro-batch
        "full_matrix_allreduce_bytes_per_step": run.text_encoder.get_input_embeddings().weight.numel() * 4,
        "embeddings_identical_across_ranks": identical,
        "threads_per_process": torch.get_num_threads(),
        "startup": run.startup,  # seconds to the first step, what the latent cache and prepacking did
    }


def write_outputs(run: Run, history: list[dict], steps: int, copied: PipelineCopy | None) -> TrainResult:
    """Write the learned embeddings, history, final samples, the pipeline and, last, the summary.

    ``copied``: the :class:`PipelineCopy` started with the run when :func:`writes_pipeline`.
    """
    config, accelerator, output_dir = run.config, run.accelerator, run.output_dir
    summary = _summary(run, history, steps)
    run.hook.remove()
    learned_path = output_dir / LEARNED_EMBEDS
    pipeline_dir = output_dir if config.save_as_full_pipeline else None
    status.beat("saving" if accelerator.is_main_process else status.WAITING, steps)
    if accelerator.is_main_process:
        with storage_errors(learned_path, "the learned embeddings"):
            save_learned_embeds(learned_path, config.placeholder_token, run.vectors)
            write_json(output_dir / HISTORY, history)
        (output_dir / HISTORY_PARTIAL).unlink(missing_ok=True)  # history.json holds it all now
        kept = list_checkpoints(output_dir)
        if kept:  # a run resumed at its end saved none, yet the limit holds when it finishes
            prune_checkpoints(output_dir, keep=kept[-1], limit=config.checkpoints_total_limit)
        if config.validation_prompt and config.num_validation_images:
            tracking.log_images(accelerator, steps, save_samples(run, output_dir / SAMPLES / "final"))
        if config.save_as_full_pipeline:
            with storage_errors(output_dir, "the full pipeline", discard=copied.folder):
                save_full_pipeline(run, output_dir, copied)
        elif (output_dir / MODEL_INDEX).exists():  # resumed without the flag: not this run's rows
            remove_full_pipeline(output_dir)
        write_json(output_dir / SUMMARY, summary)  # written last: marks a finished run
    # Teardown in a safe order: every collective's output dropped (above), every rank past the
    # barrier (no collective in flight), then the process group destroyed. Measured with torch
    # 2.13: once torch._dynamo is imported (any optimizer step does) gloo's threads outlive
    # destroy_process_group until the interpreter exits, so nothing may be left for them to free.
    accelerator.wait_for_everyone()
    faults.delay_in_collective_thread(accelerator.process_index)  # test-only: issue 11's exit race
    accelerator.end_training()  # destroys the process group (MPICH aborts a rank that skips it)
    return TrainResult(output_dir, learned_path, pipeline_dir, run.tokens, history, summary)

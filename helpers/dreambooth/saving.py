"""What a DreamBooth-LoRA run writes: its folder, checkpoints, resumption, samples and final outputs.

``output_dir`` holds, written by the main process only and each atomically:
``dreambooth_config.yaml`` (first), ``checkpoints/checkpoint-N/`` (accelerate's state and the LoRA
file), ``samples/``, ``history.json``, ``pytorch_lora_weights.safetensors``, optionally ``pipeline/``
(the LoRA fused in), and ``run_summary.json`` last: its presence means the run is complete.

The folder states, checkpoints (rotation, resume, settings check), strict JSON and the folder's
lock are the textual-inversion engine's (:mod:`helpers.training.engine.folder`,
:mod:`~helpers.training.engine.checkpoints`, :mod:`~helpers.training.engine.saving`), given
:data:`DREAMBOOTH`, this trainer's :class:`~helpers.training.engine.folder.RunLayout`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.logging import get_logger

from helpers.core.files import replace_dir_atomic, save_image_atomic
from helpers.core.outputs import CHECKPOINTS, HISTORY, HISTORY_PARTIAL, LOGS, PIPELINE_DIR, SAMPLES, SUMMARY
from helpers.dreambooth import class_images
from helpers.dreambooth.lora import (
    LORA_WEIGHTS,
    copy_lora_weights,
    read_lora_file,
    save_fused_pipeline,
    save_lora_weights,
)
from helpers.ranks import status
from helpers.training.engine import checkpoints, tracking
from helpers.training.engine.folder import RunLayout, clear_leftovers, clear_run
from helpers.training.engine.saving import storage_errors, write_json

if TYPE_CHECKING:
    from helpers.dreambooth.training import Run

logger = get_logger(__name__)

CONFIG_FILE = "dreambooth_config.yaml"

DREAMBOOTH = RunLayout(
    config_file=CONFIG_FILE,
    weights_file=LORA_WEIGHTS,
    files=(CONFIG_FILE, HISTORY, HISTORY_PARTIAL, LORA_WEIGHTS, SUMMARY),
    dirs=(CHECKPOINTS, SAMPLES, LOGS, PIPELINE_DIR),
    # the LoRA's shape (rank, which models) and what it started from: another value cannot resume
    identity=("seed", "pretrained_model_name_or_path", "rank", "train_text_encoder"),
)
"""What a DreamBooth-LoRA run writes into ``output_dir``, for the engine's folder and checkpoint functions."""


def lora_path(run: Run) -> Path:
    return run.output_dir / LORA_WEIGHTS


def pipeline_path(run: Run) -> Path | None:
    return run.output_dir / PIPELINE_DIR if run.config.save_as_full_pipeline else None


# --- start ---------------------------------------------------------------------------------------


def resume(run: Run, ckpt: Path | None) -> int:
    """Load the checkpoint (if any): the LoRA matrices, then accelerate's state (optimizer, schedule, RNG).

    Returns:
        The step training continues after (0: a fresh run).

    Raises:
        TrainingInputError: the checkpoint was saved past ``max_steps`` (which may come from
            ``num_train_epochs``), or a file in it cannot be loaded.
    """
    if ckpt is None:
        return 0
    checkpoints.check_not_past_the_end(ckpt, run.max_steps)
    state, _ = read_lora_file(ckpt / LORA_WEIGHTS)
    copy_lora_weights(state, run.unet, run.trained_text_encoder)
    checkpoints.load_state(run.accelerator, ckpt)
    step = checkpoints.checkpoint_step(ckpt)
    logger.info(f"resumed from {ckpt} at step {step}", main_process_only=True)
    return step


def prepare_output_dir(run: Run, start: int) -> list[dict]:
    """Make ``output_dir`` ready, as the textual-inversion engine does; return the history of steps 1..``start``.

    The main process removes what the settings replace (``overwrite_output_dir``: every file of an
    earlier run; always: temporaries of killed writes, and the summary of a run resumed after it
    finished, which is not finished again until its outputs are), then writes the settings.
    """
    config, output_dir = run.config, run.output_dir
    if run.accelerator.is_main_process:
        if config.overwrite_output_dir and not config.resume_from_checkpoint:
            clear_run(output_dir, DREAMBOOTH)
        else:
            clear_leftovers(output_dir, DREAMBOOTH)
        (output_dir / SUMMARY).unlink(missing_ok=True)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / CONFIG_FILE)
    run.accelerator.wait_for_everyone()
    return checkpoints.load_history(output_dir, start) if start else []


# --- during --------------------------------------------------------------------------------------


def save_checkpoint(run: Run, step: int, history: list[dict]) -> Path:
    """Save a resumable checkpoint ``checkpoints/checkpoint-N``: accelerate's state (optimizer,
    schedule, RNG), the LoRA file and the settings, complete before older ones beyond
    ``checkpoints_total_limit`` are removed (:func:`helpers.training.engine.checkpoints.save_checkpoint`).
    """
    main = run.accelerator.is_main_process
    status.beat("saving" if main else status.WAITING, step)
    return checkpoints.save_checkpoint(
        run.accelerator,
        run.config,
        run.output_dir,
        step,
        history,
        lambda folder: save_lora_weights(folder, run.unet, run.trained_text_encoder),
        config_file=CONFIG_FILE,
    )


def validate_on_main(run: Run, dest: Path, step: int) -> None:
    """Sample pictures on the main process while the others wait."""
    if run.accelerator.is_main_process:
        tracking.log_images(run.accelerator, step, validate(run, dest))
    else:
        status.beat(status.WAITING, step)  # rank 0 samples meanwhile
    run.accelerator.wait_for_everyone()


@torch.no_grad()
def validate(run: Run, dest: Path) -> list[Path]:
    """Pictures of ``validation_prompt`` with the LoRA as it is now (seeded by ``seed``), into ``dest``."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, StableDiffusionPipeline

    config = run.config
    modes = (run.unet.training, run.text_encoder.training)
    run.unet.eval()
    run.text_encoder.eval()
    try:
        pipe = StableDiffusionPipeline(
            vae=AutoencoderKL.from_pretrained(run.model_dir, subfolder="vae"),
            text_encoder=run.text_encoder, tokenizer=run.tokenizer, unet=run.unet,
            scheduler=DPMSolverMultistepScheduler.from_pretrained(run.model_dir, subfolder="scheduler"),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        with run.accelerator.autocast():  # the UNet may hold bf16 weights
            images = pipe([config.validation_prompt] * config.num_validation_images, num_inference_steps=25,
                          generator=torch.Generator().manual_seed(config.seed), height=config.resolution,
                          width=config.resolution, callback_on_step_end=class_images.beat_each_step).images  # fmt: skip
    finally:
        run.unet.train(modes[0])
        run.text_encoder.train(modes[1])

    def fill(folder: Path) -> None:
        for i, image in enumerate(images):
            save_image_atomic(folder / f"{i:02d}.png", image)

    replace_dir_atomic(dest, fill)
    return [dest / f"{i:02d}.png" for i in range(len(images))]


# --- end -----------------------------------------------------------------------------------------


def write_outputs(run: Run, global_step: int, history: list[dict]) -> dict[str, Any]:
    """Check the ranks agree, then (main process) the LoRA file, history, samples, fused pipeline, summary.

    Returns:
        The summary (empty on the other processes).
    """
    accelerator, config = run.accelerator, run.config
    flat = torch.cat([p.detach().reshape(-1) for p in run.params])
    gathered = accelerator.gather(flat[None])
    identical = bool(all(torch.equal(gathered[0], g) for g in gathered))
    del gathered  # a collective's output: gloo's thread must not be the one to free it at teardown
    status.beat("saving" if accelerator.is_main_process else status.WAITING, global_step)
    if not accelerator.is_main_process:
        return {}
    with storage_errors(lora_path(run), "the LoRA weights"):
        save_lora_weights(run.output_dir, run.unet, run.trained_text_encoder)
        write_json(run.output_dir / HISTORY, history)
    (run.output_dir / HISTORY_PARTIAL).unlink(missing_ok=True)  # history.json holds it all now
    kept = checkpoints.list_checkpoints(run.output_dir)
    if kept:  # a run resumed at its end saved none, yet the limit holds when it finishes
        checkpoints.prune_checkpoints(run.output_dir, keep=kept[-1], limit=config.checkpoints_total_limit)
    if config.validation_prompt and config.num_validation_images:
        tracking.log_images(accelerator, global_step, validate(run, run.output_dir / SAMPLES / "final"))
    if config.save_as_full_pipeline:
        with storage_errors(pipeline_path(run), "the fused pipeline"):
            save_fused_pipeline(run.model_dir, lora_path(run), pipeline_path(run))
    timed = [h["seconds"] for h in history[1:]] or [h["seconds"] for h in history]  # step 1 includes warm-up
    seconds_per_step = sum(timed) / max(len(timed), 1)
    pictures = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    made = run.class_images
    summary = {
        "world_size": accelerator.num_processes,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "steps": global_step,
        "final_loss": history[-1]["loss"] if history else None,
        "seconds_per_step": seconds_per_step,
        "training_seconds": sum(h["seconds"] for h in history),
        "images_per_second": pictures * (2 if run.prior else 1) / seconds_per_step if seconds_per_step else None,
        "wall_seconds": time.perf_counter() - run.started,
        "precision": run.precision.mixed_precision,
        "precision_reason": run.precision.reason,
        "rank": config.rank,
        "train_text_encoder": config.train_text_encoder,
        "prepacked_convs": run.prepacked_convs,
        "with_prior_preservation": run.prior,
        "class_images": None if made is None else {
            "existing": made.existing, "generated": made.generated, "seconds": round(made.seconds, 2)},
        "trainable_parameters": sum(p.numel() for p in run.params),
        "lora_weights_bytes": lora_path(run).stat().st_size,
        "allreduce_bytes_per_step": run.averager.bytes // max(run.averager.calls, 1),
        "allreduce_calls": run.averager.calls,  # one per optimizer step, none per accumulated micro-batch
        # what DDP would all-reduce per step if the whole UNet were trained (fp32)
        "full_unet_allreduce_bytes_per_step": sum(
            p.numel() * 4 for n, p in run.unet.named_parameters() if ".lora_" not in n),
        "lora_identical_across_ranks": identical,
        "threads_per_process": torch.get_num_threads(),
    }  # fmt: skip
    write_json(run.output_dir / SUMMARY, summary)  # last: marks a finished run
    return summary

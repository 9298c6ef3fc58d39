"""What a DreamBooth-LoRA run writes: its folder, checkpoints, resumption, samples and final outputs.

``output_dir`` holds, written by the main process only and each atomically:
``dreambooth_config.yaml`` (first), ``checkpoints/checkpoint-N/`` (accelerate's state and the LoRA
file), ``samples/``, ``history.json``, ``pytorch_lora_weights.safetensors``, optionally ``pipeline/``
(the LoRA fused in), and ``run_summary.json`` last: its presence means the run is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.logging import get_logger

from helpers.core.files import move_dir_into_place, replace_dir_atomic, save_image_atomic, write_text_atomic
from helpers.core.outputs import CHECKPOINTS, HISTORY, HISTORY_PARTIAL, PIPELINE_DIR, SAMPLES, SUMMARY
from helpers.dreambooth import class_images
from helpers.dreambooth.lora import LORA_WEIGHTS, copy_lora_weights, read_lora_file, save_lora_weights
from helpers.launching import supervise
from helpers.training.engine.checkpoints import load_state, resolve_checkpoint

if TYPE_CHECKING:
    from helpers.dreambooth.training import Run

logger = get_logger(__name__)

CONFIG_FILE = "dreambooth_config.yaml"


def lora_path(run: Run) -> Path:
    return run.output_dir / LORA_WEIGHTS


def pipeline_path(run: Run) -> Path | None:
    return run.output_dir / PIPELINE_DIR if run.config.save_as_full_pipeline else None


# --- start ---------------------------------------------------------------------------------------


def resume(run: Run) -> tuple[int, list[dict]]:
    """Load a checkpoint if asked: the LoRA matrices, then accelerate's state (optimizer, schedule, RNG).

    Returns:
        The step to continue from (0 for a fresh run) and the history up to it.
    """
    if not run.config.resume_from_checkpoint:
        return 0, []
    ckpt = resolve_checkpoint(run.output_dir, run.config.resume_from_checkpoint)
    state, _ = read_lora_file(ckpt / LORA_WEIGHTS)
    copy_lora_weights(state, run.unet, run.trained_text_encoder)
    load_state(run.accelerator, ckpt)
    step = int(ckpt.name.split("-")[1])
    logger.info(f"resumed from {ckpt} at step {step}", main_process_only=True)
    return step, _load_history(run.output_dir, step)


def _load_history(output_dir: Path, upto_step: int) -> list[dict]:
    source = output_dir / HISTORY_PARTIAL
    source = source if source.exists() else output_dir / HISTORY
    if not source.exists():
        return []
    return [h for h in json.loads(source.read_text()) if h["step"] <= upto_step]


def prepare_output_dir(run: Run) -> None:
    """Create ``output_dir`` (clearing an earlier run's files with ``overwrite_output_dir``), write the settings."""
    if run.accelerator.is_main_process:
        if run.config.overwrite_output_dir and not run.config.resume_from_checkpoint:
            clear_previous_run(run.output_dir)
        run.output_dir.mkdir(parents=True, exist_ok=True)
        run.config.to_yaml(run.output_dir / CONFIG_FILE)
    run.accelerator.wait_for_everyone()


def clear_previous_run(output_dir: Path) -> None:
    """Remove what an earlier run wrote (only this trainer's own files, nothing else in the folder)."""
    for name in (CHECKPOINTS, SAMPLES, PIPELINE_DIR):
        shutil.rmtree(output_dir / name, ignore_errors=True)
    for name in (LORA_WEIGHTS, HISTORY, HISTORY_PARTIAL, SUMMARY, CONFIG_FILE):
        (output_dir / name).unlink(missing_ok=True)


# --- during --------------------------------------------------------------------------------------


def checkpoints(output_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    found = [p for p in (output_dir / CHECKPOINTS).glob("checkpoint-*") if p.name.split("-", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(run: Run, step: int, history: list[dict]) -> Path:
    """Save a resumable checkpoint: accelerate's state (optimizer, schedule, RNG) and the LoRA file.

    Every process writes its part into one hidden folder, which the main process then moves into
    place as ``checkpoints/checkpoint-N``, after pruning the oldest beyond ``checkpoints_total_limit``.
    """
    accelerator, config = run.accelerator, run.config
    final = run.output_dir / CHECKPOINTS / f"checkpoint-{step}"
    tmp = final.with_name(f".{final.name}.tmp")
    supervise.beat("saving" if accelerator.is_main_process else supervise.WAITING, step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        if config.checkpoints_total_limit:
            existing = checkpoints(run.output_dir)
            for old in existing[: max(0, len(existing) - config.checkpoints_total_limit + 1)]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        save_lora_weights(tmp, run.unet, run.trained_text_encoder)
        write_text_atomic(run.output_dir / HISTORY_PARTIAL, json.dumps(history, indent=2))
        move_dir_into_place(tmp, final)
    accelerator.wait_for_everyone()
    return final


def validate_on_main(run: Run, dest: Path, step: int) -> None:
    """Sample pictures on the main process while the others wait."""
    if run.accelerator.is_main_process:
        validate(run, dest)
    else:
        supervise.beat(supervise.WAITING, step)  # rank 0 samples meanwhile
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
    import time

    accelerator, config = run.accelerator, run.config
    flat = torch.cat([p.detach().reshape(-1) for p in run.params])
    gathered = accelerator.gather(flat[None])
    identical = bool(all(torch.equal(gathered[0], g) for g in gathered))
    del gathered  # a collective's output: gloo's thread must not be the one to free it at teardown
    supervise.beat("saving" if accelerator.is_main_process else supervise.WAITING, global_step)
    if not accelerator.is_main_process:
        return {}
    save_lora_weights(run.output_dir, run.unet, run.trained_text_encoder)
    write_text_atomic(run.output_dir / HISTORY, json.dumps(history, indent=2))
    (run.output_dir / HISTORY_PARTIAL).unlink(missing_ok=True)  # history.json holds it all now
    if config.validation_prompt and config.num_validation_images:
        validate(run, run.output_dir / SAMPLES / "final")
    if config.save_as_full_pipeline:
        from helpers.dreambooth.lora import save_fused_pipeline

        save_fused_pipeline(run.model_dir, lora_path(run), pipeline_path(run))
    timed = [h["seconds"] for h in history[1:]] or [h["seconds"] for h in history]  # step 1 includes warm-up
    seconds_per_step = sum(timed) / max(len(timed), 1)
    pictures = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    made = run.class_images
    summary = {
        "world_size": accelerator.num_processes,
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
    write_text_atomic(run.output_dir / SUMMARY, json.dumps(summary, indent=2))  # last: marks a finished run
    return summary

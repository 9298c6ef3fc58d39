"""What a DreamBooth-LoRA run writes: its folder layout, the LoRA file, samples, the fused pipeline.

``output_dir`` holds, written by the main process only and each atomically:
``dreambooth_config.yaml`` (first), ``checkpoints/checkpoint-N/`` (accelerate's state and the LoRA
file), ``samples/``, ``history.json``, ``pytorch_lora_weights.safetensors``, optionally ``pipeline/``
(the LoRA fused in), and ``run_summary.json`` last: its presence means the run is complete.

The folder states, its lock, checkpoints (rotation, resume, settings check) and the order of
the final writes are the run loop's (:mod:`helpers.training.engine.loop`), given :data:`DREAMBOOTH`,
this method's :class:`~helpers.training.engine.folder.RunLayout`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.logging import get_logger

from helpers.core.outputs import CHECKPOINTS, HISTORY, HISTORY_PARTIAL, LOGS, PIPELINE_DIR, SAMPLES, SUMMARY
from helpers.dreambooth.lora import (
    KOHYA_WEIGHTS,
    LORA_WEIGHTS,
    copy_lora_weights,
    read_lora_file,
    save_fused_pipeline,
    save_kohya,
    save_lora_weights,
)
from helpers.ranks import status
from helpers.training.engine import tracking
from helpers.training.engine.folder import RunLayout
from helpers.training.engine.saving import draw_samples, storage_errors

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


def write_weights(run: Run, folder: Path) -> None:
    """The LoRA file (``pytorch_lora_weights.safetensors``) into ``folder``: a checkpoint's or ``output_dir``."""
    save_lora_weights(folder, run.unet, run.trained_text_encoder, run.trained_text_encoder_2)


def load_lora_checkpoint(run: Run, ckpt: Path) -> None:
    """Load a checkpoint's LoRA matrices into the run (accelerate's state, loaded next, holds the rest).

    Raises:
        TrainingInputError: the LoRA file cannot be read.
    """
    state, _ = read_lora_file(ckpt / LORA_WEIGHTS)
    copy_lora_weights(state, run.unet, run.trained_text_encoder, run.trained_text_encoder_2)


# --- during --------------------------------------------------------------------------------------


def validate_on_main(run: Run, dest: Path, step: int) -> None:
    """Sample pictures on the main process while the others wait."""
    if run.accelerator.is_main_process:
        tracking.log_images(run.accelerator, step, validate(run, dest))
    else:
        status.beat(status.WAITING, step)  # rank 0 samples meanwhile
    run.accelerator.wait_for_everyone()


def validate(run: Run, dest: Path) -> list[Path]:
    """Pictures of ``validation_prompt`` with the LoRA as it is now (seeded by ``seed``), into ``dest``."""
    return draw_samples(run, dest, size=run.config.resolution)


# --- end -----------------------------------------------------------------------------------------


def write_outputs(run: Run, steps: int) -> None:
    """Main process, after the LoRA file and the history: the kohya file, the final samples, then
    the fused pipeline."""
    config = run.config
    if config.output_kohya_format:  # A1111 / ComfyUI's layout, beside diffusers' file
        with storage_errors(run.output_dir / KOHYA_WEIGHTS, "the kohya LoRA weights"):
            save_kohya(run.unet, run.output_dir, run.trained_text_encoder, run.trained_text_encoder_2)
    if config.validation_prompt and config.num_validation_images:
        tracking.log_images(run.accelerator, steps, validate(run, run.output_dir / SAMPLES / "final"))
    if config.save_as_full_pipeline:
        with storage_errors(pipeline_path(run), "the fused pipeline"):
            save_fused_pipeline(run.model_dir, lora_path(run), pipeline_path(run))


def summary_extras(run: Run) -> dict[str, Any]:
    """What ``run_summary.json`` says of a DreamBooth-LoRA run besides what every run's says."""
    config, made = run.config, run.class_images
    return {
        "wall_seconds": time.perf_counter() - run.started,
        "rank": config.rank,
        "train_text_encoder": config.train_text_encoder,
        "prepacked_convs": run.prepacked_convs,
        "with_prior_preservation": run.prior,
        "class_images": None if made is None else {
            "existing": made.existing, "generated": made.generated, "seconds": round(made.seconds, 2)},
        "trainable_parameters": sum(p.numel() for p in run.params),
        "lora_weights_bytes": lora_path(run).stat().st_size,
        # what DDP would all-reduce per step if the whole UNet were trained (fp32)
        "full_unet_allreduce_bytes_per_step": sum(
            p.numel() * 4 for n, p in run.unet.named_parameters() if ".lora_" not in n),
    }  # fmt: skip

"""What a run writes besides checkpoints: learned embeddings, JSON records, validation samples, the full pipeline."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from helpers import files, supervise
from helpers.engine.rows import write_rows
from helpers.outputs import MODEL_INDEX, PIPELINE_PARTS

if TYPE_CHECKING:
    from helpers.engine.setup import Run


def save_learned_embeds(path: str | os.PathLike, placeholder_token: str, vectors: torch.Tensor) -> Path:
    """Write ``{placeholder_token: [num_vectors, hidden]}``, the format ``load_textual_inversion`` reads.

    Atomically (:func:`helpers.files.write_path_atomic`): the file is complete or absent.
    """
    state = {placeholder_token: vectors.detach().float().cpu().contiguous()}
    return files.write_path_atomic(path, lambda tmp: save_file(state, str(tmp)))


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """Write ``value`` as strict JSON (no NaN or Infinity, which other readers reject), atomically.

    Raises:
        ValueError: ``value`` holds a non-finite float (a bug: a diverged run stops before writing).
    """
    return files.write_text_atomic(path, json.dumps(value, indent=2, allow_nan=False))


def _sampling_pipeline(run: Run):
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=AutoencoderKL.from_pretrained(run.model_dir, subfolder="vae"),
        text_encoder=run.text_encoder,
        tokenizer=run.tokenizer,
        unet=run.unet,
        scheduler=DPMSolverMultistepScheduler.from_pretrained(run.model_dir, subfolder="scheduler"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


@torch.no_grad()
def save_samples(run: Run, dest: Path) -> list[Path]:
    """Generate validation images with the current embedding into ``dest`` (main process only)."""
    config, unet, text_encoder = run.config, run.unet, run.text_encoder
    write_rows(text_encoder, run.token_ids, run.vectors)
    learned = run.hook.learned
    run.hook.learned = lambda ids, out: out  # the rows are in the matrix now
    was_training = (unet.training, text_encoder.training)
    unet.eval()
    text_encoder.eval()
    try:
        pipe = _sampling_pipeline(run)
        pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator().manual_seed(config.seed)
        prompts = [config.validation_prompt] * config.num_validation_images
        with run.accelerator.autocast():  # the UNet may hold bf16 weights
            images = pipe(prompts, num_inference_steps=25, generator=gen, callback_on_step_end=_beat).images
    finally:
        unet.train(was_training[0])
        text_encoder.train(was_training[1])
        run.hook.learned = learned
    names = [f"{i:02d}.png" for i in range(len(images))]

    def fill(folder: Path) -> None:
        for name, image in zip(names, images, strict=True):
            image.save(folder / name)

    files.replace_dir_atomic(dest, fill)
    return [dest / name for name in names]


def _beat(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
    """Sampling can outlast helpers.launch's stall limit: each denoising step counts as progress."""
    supervise.beat("validating", step)
    return callback_kwargs


def save_full_pipeline(run: Run, output_dir: Path) -> Path:
    """Save the complete diffusers pipeline into ``output_dir`` itself, as diffusers' script does.

    ``output_dir`` then holds ``model_index.json``, ``text_encoder/``, ``tokenizer/`` (both with the
    placeholder tokens), ``unet/``, ``vae/`` and ``scheduler/`` beside ``learned_embeds.safetensors``,
    so ``StableDiffusionPipeline.from_pretrained(output_dir)`` (and optimum-intel's export) load it.

    Complete or absent: the pipeline is saved into a hidden folder inside ``output_dir``, any old
    ``model_index.json`` is removed, each component folder is moved in
    (:func:`helpers.files.move_dir_into_place`) and ``model_index.json`` is written last. A crash
    leaves no ``model_index.json``; the next run removes the half-moved parts
    (:func:`helpers.engine.folder.clear_leftovers`). Main process only.
    """
    from diffusers import StableDiffusionPipeline

    write_rows(run.text_encoder, run.token_ids, run.vectors)
    # Training never changes the UNet: reuse it unless it was cast to bf16, then load the original.
    unet = {"unet": run.unet} if run.unet.dtype == torch.float32 else {}
    base = StableDiffusionPipeline.from_pretrained(
        run.model_dir,
        text_encoder=run.text_encoder,
        tokenizer=run.tokenizer,
        safety_checker=None,
        requires_safety_checker=False,
        **unet,
    )
    output_dir = Path(output_dir)
    (output_dir / MODEL_INDEX).unlink(missing_ok=True)  # not a whole pipeline until the new one is in
    tmp = output_dir / f".pipeline.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    tmp.mkdir(parents=True)
    try:
        base.save_pretrained(tmp, safe_serialization=True)
        for part in sorted(tmp.iterdir()):
            if part.is_dir():
                files.move_dir_into_place(part, output_dir / part.name)
            elif part.name != MODEL_INDEX:
                files.write_bytes_atomic(output_dir / part.name, part.read_bytes())
        files.write_bytes_atomic(output_dir / MODEL_INDEX, (tmp / MODEL_INDEX).read_bytes())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


def remove_full_pipeline(output_dir: Path) -> None:
    """Remove a pipeline saved into ``output_dir`` (``model_index.json`` first, then its parts)."""
    output_dir = Path(output_dir)
    (output_dir / MODEL_INDEX).unlink(missing_ok=True)
    for name in PIPELINE_PARTS:
        shutil.rmtree(output_dir / name, ignore_errors=True)

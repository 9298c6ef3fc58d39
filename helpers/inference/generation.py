"""Generating images the same way on every backend, timing them, saving them."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from helpers.core import cpu
from helpers.core.files import save_image_atomic
from helpers.inference.common import InferenceInputError, is_openvino

if TYPE_CHECKING:
    from PIL import Image


@dataclass
class Generation:
    """Images of one :func:`generate` call and how long they took."""

    images: list[Image.Image]
    seconds_per_image: float
    seconds: list[float] = field(default_factory=list)
    num_images: int = 0


def initial_latents(
    pipe: Any, num_images: int, height: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Generator]:
    """The starting noise for ``num_images`` images, identical for every backend given ``seed``.

    Returns:
        The fp32 latents and the CPU generator that drew them (pass it on for scheduler noise).
    """
    generator = torch.Generator("cpu").manual_seed(seed)
    scale = pipe.vae_scale_factor
    shape = (num_images, pipe.unet.config.in_channels, height // scale, width // scale)
    return torch.randn(shape, generator=generator, dtype=torch.float32), generator


def _image_size(pipe: Any, height: int | None, width: int | None) -> tuple[int, int]:
    if is_openvino(pipe) and not pipe.is_dynamic:
        static = (pipe.height, pipe.width)
        if (height or static[0], width or static[1]) != static:
            raise InferenceInputError(
                f"height={height}, width={width}: this OpenVINO pipeline is static at "
                f"{static[0]}x{static[1]}. "
                f"Fix: generate at that size or call reshape_static again."
            )
        return static
    default = pipe.unet.config.sample_size * pipe.vae_scale_factor
    return height or default, width or default


def generate(
    pipe: Any,
    prompts: str | Sequence[str],
    num_inference_steps: int = 20,
    guidance_scale: float = 7.5,
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
    num_images_per_prompt: int = 1,
    warmup: bool = True,
    repeats: int = 1,
    progress_bar: bool = False,
) -> Generation:
    """Generate images and time them, the same way for PyTorch and OpenVINO pipelines.

    Args:
        pipe: a PyTorch or OpenVINO Stable Diffusion pipeline.
        prompts: one prompt or a batch of prompts (a placeholder token expands to all its vectors).
        num_inference_steps: denoising steps.
        guidance_scale: classifier-free guidance strength.
        seed: seed of the initial latents (see :func:`initial_latents`).
        height: image height in pixels (default: the static size, else the model's native size).
        width: image width in pixels (same default).
        num_images_per_prompt: images per prompt.
        warmup: run one 1-step call first, untimed (OpenVINO compiles lazily; caches warm up).
        repeats: timed runs; the median is reported (every run gives the same images).
        progress_bar: show diffusers' per-step progress bar.

    Returns:
        The images of the last run and the median seconds per image.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    height, width = _image_size(pipe, height, width)
    num_images = len(prompts) * num_images_per_prompt
    if is_openvino(pipe) and not pipe.is_dynamic:
        expected = pipe.batch_size // 2  # static UNet batch = 2 x images (guidance doubles it)
        if guidance_scale <= 1 or expected != num_images:
            raise InferenceInputError(
                f"{len(prompts)} prompt(s) x {num_images_per_prompt} image(s) "
                f"with guidance_scale={guidance_scale}: "
                f"this static pipeline takes {expected} image(s) per call with guidance_scale > 1. "
                f"Fix: call reshape_static(pipe, batch_size={len(prompts)}, ...) or use a dynamic pipeline."
            )
    pipe.set_progress_bar_config(disable=not progress_bar)
    call = dict(
        prompt=prompts,
        height=height,
        width=width,
        guidance_scale=guidance_scale,
        num_images_per_prompt=num_images_per_prompt,
        output_type="pil",
    )

    # An OpenVINO pipeline computes in OpenVINO's threads; PyTorch only runs the scheduler's small
    # element-wise ops between the UNet calls. On more threads, PyTorch's OpenMP workers spin-wait
    # after each op on the cores OpenVINO computes on (the cost: docs/performance.md, inference).
    # The ops are element-wise, so the images are the same on any thread count.
    threads = 1 if is_openvino(pipe) else torch.get_num_threads()

    def run(steps: int) -> list:
        latents, generator = initial_latents(pipe, num_images, height, width, seed)
        with torch.inference_mode(), cpu.torch_threads(threads):
            return pipe(num_inference_steps=steps, latents=latents, generator=generator, **call).images

    if warmup:
        run(1)
    seconds, images = [], []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        images = run(num_inference_steps)
        seconds.append(time.perf_counter() - start)
    return Generation(images, statistics.median(seconds) / num_images, seconds, num_images)


def save_images(images: Sequence[Any], out_dir: str | os.PathLike, prefix: str) -> list[Path]:
    """Save images as ``out_dir/{prefix}-00.png``, ..., each atomically (:func:`helpers.core.files.save_image_atomic`)."""
    out = Path(out_dir)
    return [save_image_atomic(out / f"{prefix}-{i:02d}.png", image) for i, image in enumerate(images)]


def timing_rows(seconds_per_image: dict[str, float], baseline: str = "pytorch_fp32") -> list[dict[str, Any]]:
    """Rows for a timing table: variant, seconds per image, speed-up over ``baseline`` (x faster)."""
    base = seconds_per_image.get(baseline)
    return [
        {
            "variant": name,
            "s/image": value,
            f"speed-up vs {baseline}": f"{base / value:.2f}x" if base else "n/a",
        }
        for name, value in seconds_per_image.items()
    ]

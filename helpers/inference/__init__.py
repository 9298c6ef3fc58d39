"""Inference of the learned concept with PyTorch and OpenVINO: export, static shapes, parity, timing.

The concept reaches a pipeline by one of two routes, both supported and tested:

* the full fine-tuned pipeline that training writes with ``--save_as_full_pipeline`` into
  ``output_dir`` itself (as diffusers' script does): its tokenizer and text encoder already hold
  the placeholder token;
* the base model plus ``output_dir/learned_embeds.safetensors``, loaded afterwards with
  ``load_textual_inversion`` (diffusers' for PyTorch, optimum-intel's for OpenVINO).

Both model families (:mod:`helpers.training.families`, read from ``model_index.json``) take both
routes: Stable Diffusion v1/v2 (``StableDiffusionPipeline``, ``OVStableDiffusionPipeline``) and
Stable Diffusion XL (``StableDiffusionXLPipeline``, ``OVStableDiffusionXLPipeline``). An SDXL
concept is two files, one per text encoder: ``learned_embeds.safetensors`` goes into
``text_encoder`` and ``learned_embeds_2.safetensors``, beside it, into ``text_encoder_2`` (the same
``load_textual_inversion`` with ``text_encoder=`` and ``tokenizer=``, in PyTorch and in
optimum-intel). A second file missing beside the first for an SDXL model, or present for an SD v1
model (the first encoders of SD v1.5 and SDXL are both 768 wide, so the width cannot tell), is one
line before any model loads. Tested on ``"tiny-xl"``: each OpenVINO text encoder, the second
included, gives PyTorch's output for a prompt with the learned token, and so does what the
pipeline feeds its UNet (both penultimate states, the second's pooled output); int8 weights keep
the concept; the images match PyTorch's (:func:`compare`). What is not supported for SDXL: the
single-file ``{"clip_l": ..., "clip_g": ...}`` embeddings of diffusers' advanced SDXL DreamBooth
script (refused as a file of two tensors: pass the two files a textual-inversion run writes), a
second concept in one OpenVINO pipeline and loading into int8 text encoders (as for SD v1, below),
and the SDXL refiner or other families (one line naming the supported ones). ``quant_mode="int8"``
runs on ``"tiny-xl"`` but is measured for SD v1 only.

Runs are comparable across backends: :func:`generate` gives every pipeline the same initial
latents (drawn from a CPU ``torch.Generator`` seeded with ``seed``, the same generator then
feeds any scheduler noise), the scheduler is the one exported with the model (same class and
config, checked by :func:`compare`), and the prompts are identical. What differs is the backend.

Three optimum-intel 2.2 pitfalls are handled here (found on the tiny pipeline, see the tests):

* ``load_textual_inversion`` on an OpenVINO pipeline a second time re-wires the original
  embedding table and silently gives the earlier tokens the wrong vectors: a second load is refused;
* after int8 weight compression the embedding table is uint8 and ``load_textual_inversion`` fails
  with an obscure graph error: embeddings are inserted first, then weights are compressed (and a
  load into a compressed text encoder is refused with a clear message);
* ``reshape()`` sizes the static VAE decoder by ``num_images_per_prompt`` alone, so a static batch
  of several prompts fails: :func:`reshape_static` sizes it by ``batch_size * num_images_per_prompt``.

And one of OpenVINO 2026.4's CPU plugin: a UNet with int8 weights whose mid-block is 1x1 (the tiny
pipeline at 64 px; SD v1.5 at 64 px) fails to compile with static shapes. Use 128 px or more there.

PyTorch and OpenVINO share the cores: while an OpenVINO pipeline generates, PyTorch still runs the
scheduler's element-wise ops between UNet calls, and its OpenMP workers then spin-wait on the cores
OpenVINO computes on. :func:`generate` runs PyTorch on one thread meanwhile (same images).

``export_openvino(quant_mode="int8")`` (the UNet and the VAE decoder computing in int8) records its
calibration data itself instead of letting optimum-intel do it: optimum-intel generates 50-step
images at the model's own size (512 px for SD v1.5, whatever size you will generate at), where this
records 10-step images at the size you give. It keeps a few layers in floating point
(:data:`~helpers.inference.openvino.FLOAT_LAYERS`: the residual shortcut convolutions, whose
uneven inputs one int8 scale fits badly, and layers with almost no work).

The parts: :mod:`~helpers.inference.concept` (where the concept is, checked before any work),
:mod:`~helpers.inference.pytorch` and :mod:`~helpers.inference.openvino` (the two backends),
:mod:`~helpers.inference.generation` (same latents, timing, saving), :mod:`~helpers.inference.parity`
(OpenVINO against PyTorch), :mod:`~helpers.inference.command` (the CLI), and
:mod:`~helpers.inference.common` (the error, tolerances, variant names). What notebooks and scripts
use is re-exported here: ``from helpers import inference; inference.generate(...)``.
"""

from helpers.inference.command import cli, main, parse_args
from helpers.inference.common import (
    BF16_VARIANT,
    IMAGE_PSNR_MIN_DB,
    PSNR_IDENTICAL_DB,
    QUANT_VARIANT,
    TEXT_ENCODER_ATOL,
    VARIANTS,
    InferenceInputError,
)
from helpers.inference.concept import (
    check_concept,
    find_concept,
    first_finished_run,
    learned_embeds_files,
    read_learned_embeds,
)
from helpers.inference.generation import generate, save_images, timing_rows
from helpers.inference.openvino import (
    CALIBRATION_SAMPLES,
    disk_megabytes,
    export_info,
    export_openvino,
    load_openvino_pipeline,
    openvino_default_precision,
    reshape_static,
)
from helpers.inference.parity import (
    compare,
    image_max_abs_diff,
    image_psnr,
    prompt_ids,
    text_embeddings,
    text_encoder_max_abs_diff,
)
from helpers.inference.pytorch import load_learned_embeds, load_pytorch_pipeline

__all__ = [
    "BF16_VARIANT",
    "CALIBRATION_SAMPLES",
    "IMAGE_PSNR_MIN_DB",
    "PSNR_IDENTICAL_DB",
    "QUANT_VARIANT",
    "TEXT_ENCODER_ATOL",
    "VARIANTS",
    "InferenceInputError",
    "check_concept",
    "cli",
    "compare",
    "disk_megabytes",
    "export_info",
    "export_openvino",
    "find_concept",
    "first_finished_run",
    "generate",
    "image_max_abs_diff",
    "image_psnr",
    "learned_embeds_files",
    "load_learned_embeds",
    "load_openvino_pipeline",
    "load_pytorch_pipeline",
    "main",
    "openvino_default_precision",
    "parse_args",
    "prompt_ids",
    "read_learned_embeds",
    "reshape_static",
    "save_images",
    "text_embeddings",
    "text_encoder_max_abs_diff",
    "timing_rows",
]

"""Inference of the learned concept with PyTorch and OpenVINO: export, static shapes, parity, timing.

The concept reaches a pipeline by one of two routes, both supported and tested:

* the full fine-tuned folder that training writes with ``--save_as_full_pipeline``
  (``output_dir/pipeline``): its tokenizer and text encoder already hold the placeholder token;
* the base model plus ``output_dir/learned_embeds.safetensors``, loaded afterwards with
  ``load_textual_inversion`` (diffusers' for PyTorch, optimum-intel's for OpenVINO).

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
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from helpers.models import OFFLINE_MODELS, TINY, TOYWORLD, resolve_model
from helpers.textual_inversion import LEARNED_EMBEDS, placeholder_tokens_for

if TYPE_CHECKING:
    from PIL import Image

logger = logging.getLogger(__name__)

VARIANTS = ("pytorch_fp32", "openvino_dynamic", "openvino_static", "openvino_static_int8")
"""The variants timed on every CPU; where :func:`openvino_default_precision` is bf16, also this one:"""
BF16_VARIANT = "openvino_static_bf16"
WEIGHT_FORMATS = ("fp32", "int8")
ROUTES = ("auto", "pipeline", "embeddings")
TEXT_ENCODER_ATOL = 1e-4
"""Max abs difference allowed between OpenVINO fp32 and PyTorch text-encoder outputs (measured ~1e-6)."""
IMAGE_PSNR_MIN_DB = 40.0
"""Min PSNR (dB, uint8 images) of OpenVINO fp32 against PyTorch with the same latents (measured 60-75 dB)."""
PSNR_IDENTICAL_DB = 100.0
"""PSNR reported for identical images (the true value is infinite, which JSON cannot hold)."""
EXPORT_INFO = "export_info.json"
_TI_NODE_MARK = ".textual_inversion_"  # optimum-intel names the inserted concat nodes with this


class InferenceInputError(ValueError):
    """An input of inference or export is unusable; the message names it and the fix."""


@dataclass(frozen=True)
class ConceptSource:
    """Where a learned concept comes from.

    Attributes:
        model: a diffusers folder (the fine-tuned pipeline, or the base model), ``"tiny"`` or a Hub id.
        learned_embeds: embeddings to load on top of ``model``, or None when ``model`` already has them.
        placeholder_token: the token the concept was learned as.
        route: ``"pipeline"`` or ``"embeddings"``.
    """

    model: str
    learned_embeds: str | None
    placeholder_token: str
    route: str


@dataclass
class Generation:
    """Images of one :func:`generate` call and how long they took."""

    images: list[Image.Image]
    seconds_per_image: float
    seconds: list[float] = field(default_factory=list)
    num_images: int = 0


@dataclass
class Parity:
    """How close an OpenVINO pipeline is to PyTorch for one prompt, seed and scheduler."""

    text_encoder_max_abs_diff: float
    image_psnr: float
    image_max_abs_diff: int

    @property
    def ok(self) -> bool:
        """True when both numbers are within the stated tolerances."""
        return self.text_encoder_max_abs_diff < TEXT_ENCODER_ATOL and self.image_psnr > IMAGE_PSNR_MIN_DB


# --- inputs ------------------------------------------------------------------------------------


def find_concept(
    trained_output_dir: str | os.PathLike, base_model: str, placeholder_token: str, route: str = "auto"
) -> ConceptSource:
    """Locate what training wrote: the full fine-tuned pipeline, or base model + learned embeddings.

    Args:
        trained_output_dir: the training ``output_dir``.
        base_model: the model the concept was trained on (used by the ``"embeddings"`` route).
        placeholder_token: the token the concept was learned as.
        route: ``"pipeline"`` (``output_dir/pipeline``), ``"embeddings"`` (base model +
            ``learned_embeds.safetensors``) or ``"auto"`` (the pipeline if it was saved).

    Raises:
        FileNotFoundError: the output folder or the file the route needs is missing.
    """
    if route not in ROUTES:
        raise InferenceInputError(f"route={route!r}: must be one of {', '.join(ROUTES)}")
    out = Path(trained_output_dir)
    if not out.is_dir():
        raise FileNotFoundError(
            f"trained_output_dir {str(out)!r} does not exist. Fix: train first (notebook 02 or "
            f"`python -m helpers.train --output_dir {out}`), or point trained_output_dir at its output_dir."
        )
    pipeline_dir, embeds = out / "pipeline", out / LEARNED_EMBEDS
    if route == "auto":
        route = "pipeline" if (pipeline_dir / "model_index.json").is_file() else "embeddings"
    if route == "pipeline":
        if not (pipeline_dir / "model_index.json").is_file():
            raise FileNotFoundError(
                f"{pipeline_dir} is not a diffusers pipeline folder. Fix: train with "
                f"--save_as_full_pipeline, or use route='embeddings' (base model + {LEARNED_EMBEDS})."
            )
        return ConceptSource(str(pipeline_dir), None, placeholder_token, route)
    if not embeds.is_file():
        raise FileNotFoundError(
            f"{embeds} does not exist. Fix: let training finish; it writes {LEARNED_EMBEDS}."
        )
    return ConceptSource(base_model, str(embeds), placeholder_token, route)


def read_learned_embeds(path: str | os.PathLike) -> tuple[str, torch.Tensor]:
    """Read ``{token: FloatTensor[num_vectors, hidden]}`` from a file or a training output folder.

    Returns:
        The token stored in the file and its vectors, always 2-D ``[num_vectors, hidden]``.

    Raises:
        FileNotFoundError: no such file (or no ``learned_embeds.safetensors`` in the folder).
        InferenceInputError: not a single-token safetensors embedding file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / LEARNED_EMBEDS
    if not path.is_file():
        raise FileNotFoundError(
            f"learned_embeds {str(path)!r} does not exist. Fix: pass the {LEARNED_EMBEDS} that training "
            f"wrote (or its output_dir)."
        )
    if path.suffix != ".safetensors":
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: expected a .safetensors file like {LEARNED_EMBEDS}"
        )
    state = load_file(str(path))
    if len(state) != 1:
        raise InferenceInputError(
            f"learned_embeds {str(path)!r} holds {len(state)} tensors ({', '.join(state)}); expected one "
            f"{{placeholder_token: [num_vectors, hidden]}}. "
            f"Fix: pass the {LEARNED_EMBEDS} that training wrote."
        )
    token, vectors = next(iter(state.items()))
    vectors = vectors[None] if vectors.ndim == 1 else vectors
    if vectors.ndim != 2:
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: tensor shape {tuple(vectors.shape)} is not 2-D"
        )
    return token, vectors.float()


def _check_embeds(
    tokenizer, hidden_size: int, learned_embeds, placeholder_token: str | None, where: str
) -> list[str]:
    file_token, vectors = read_learned_embeds(learned_embeds)
    if vectors.shape[1] != hidden_size:
        raise InferenceInputError(
            f"learned_embeds {str(learned_embeds)!r} has vectors of width {vectors.shape[1]}, but the text "
            f"encoder of {where} has width {hidden_size}. Fix: load them into the model they were trained on."
        )
    tokens = placeholder_tokens_for(placeholder_token or file_token, vectors.shape[0])
    taken = [t for t in tokens if t in tokenizer.get_vocab()]
    if taken:
        raise InferenceInputError(
            f"learned_embeds {str(learned_embeds)!r}: token(s) {', '.join(taken)} already in the vocabulary "
            f"of {where}. Fix: if {where} is already the fine-tuned pipeline, pass no learned_embeds; "
            f"otherwise load them under a new name with placeholder_token='<new-name>'."
        )
    return tokens


def _is_openvino_folder(path: Path) -> bool:
    return (path / "unet" / "openvino_model.xml").is_file()


def _local_model(model: str | os.PathLike) -> Path:
    name = os.fspath(model)
    hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None
    if name not in OFFLINE_MODELS and not Path(name).expanduser().exists() and not hub_like:
        raise FileNotFoundError(
            f"model folder {name!r} does not exist. Fix: pass an existing diffusers folder (e.g. the "
            f"training output_dir/pipeline), an exported OpenVINO folder, a Hub id, '{TOYWORLD}' or '{TINY}'."
        )
    return resolve_model(name)


def check_concept(
    model: str | os.PathLike,
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
) -> Path:
    """Check a model (and embeddings for it) before any loading or export work.

    Reads only the tokenizer and the text-encoder config.

    Args:
        model: ``"tiny"``, a Hub id, a diffusers folder or an exported OpenVINO folder.
        learned_embeds: embeddings to load on top of ``model``: their width must match the text
            encoder and their tokens must be new to the tokenizer.
        placeholder_token: without ``learned_embeds``, a token that ``model`` must already know.

    Returns:
        The local folder of ``model``.

    Raises:
        FileNotFoundError, InferenceInputError, HubUnavailableError: with the fix in the message.
    """
    from transformers import CLIPTokenizer

    path = _local_model(model)
    tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
    hidden_size = json.loads((path / "text_encoder" / "config.json").read_text())["hidden_size"]
    if learned_embeds is not None:
        _check_embeds(
            tokenizer, hidden_size, learned_embeds, placeholder_token, f"model {os.fspath(model)!r}"
        )
    elif placeholder_token is not None and placeholder_token not in tokenizer.get_vocab():
        raise InferenceInputError(
            f"placeholder_token {placeholder_token!r} is not in the tokenizer of model {os.fspath(model)!r}, "
            f"so it does not hold the learned concept. "
            f"Fix: pass the fine-tuned folder (output_dir/pipeline), or "
            f"the base model with learned_embeds=output_dir/{LEARNED_EMBEDS}."
        )
    return path


# --- pipelines ---------------------------------------------------------------------------------


def _is_openvino(pipe: Any) -> bool:
    return hasattr(pipe, "ov_models")


def _hidden_size(pipe: Any) -> int:
    config = pipe.text_encoder.config
    return config["hidden_size"] if isinstance(config, dict) else config.hidden_size


def load_learned_embeds(
    pipe: Any, learned_embeds: str | os.PathLike, placeholder_token: str | None = None, compile: bool = True
) -> list[str]:
    """Load textual-inversion embeddings into a PyTorch or OpenVINO Stable Diffusion pipeline.

    OpenVINO: requests are cleared, the embeddings are inserted into the text-encoder graph by
    optimum-intel's ``load_textual_inversion``, the insertion is verified, then the pipeline compiles.

    Args:
        pipe: a ``StableDiffusionPipeline`` or ``OVStableDiffusionPipeline``.
        learned_embeds: ``learned_embeds.safetensors`` (or the training output_dir holding it).
        placeholder_token: load under this token instead of the one stored in the file.
        compile: OpenVINO only: compile after loading (export skips it).

    Returns:
        The tokens added (``<tok>``, then ``<tok>_1``... for multi-vector embeddings).
    """
    tokens = _check_embeds(
        pipe.tokenizer, _hidden_size(pipe), learned_embeds, placeholder_token, "this pipeline"
    )
    path = Path(learned_embeds)
    path = path / LEARNED_EMBEDS if path.is_dir() else path
    if not _is_openvino(pipe):
        pipe.load_textual_inversion(str(path), token=placeholder_token)
        return tokens
    from optimum.intel.openvino.utils import TEXTUAL_INVERSION_EMBEDDING_KEYS

    graph = pipe.text_encoder.model
    names = {op.get_friendly_name() for op in graph.get_ops()}
    if any(_TI_NODE_MARK in n for n in names):
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: this OpenVINO pipeline already has textual-inversion tokens, and "
            f"optimum-intel 2.2 scrambles the earlier ones on a second load. Fix: load one embedding "
            f"file per pipeline (reload the pipeline, or export once per concept)."
        )
    tables = [op for op in graph.get_ops() if op.get_friendly_name() in TEXTUAL_INVERSION_EMBEDDING_KEYS]
    if not tables or tables[0].get_output_element_type(0).get_type_name() != "f32":
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: the token-embedding table of this OpenVINO text encoder is "
            f"compressed (int8) or missing, so optimum-intel cannot insert rows into it. Fix: insert embeddings "
            f"before compressing: export_openvino(base, out_dir, weight_format='int8', learned_embeds=...)."
        )
    pipe.clear_requests()
    pipe.load_textual_inversion(str(path), token=placeholder_token)
    inserted = sum(_TI_NODE_MARK in op.get_friendly_name() for op in graph.get_ops())
    if inserted != len(tokens):  # pragma: no cover - guards a silent failure of optimum-intel
        raise RuntimeError(
            f"optimum-intel inserted {inserted} of {len(tokens)} embedding rows into the text encoder"
        )
    if compile:
        pipe.compile()
    return tokens


def load_pytorch_pipeline(
    model: str | os.PathLike,
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
):
    """Load an fp32 PyTorch Stable Diffusion pipeline holding the learned concept.

    Args:
        model: the full fine-tuned folder, or the base model (``"tiny"``, a Hub id or a folder).
        learned_embeds: embeddings to load on top of a base model (None for a fine-tuned folder).
        placeholder_token: with ``learned_embeds``: load under this token; without: a token the
            fine-tuned folder must know (checked).

    Returns:
        A ``StableDiffusionPipeline`` without safety checker (the OpenVINO export has none either).
    """
    from diffusers import StableDiffusionPipeline

    path = check_concept(model, learned_embeds, placeholder_token)
    if _is_openvino_folder(path):
        raise InferenceInputError(
            f"model {os.fspath(model)!r} is an OpenVINO export. Fix: use load_openvino_pipeline."
        )
    pipe = StableDiffusionPipeline.from_pretrained(
        path, torch_dtype=torch.float32, safety_checker=None, requires_safety_checker=False
    )
    if learned_embeds is not None:
        load_learned_embeds(pipe, learned_embeds, placeholder_token)
    return pipe


def load_openvino_pipeline(path: str | os.PathLike, compile: bool = True, precision: str | None = "f32"):
    """Load an exported OpenVINO pipeline (dynamic shapes; see :func:`reshape_static`).

    Args:
        precision: OpenVINO's ``INFERENCE_PRECISION_HINT``. ``"f32"`` (default) computes in fp32 like
            PyTorch, so :func:`compare` measures the export and nothing else. ``None`` leaves
            OpenVINO's choice for this CPU: bf16 where it has native bf16 (AVX512-BF16, AMX), which
            is faster and moves the text encoder by ~0.02 and the images to 30-50 dB PSNR (as measured here).

    Raises:
        FileNotFoundError: ``path`` is not an OpenVINO export; the message says how to make one.
    """
    from optimum.intel import OVStableDiffusionPipeline

    path = Path(path)
    if not _is_openvino_folder(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not an exported OpenVINO pipeline (no unet/openvino_model.xml). Fix: export "
            f"first with export_openvino(...) or `python -m helpers.inference export`."
        )
    ov_config = {"INFERENCE_PRECISION_HINT": precision} if precision else None
    return OVStableDiffusionPipeline.from_pretrained(path, compile=compile, ov_config=ov_config)


def openvino_default_precision() -> str:
    """What OpenVINO computes in on this CPU unless told otherwise: ``"bf16"`` where the CPU has
    native bf16 (AVX512-BF16, AMX), else ``"f32"``."""
    import openvino

    return openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


def _replace_dir(tmp: Path, dest: Path) -> None:
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def export_openvino(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    weight_format: str = "fp32",
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a Stable Diffusion pipeline to OpenVINO IR, with the concept, in fp32 or int8 weights.

    Inputs are checked before any export work; the result is written to a temporary folder beside
    ``out_dir`` and renamed into place, so ``out_dir`` is never half-written.

    Args:
        source: the fine-tuned folder, a base model (``"tiny"``, Hub id, folder), or an exported
            OpenVINO folder (then nothing is re-exported, e.g. to compress an fp32 export to int8).
        out_dir: destination folder.
        weight_format: ``"fp32"``, or ``"int8"``: weights compressed with
            ``OVWeightQuantizationConfig(bits=8)`` (data-free, no calibration set).
        learned_embeds: embeddings to insert, through optimum-intel's ``load_textual_inversion``,
            into the exported text encoder (before any compression).
        placeholder_token: see :func:`load_pytorch_pipeline`.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir``, which holds the pipeline and ``export_info.json`` (source, format, seconds).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise InferenceInputError(
            f"weight_format={weight_format!r}: must be one of {', '.join(WEIGHT_FORMATS)}"
        )
    path = check_concept(source, learned_embeds, placeholder_token)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"out_dir {str(out)!r} already exists. Fix: pass overwrite=True or another out_dir."
        )
    if out.resolve() == path.resolve():
        raise InferenceInputError(
            f"out_dir {str(out)!r} is the source folder itself. Fix: choose another out_dir."
        )
    from optimum.intel import OVConfig, OVQuantizer, OVStableDiffusionPipeline, OVWeightQuantizationConfig

    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if _is_openvino_folder(path):
            pipe = OVStableDiffusionPipeline.from_pretrained(path, compile=False)
        else:
            logger.info("exporting %s to OpenVINO IR (SD v1.5: 2-3 min, 4.3 GB in fp32)", path)
            # load_in_8bit=False: keep fp32 weights whatever the model size; int8 is a separate, explicit step
            pipe = OVStableDiffusionPipeline.from_pretrained(
                path, export=True, compile=False, load_in_8bit=False
            )
        tokens = (
            load_learned_embeds(pipe, learned_embeds, placeholder_token, compile=False)
            if learned_embeds
            else []
        )
        if weight_format == "int8":
            config = OVConfig(quantization_config=OVWeightQuantizationConfig(bits=8))
            OVQuantizer(pipe).quantize(ov_config=config, save_directory=tmp)
        else:
            pipe.save_pretrained(tmp)
        info = {
            "source": os.fspath(source),
            "weight_format": weight_format,
            "learned_embeds": os.fspath(learned_embeds) if learned_embeds else None,
            "inserted_tokens": tokens,
            "seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("exported %s (%s) to %s in %.1f s", os.fspath(source), weight_format, out, info["seconds"])
    return out


def export_info(out_dir: str | os.PathLike) -> dict[str, Any]:
    """What :func:`export_openvino` recorded in ``out_dir`` (source, weight_format, seconds...)."""
    return json.loads((Path(out_dir) / EXPORT_INFO).read_text())


def disk_megabytes(folder: str | os.PathLike) -> float:
    """Size of all files under ``folder`` in MB (10^6 bytes), e.g. to compare fp32 and int8 exports."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) / 1e6


def reshape_static(pipe: Any, batch_size: int, height: int, width: int, num_images_per_prompt: int = 1):
    """Fix an OpenVINO pipeline's input shapes (batch, size) and compile it.

    Static shapes let OpenVINO plan memory and pick kernels once. The pipeline then only accepts
    ``batch_size`` prompts, ``num_images_per_prompt``, this size and ``guidance_scale > 1``.
    (int8 weights: the UNet's mid-block must be larger than 1x1, e.g. 128 px for the tiny model.)

    Returns:
        ``pipe``, reshaped and compiled.
    """
    if not _is_openvino(pipe):
        raise InferenceInputError("reshape_static needs an OpenVINO pipeline (see load_openvino_pipeline)")
    scale = pipe.vae_scale_factor
    for name, value in (("height", height), ("width", width)):
        if value <= 0 or value % scale:
            raise InferenceInputError(f"{name}={value}: must be a positive multiple of {scale}")
    if batch_size < 1 or num_images_per_prompt < 1:
        raise InferenceInputError(
            f"batch_size={batch_size}, num_images_per_prompt={num_images_per_prompt}: need >= 1"
        )
    pipe.reshape(
        batch_size=batch_size, height=height, width=width, num_images_per_prompt=num_images_per_prompt
    )
    # optimum-intel 2.2 sizes the decoder by num_images_per_prompt only; it decodes the whole batch
    decoder = pipe.vae_decoder.model
    shape = decoder.inputs[0].get_partial_shape()
    shape[0] = batch_size * num_images_per_prompt
    decoder.reshape({decoder.inputs[0]: shape})
    pipe.clear_requests()
    pipe.compile()
    return pipe


# --- generation --------------------------------------------------------------------------------


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
    if _is_openvino(pipe) and not pipe.is_dynamic:
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
    if _is_openvino(pipe) and not pipe.is_dynamic:
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

    def run(steps: int) -> list:
        latents, generator = initial_latents(pipe, num_images, height, width, seed)
        with torch.inference_mode():
            return pipe(num_inference_steps=steps, latents=latents, generator=generator, **call).images

    if warmup:
        run(1)
    seconds, images = [], []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        images = run(num_inference_steps)
        seconds.append(time.perf_counter() - start)
    return Generation(images, statistics.median(seconds) / num_images, seconds, num_images)


# --- parity ------------------------------------------------------------------------------------


def prompt_ids(pipe: Any, prompt: str) -> torch.Tensor:
    """Token ids the pipeline feeds its text encoder for ``prompt`` (multi-vector tokens expanded)."""
    text = pipe.maybe_convert_prompt(prompt, pipe.tokenizer)
    tok = pipe.tokenizer
    return tok(
        text, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def text_embeddings(pipe: Any, prompt: str) -> torch.Tensor:
    """The text encoder's last hidden state for ``prompt``, shape ``[1, 77, hidden]``."""
    with torch.inference_mode():
        return pipe.text_encoder(prompt_ids(pipe, prompt))[0].float()


def text_encoder_max_abs_diff(pipe_a: Any, pipe_b: Any, prompt: str) -> float:
    """Max abs difference of two pipelines' text-encoder outputs for ``prompt``.

    Raises:
        InferenceInputError: the pipelines tokenize ``prompt`` differently (one lacks the concept).
    """
    ids_a, ids_b = prompt_ids(pipe_a, prompt), prompt_ids(pipe_b, prompt)
    if not torch.equal(ids_a, ids_b):
        raise InferenceInputError(
            f"prompt {prompt!r} tokenizes differently in the two pipelines, so one of them lacks the learned "
            f"token. Fix: load the same learned embeddings (or fine-tuned folder) into both."
        )
    return float((text_embeddings(pipe_a, prompt) - text_embeddings(pipe_b, prompt)).abs().max())


def _pixels(images: Sequence[Any]) -> np.ndarray:
    return np.stack([np.asarray(img, dtype=np.uint8) for img in images]).astype(np.float64)


def image_psnr(images_a: Sequence[Any], images_b: Sequence[Any]) -> float:
    """Peak signal-to-noise ratio of two image lists, in dB, over uint8 pixels (peak 255).

    Identical images give :data:`PSNR_IDENTICAL_DB` (100). 40 dB means a typical pixel is off by
    about 2.5 of 255 levels: invisible to the eye.
    """
    a, b = _pixels(images_a), _pixels(images_b)
    if a.shape != b.shape:
        raise ValueError(f"image lists differ in shape: {a.shape} vs {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    return PSNR_IDENTICAL_DB if mse == 0 else min(PSNR_IDENTICAL_DB, 10 * math.log10(255.0**2 / mse))


def image_max_abs_diff(images_a: Sequence[Any], images_b: Sequence[Any]) -> int:
    """Largest difference of any pixel channel between two image lists, in uint8 levels (0-255)."""
    return int(np.abs(_pixels(images_a) - _pixels(images_b)).max())


def _scheduler_config(pipe: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(pipe.scheduler.config).items() if not k.startswith("_")}


def compare(
    pt_pipe: Any,
    ov_pipe: Any,
    prompt: str,
    num_inference_steps: int = 20,
    guidance_scale: float = 7.5,
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
) -> Parity:
    """Parity of an OpenVINO pipeline against PyTorch: text encoder and images, same seed and scheduler.

    Raises:
        InferenceInputError: the schedulers differ (the images would not be comparable).
    """
    if type(pt_pipe.scheduler) is not type(ov_pipe.scheduler) or _scheduler_config(
        pt_pipe
    ) != _scheduler_config(ov_pipe):
        raise InferenceInputError(
            f"the pipelines' schedulers differ ({type(pt_pipe.scheduler).__name__} vs "
            f"{type(ov_pipe.scheduler).__name__}). Fix: give both the same scheduler, e.g. "
            f"ov_pipe.scheduler = type(pt_pipe.scheduler).from_config(pt_pipe.scheduler.config)."
        )
    kwargs = dict(
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        seed=seed,
        height=height,
        width=width,
        warmup=False,
    )
    pt_images = generate(pt_pipe, prompt, **kwargs).images
    ov_images = generate(ov_pipe, prompt, **kwargs).images
    return Parity(
        text_encoder_max_abs_diff=text_encoder_max_abs_diff(pt_pipe, ov_pipe, prompt),
        image_psnr=image_psnr(pt_images, ov_images),
        image_max_abs_diff=image_max_abs_diff(pt_images, ov_images),
    )


# --- outputs -----------------------------------------------------------------------------------


def save_images(images: Sequence[Any], out_dir: str | os.PathLike, prefix: str) -> list[Path]:
    """Save images as ``out_dir/{prefix}-00.png``, ... (each written to a temporary name, then renamed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = out / f"{prefix}-{i:02d}.png"
        tmp = path.with_name(f".{path.name}.tmp")
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
        paths.append(path)
    return paths


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


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``python -m helpers.inference {export,generate,compare} ...``."""
    parser = argparse.ArgumentParser(prog="python -m helpers.inference", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def concept(p: argparse.ArgumentParser, model_help: str) -> None:
        p.add_argument("--model", required=True, help=model_help)
        p.add_argument("--learned_embeds", default=None, help=f"{LEARNED_EMBEDS} to load on top of --model")
        p.add_argument(
            "--placeholder_token", default=None, help="token to load the embeddings under / to check"
        )

    def sampling(p: argparse.ArgumentParser) -> None:
        p.add_argument("--num_inference_steps", type=int, default=20, help="denoising steps")
        p.add_argument("--guidance_scale", type=float, default=7.5, help="classifier-free guidance strength")
        p.add_argument("--seed", type=int, default=0, help="seed of the initial latents")
        p.add_argument("--resolution", type=int, default=None, help="height and width (default: the model's)")

    p = sub.add_parser("export", help="export to OpenVINO IR (fp32 or int8 weights)")
    concept(p, "fine-tuned folder, base model ('tiny', Hub id, folder) or an OpenVINO export")
    p.add_argument("--output_dir", required=True, help="folder for the OpenVINO pipeline")
    p.add_argument("--weight_format", choices=WEIGHT_FORMATS, default="fp32", help="int8: compressed weights")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")

    p = sub.add_parser("generate", help="generate images and report seconds per image")
    concept(p, "an OpenVINO export (runs OpenVINO) or a PyTorch model folder/'tiny'/Hub id")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeat for a batch)")
    p.add_argument("--num_images_per_prompt", type=int, default=1, help="images per prompt")
    p.add_argument("--static", action="store_true", help="OpenVINO: reshape to static shapes first")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up (median reported)")
    p.add_argument("--output_dir", required=True, help="folder for the PNG images")
    sampling(p)

    p = sub.add_parser("compare", help="parity of an OpenVINO export against PyTorch")
    concept(p, "the PyTorch source the OpenVINO folder was exported from")
    p.add_argument("--openvino_dir", required=True, help="the exported OpenVINO folder")
    p.add_argument("--prompt", required=True, help="prompt, with the placeholder token")
    sampling(p)
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run one command of :func:`parse_args`; returns its results (also logged)."""
    if args.command == "export":
        out = export_openvino(
            args.model,
            args.output_dir,
            args.weight_format,
            args.learned_embeds,
            args.placeholder_token,
            overwrite=args.overwrite,
        )
        return export_info(out)
    size = dict(height=args.resolution, width=args.resolution)
    sampling = dict(
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale, seed=args.seed
    )
    if args.command == "generate":
        if _is_openvino_folder(Path(args.model)):
            pipe = load_openvino_pipeline(args.model)
            if args.learned_embeds:
                load_learned_embeds(pipe, args.learned_embeds, args.placeholder_token)
            if args.static:
                h = args.resolution or pipe.unet.config.sample_size * pipe.vae_scale_factor
                reshape_static(pipe, len(args.prompt), h, h, args.num_images_per_prompt)
        else:
            pipe = load_pytorch_pipeline(args.model, args.learned_embeds, args.placeholder_token)
        run = generate(
            pipe,
            args.prompt,
            num_images_per_prompt=args.num_images_per_prompt,
            repeats=args.repeats,
            **sampling,
            **size,
        )
        paths = save_images(run.images, args.output_dir, "image")
        result = {"seconds_per_image": run.seconds_per_image, "images": [str(p) for p in paths]}
    else:
        pt = load_pytorch_pipeline(args.model, args.learned_embeds, args.placeholder_token)
        result = asdict(
            compare(pt, load_openvino_pipeline(args.openvino_dir), args.prompt, **sampling, **size)
        )
    logger.info("%s: %s", args.command, result)
    return result


def cli(argv: list[str] | None = None) -> int:
    """Entry point: run a command, print its JSON result; input problems exit 2 with one message."""
    from helpers.models import HubUnavailableError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = main(parse_args(argv))
    except (InferenceInputError, FileNotFoundError, FileExistsError, HubUnavailableError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())

"""OpenVINO pipelines: export (fp32 or int8 weights, with the concept), loading, embeddings, static shapes."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from helpers.core import cpu
from helpers.core.files import replace_dir_atomic
from helpers.core.quiet import quiet_model_loading, quiet_weight_compression, tracing_quietly
from helpers.inference.common import (
    EXPORT_INFO,
    OPENVINO_PIPELINES,
    QUANT_MODES,
    WEIGHT_FORMATS,
    InferenceInputError,
    is_openvino,
    is_openvino_folder,
)
from helpers.inference.concept import check_concept, check_pipe_embeds
from helpers.training.data import imagenet_templates_small
from helpers.training.families import family_of

logger = logging.getLogger(__name__)

_TI_NODE_MARK = ".textual_inversion_"  # optimum-intel names the inserted concat nodes with this
CALIBRATION_SAMPLES = 40
"""UNet calls recorded to calibrate ``quant_mode="int8"``. On the SD v1.5 shape at 256 px, with the
UNet alone in int8, 40 and 80 gave the same speed and PSNR (40.0 and 39.6 dB against PyTorch fp32);
80 took twice as long (3 + 8 min)."""
CALIBRATION_STEPS = 10
"""Denoising steps per calibration image: each image gives this many UNet calls, early and late ones,
and one VAE decoder call."""
FLOAT_LAYERS = (
    ".*conv_shortcut/.*",
    ".*conv_in/.*",
    ".*conv_out/.*",
    ".*time_embedding.*",
    ".*time_emb_proj.*",
    ".*attn2\\.to_[kv]/.*",
)
"""Layers ``quant_mode="int8"`` leaves in floating point (NNCF ignored-scope patterns).

* The residual blocks' 1x1 shortcut convolutions. Their input is the un-normalised residual
  stream; in the UNet's up blocks it is also the concatenation of the block's activations with the
  down path's skip connection, two tensors of different ranges that one int8 scale per tensor fits
  badly. A scan that gave one group of layers at a time its floating-point activations back found
  them (+4 dB) and the UNet's last up block (+5 dB; the shortcuts are part of it) the only groups
  worth more than 0.3 dB. They are 1x1 convolutions, a few % of the work.
* Layers with little work, where int8 buys little time and adds error: the first and last
  convolutions (4 latent channels in or out), the timestep MLPs (one vector per image), and the
  cross-attention's key and value projections (77 text tokens): together a few % of a UNet call
  by OpenVINO's per-layer counters (docs/performance.md, inference).

Keeping these in bf16 is what lets the VAE decoder compute in int8 too and the image stay above
40 dB against PyTorch fp32 (the scan, the variants and the released figures: docs/performance.md,
inference; bench/results/inference-*.json).
"""


def insert_learned_embeds(
    pipe: Any, learned_embeds: str | os.PathLike, placeholder_token: str | None = None, compile: bool = True
) -> list[str]:
    """Insert textual-inversion embeddings into an OpenVINO pipeline's text-encoder graphs.

    Requests are cleared, the rows are inserted by optimum-intel's ``load_textual_inversion``
    into each text encoder (SDXL: ``learned_embeds_2.safetensors`` into ``text_encoder_2`` with
    ``tokenizer_2``, the same call with ``text_encoder=`` and ``tokenizer=``), the insertion is
    verified in each graph, then the pipeline compiles (unless ``compile=False``: export skips it).
    :func:`helpers.inference.load_learned_embeds` calls this for OpenVINO pipelines. Every encoder
    is checked before the first graph is changed.

    Returns:
        The tokens added to each tokenizer (``<tok>``, then ``<tok>_1``... for multi-vector embeddings).
    """
    checked = check_pipe_embeds(pipe, learned_embeds, placeholder_token)
    for (path, _), (_, encoder) in checked:
        _check_graph(encoder.model, path)
    pipe.clear_requests()
    for (path, tokens), (tokenizer, encoder) in checked:
        pipe.load_textual_inversion(
            str(path), token=placeholder_token, tokenizer=tokenizer, text_encoder=encoder
        )
        inserted = sum(_TI_NODE_MARK in op.get_friendly_name() for op in encoder.model.get_ops())
        if inserted != len(tokens):  # pragma: no cover - guards a silent failure of optimum-intel
            raise RuntimeError(
                f"optimum-intel inserted {inserted} of {len(tokens)} embedding rows into a text encoder"
            )
    if compile:
        pipe.compile()
    return checked[0][0][1]


def _check_graph(graph: Any, path: Path) -> None:
    """Refuse a text-encoder graph optimum-intel would get wrong: rows already inserted, or an int8 table."""
    from optimum.intel.openvino.utils import TEXTUAL_INVERSION_EMBEDDING_KEYS

    if any(_TI_NODE_MARK in op.get_friendly_name() for op in graph.get_ops()):
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


def _openvino_class(path: Path) -> Any:
    """optimum-intel's pipeline class for the family of the pipeline in ``path`` (PyTorch or OpenVINO)."""
    import optimum.intel

    return getattr(optimum.intel, OPENVINO_PIPELINES[family_of(path).name])


def load_openvino_pipeline(path: str | os.PathLike, compile: bool = True, precision: str | None = "f32"):
    """Load an exported OpenVINO pipeline (dynamic shapes; see :func:`reshape_static`).

    Args:
        precision: OpenVINO's ``INFERENCE_PRECISION_HINT``. ``"f32"`` (default) computes in fp32 like
            PyTorch, so :func:`compare` measures the export and nothing else. ``None`` leaves
            OpenVINO's choice for this CPU: bf16 where it has native bf16 (AVX512-BF16, AMX), which
            is faster but further from PyTorch than f32 (its PSNR is in bench/results).

    Raises:
        FileNotFoundError: ``path`` is not an OpenVINO export; the message says how to make one.
    """
    path = Path(path)
    if not is_openvino_folder(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not an exported OpenVINO pipeline (no unet/openvino_model.xml). Fix: export "
            f"first with export_openvino(...) or `python -m helpers.inference export`."
        )
    ov_config = {"INFERENCE_PRECISION_HINT": precision} if precision else None
    cls = _openvino_class(path)
    quiet_model_loading()
    return cls.from_pretrained(path, compile=compile, ov_config=ov_config)


def openvino_default_precision() -> str:
    """What OpenVINO computes in on this CPU unless told otherwise: ``"bf16"`` where the CPU has
    native bf16 (AVX512-BF16, AMX), else ``"f32"``."""
    import openvino

    return openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


def export_openvino(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    weight_format: str = "fp32",
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
    overwrite: bool = False,
    quant_mode: str | None = None,
    num_samples: int = CALIBRATION_SAMPLES,
    resolution: int | None = None,
) -> Path:
    """Export a pipeline and its concept to OpenVINO IR: fp32, int8 weights, or int8 arithmetic.

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
        quant_mode: ``"int8"`` (optimum-cli's ``--quant-mode int8``): the convolutions and matrix
            products of the UNet and the VAE decoder compute in int8, weights and activations
            (except :data:`FLOAT_LAYERS`), with activation ranges calibrated by running the
            pipeline (:func:`_calibrate_and_quantize`); the text encoder and the VAE encoder follow
            ``weight_format``. On an AVX512-VNNI or AMX CPU this is the fastest variant, and the
            furthest from PyTorch (its PSNR is in bench/results).
        num_samples: UNet calls recorded for the calibration (``quant_mode`` only).
        resolution: image size of the calibration runs, the size you will generate at (default:
            the model's own; ``quant_mode`` only).

    Returns:
        ``out_dir``, which holds the pipeline and ``export_info.json`` (source, format, seconds).
    """
    path = _check_export(source, out_dir, weight_format, learned_embeds, placeholder_token, overwrite,
                         quant_mode, num_samples, resolution)  # fmt: skip
    out, start, info = Path(out_dir), time.perf_counter(), {}

    def fill(tmp: Path) -> None:
        pipe = _load_for_export(path)
        tokens = (
            insert_learned_embeds(pipe, learned_embeds, placeholder_token, compile=False)
            if learned_embeds
            else []
        )
        if quant_mode:
            token = placeholder_token or (tokens[0] if tokens else "object")
            info["calibration"] = _calibrate_and_quantize(
                pipe, tmp, weight_format, token, num_samples, resolution
            )
        else:
            _save_export(pipe, tmp, weight_format)
        info.update(
            source=os.fspath(source),
            weight_format=weight_format,
            quant_mode=quant_mode,
            learned_embeds=os.fspath(learned_embeds) if learned_embeds else None,
            inserted_tokens=tokens,
            seconds=round(time.perf_counter() - start, 2),
        )
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))

    with _collector_skips_older_objects():
        replace_dir_atomic(out, fill)
    what = weight_format + (f", UNet in {quant_mode}" if quant_mode else "")
    logger.info("exported %s (%s) to %s in %.1f s", os.fspath(source), what, out, info["seconds"])
    return out


def _check_export(
    source,
    out_dir,
    weight_format,
    learned_embeds,
    placeholder_token,
    overwrite,
    quant_mode,
    num_samples,
    resolution,
) -> Path:
    """:func:`export_openvino`'s inputs, checked before any export work; returns the source folder."""
    if weight_format not in WEIGHT_FORMATS:
        raise InferenceInputError(
            f"weight_format={weight_format!r}: must be one of {', '.join(WEIGHT_FORMATS)}"
        )
    if quant_mode not in (None, *QUANT_MODES):
        raise InferenceInputError(
            f"quant_mode={quant_mode!r}: must be None or one of {', '.join(QUANT_MODES)}"
        )
    if num_samples < 1:
        raise InferenceInputError(f"num_samples={num_samples}: need at least 1 calibration sample")
    if resolution is not None and (resolution <= 0 or resolution % 8):
        raise InferenceInputError(f"resolution={resolution}: must be a positive multiple of 8")
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
    return path


@contextlib.contextmanager
def _collector_skips_older_objects() -> Iterator[None]:
    """Full garbage collections inside the block walk only the objects made inside it.

    optimum-intel's exporter calls ``gc.collect()`` about a dozen times per pipeline (after each
    model it traces, converts and saves), and each call walks every object the process holds: in a
    notebook kernel or a test process with torch, diffusers and transformers loaded, half a second
    each. :func:`gc.freeze` takes the objects alive now out of those walks; they go back to the
    collector when the block ends, so a cycle among them is collected then, unless the process had
    frozen objects itself (a command under :func:`helpers.core.errors.exit_with`): then they stay
    frozen, as that process chose. What it saves: docs/performance.md, "Findings: inference".
    """
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def _load_for_export(path: Path) -> Any:
    """The pipeline as optimum-intel holds it: read from an OpenVINO folder, or exported from PyTorch."""
    cls = _openvino_class(path)
    quiet_model_loading()
    if is_openvino_folder(path):
        return cls.from_pretrained(path, compile=False)
    logger.info("exporting %s to OpenVINO IR (minutes and GBs for SD v1.5, more for SDXL)", path)
    # fp32 whatever the model's size (load_in_8bit=False: int8 is a separate, explicit step) and whatever
    # dtype its weights are stored in: optimum would trace an fp16-stored UNet's whole pipeline in fp16,
    # with the text encoders' token tables behind a 16-bit embedding op learned rows cannot go into
    with tracing_quietly():
        return cls.from_pretrained(
            path, export=True, compile=False, load_in_8bit=False, torch_dtype=torch.float32
        )


def _save_export(pipe: Any, folder: Path, weight_format: str) -> None:
    """Save the pipeline into ``folder``: as it is (fp32), or with int8 weights (data-free)."""
    from optimum.intel import OVConfig, OVQuantizer, OVWeightQuantizationConfig

    if weight_format == "int8":
        quiet_weight_compression()
        config = OVConfig(quantization_config=OVWeightQuantizationConfig(bits=8))
        OVQuantizer(pipe).quantize(ov_config=config, save_directory=folder)
    else:
        pipe.save_pretrained(folder)


def _record_calibration(pipe: Any, token: str, num_samples: int, size: int) -> tuple[list, list]:
    """Generate with ``pipe`` (compiled, fp32) from the prompt templates with ``token``, recording the
    UNet's inputs (the first ``num_samples`` calls) and the VAE decoder's (one per image)."""
    from optimum.intel.openvino.quantization import InferRequestWrapper  # see _calibrate_and_quantize

    images = -(-num_samples // CALIBRATION_STEPS)
    samples: list = []
    decoder_samples: list = []
    pipe.compile()
    pipe.unet.request = InferRequestWrapper(pipe.unet.request, samples)
    pipe.vae_decoder.request = InferRequestWrapper(pipe.vae_decoder.request, decoder_samples)
    pipe.set_progress_bar_config(disable=True)
    # PyTorch on one thread, as in generate(): its idle workers would spin on OpenVINO's cores
    try:
        with cpu.torch_threads(1):
            for i in tqdm(
                range(images),
                desc=f"calibrating the UNet and the VAE decoder ({images} images, {size} px)",
                unit="image",
            ):
                prompt = imagenet_templates_small[i % len(imagenet_templates_small)].format(token)
                generator = torch.Generator().manual_seed(i)
                pipe(
                    prompt,
                    height=size,
                    width=size,
                    num_inference_steps=CALIBRATION_STEPS,
                    generator=generator,
                    output_type="np",
                )
    finally:
        pipe.unet.request = pipe.unet.request.request
        pipe.vae_decoder.request = pipe.vae_decoder.request.request
        pipe.set_progress_bar_config(disable=False)
    return samples[:num_samples], decoder_samples


def _calibrate_and_quantize(
    pipe: Any, save_dir: Path, weight_format: str, token: str, num_samples: int, resolution: int | None
) -> dict[str, Any]:
    """Quantize ``pipe``'s UNet and VAE decoder to int8 weights and activations, calibrated on their inputs.

    The pipeline (fp32, dynamic shapes) generates from the textual-inversion prompt templates with
    ``token`` in them, ``CALIBRATION_STEPS`` steps per image, until ``num_samples`` UNet calls are
    recorded, and one VAE decoder call per image (optimum-intel's own collection would run 50 steps
    at up to 512 px). NNCF's post-training quantization then sets each activation's int8 range from
    them, leaving :data:`FLOAT_LAYERS` in floating point. The text encoder and the VAE encoder get
    int8 weights if ``weight_format`` is "int8" and stay fp32 otherwise. Saved to ``save_dir``.

    Returns:
        What export_info.json records: samples, decoder samples, steps, resolution, seconds.
    """
    # imported here: nncf and optimum-intel's quantizer cost 8.0 s CPU on top of helpers.inference
    # (measured with time.process_time); only quant_mode="int8" needs them
    import nncf
    from optimum.intel import (
        OVConfig,
        OVPipelineQuantizationConfig,
        OVQuantizationConfig,
        OVQuantizer,
        OVWeightQuantizationConfig,
    )

    start = time.perf_counter()
    size = resolution or pipe.unet.config["sample_size"] * pipe.vae_scale_factor
    samples, decoder_samples = _record_calibration(pipe, token, num_samples, size)
    quiet_weight_compression()
    others = OVWeightQuantizationConfig(bits=8) if weight_format == "int8" else None
    datasets = {"unet": samples, "vae_decoder": decoder_samples}
    config = OVPipelineQuantizationConfig(
        {
            part: OVQuantizationConfig(
                num_samples=len(data),
                # validate=False: a model without such layers quantizes all of its layers
                ignored_scope={"patterns": list(FLOAT_LAYERS), "validate": False},
            )
            for part, data in datasets.items()
        },
        default_config=others,
    )
    logger.info(
        "quantizing the UNet and the VAE decoder to int8 on %d and %d calibration samples",
        len(samples),
        len(decoder_samples),
    )
    OVQuantizer(pipe).quantize(
        ov_config=OVConfig(quantization_config=config),
        calibration_dataset={part: nncf.Dataset(data) for part, data in datasets.items()},
        save_directory=save_dir,
    )
    return dict(
        samples=len(samples),
        decoder_samples=len(decoder_samples),
        steps=CALIBRATION_STEPS,
        resolution=size,
        seconds=round(time.perf_counter() - start, 2),
    )


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
    if not is_openvino(pipe):
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

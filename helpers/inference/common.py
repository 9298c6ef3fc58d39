"""What every part of :mod:`helpers.inference` shares: its error, its tolerances and variant names, and
how to tell an OpenVINO pipeline (or export folder) from a PyTorch one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers.core.errors import InputError
from helpers.training.families import FAMILIES, Family

VARIANTS = ("pytorch_fp32", "openvino_dynamic", "openvino_static", "openvino_static_int8")
"""The variants timed on every CPU; where :func:`openvino_default_precision` is bf16, also this one:"""
BF16_VARIANT = "openvino_static_bf16"
WEIGHT_FORMATS = ("fp32", "int8")
QUANT_MODES = ("int8",)
"""``quant_mode`` of :func:`export_openvino`: int8 weights *and* activations in the UNet and the VAE
decoder (calibrated)."""
QUANT_VARIANT = "openvino_static_quant_int8"
"""Timed on every CPU too: the UNet and the VAE decoder compute in int8 (``quant_mode="int8"``),
the rest in the CPU's default precision (notebook 05, section 8)."""
ROUTES = ("auto", "pipeline", "embeddings")
TEXT_ENCODER_ATOL = 1e-4
"""Max abs difference allowed between OpenVINO fp32 and PyTorch text-encoder outputs (far above what fp32 gives)."""
IMAGE_PSNR_MIN_DB = 40.0
"""Min PSNR (dB, uint8 images) of OpenVINO fp32 against PyTorch with the same latents (measured: bench/results)."""
PSNR_IDENTICAL_DB = 100.0
"""PSNR reported for identical images (the true value is infinite, which JSON cannot hold)."""
EXPORT_INFO = "export_info.json"
OPENVINO_PIPELINES = {"sd1": "OVStableDiffusionPipeline", "sdxl": "OVStableDiffusionXLPipeline"}
"""optimum-intel's pipeline class for each model family (:data:`helpers.training.families.FAMILIES`);
the PyTorch one is the family's ``pipeline_class``."""


class InferenceInputError(InputError):
    """An input of inference or export is unusable; the message names it and the fix."""


def is_openvino(pipe: Any) -> bool:
    """Whether ``pipe`` is an optimum-intel OpenVINO pipeline (else a diffusers PyTorch one)."""
    return hasattr(pipe, "ov_models")


def is_openvino_folder(path: Path) -> bool:
    """Whether ``path`` holds an exported OpenVINO pipeline."""
    return (path / "unet" / "openvino_model.xml").is_file()


def pipe_family(pipe: Any) -> Family:
    """The model family of a loaded PyTorch or OpenVINO pipeline: SDXL when it has a second tokenizer."""
    return FAMILIES["sdxl" if getattr(pipe, "tokenizer_2", None) is not None else "sd1"]


def encoder_pairs(pipe: Any) -> list[tuple[Any, Any]]:
    """``(tokenizer, text_encoder)`` of each text encoder of ``pipe``, in its family's order."""
    family = pipe_family(pipe)
    return [
        (getattr(pipe, tok), getattr(pipe, enc))
        for tok, enc in zip(family.tokenizers, family.text_encoders, strict=True)
    ]


def hidden_size(text_encoder: Any) -> int:
    """Width of a PyTorch or OpenVINO text encoder (OpenVINO keeps the config as a dict)."""
    config = text_encoder.config
    return config["hidden_size"] if isinstance(config, dict) else config.hidden_size

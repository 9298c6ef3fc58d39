"""``TrainConfig``: every textual-inversion knob, defined once.

Field names equal the flags of diffusers' ``examples/textual_inversion/textual_inversion.py``,
so the command lines of the original guides run unchanged apart from the program name. The
same object round-trips through YAML (``--config run.yaml``) and the command line; types,
coercion, ranges, YAML and flags are the schema both trainers share (:mod:`helpers.training.schema`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from helpers.core.errors import InputError
from helpers.training import schema
from helpers.training.schema import Settings, setting

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "no", "bf16")
LEARNABLE_PROPERTIES = ("object", "style")
REPORT_TO = ("tensorboard", "none")
MAX_RESOLUTION = 2048
"""The largest ``resolution`` any run may ask for, whatever the model and memory: Stable Diffusion
models are trained at 512 to 1024 px, and at 2048 px a training step of the SD v1.5 shape keeps
tens of GiB of activations (:mod:`helpers.training.engine.limits` checks the model's own bound)."""

UNSUPPORTED_IN_BOTH = {
    "push_to_hub": "this workshop runs offline; upload output_dir with `huggingface-cli upload` afterwards",
    "hub_token": "this workshop runs offline; log in with `huggingface-cli login` to upload afterwards",
    "hub_model_id": "this workshop runs offline; upload output_dir with `huggingface-cli upload` afterwards",
    "enable_xformers_memory_efficient_attention": "xformers is GPU-only; PyTorch's SDPA attention is used on CPU",
    "allow_tf32": "TF32 exists only on NVIDIA GPUs",
    "tokenizer_name": "the tokenizer is always the one in the model folder",
    "variant": "CPU training loads the full-precision weights; drop the flag",
}
"""Flags of both diffusers scripts (textual_inversion.py's and train_dreambooth_lora.py's) that
neither trainer supports, and why (DreamBooth-LoRA's :mod:`helpers.dreambooth.config` adds its own)."""

# Flags of the diffusers script that this engine does not support, and why. Passing one is an
# error rather than being silently ignored.
UNSUPPORTED_DIFFUSERS_FLAGS = {
    **UNSUPPORTED_IN_BOTH,
    "validation_epochs": "deprecated in diffusers too; use --validation_steps",
    "no_safe_serialization": "outputs are always safetensors, the format load_textual_inversion prefers",
}
# Flags launchers add, which both trainers accept and ignore, with the reason.
LAUNCHER_FLAGS = {"local_rank": "the rank comes from the launcher's environment (LOCAL_RANK / PMI_RANK)"}
# Flags accepted for compatibility and ignored, with the reason.
IGNORED_FLAGS = {**LAUNCHER_FLAGS}

# --prepack_convs / --prepack_linears not given: laid out once below this resolution only. Measured
# (2-core Xeon, AVX512-BF16, docs/performance.md): at 256 px the copies make steps faster (the SDXL
# shape in bf16 1.19x; the SD v1.5 shape: the options table), at 512 px they do not (SD v1.5 shape,
# fp32: 10.3 against 10.5 s a step; SDXL shape, bf16: 28.6 against 28.1 s) while they cost their
# memory (+3.2 and +4.3 GiB of peak) and a longer first step (+15 and +12 s): the larger the
# pictures, the more compute each reorder of a weight is spread over. Not so for the text encoders'
# 77 tokens: under bf16 their linear layers are laid out at any size (engine.setup._prepack).
PREPACK_DEFAULT_BELOW_RESOLUTION = 512


def prepacks(flag: bool | None, resolution: int) -> bool:
    """Whether a ``prepack_*`` setting lays weights out: as given, else below
    :data:`PREPACK_DEFAULT_BELOW_RESOLUTION` (and then as far as the copies fit)."""
    return flag if flag is not None else resolution < PREPACK_DEFAULT_BELOW_RESOLUTION


class ConfigError(InputError):
    """One or more training settings are invalid; the one-line message lists each with its fix."""


@dataclass
class TrainConfig(Settings):
    """Every setting of a textual-inversion run (names as in diffusers' example script).

    Checked and coerced on creation by the shared schema (:mod:`helpers.training.schema`); every
    problem is reported at once in one :class:`ConfigError`. DreamBooth-LoRA's settings take those
    it has too from here (:func:`helpers.training.schema.same_as`), so they are defined once.
    """

    pretrained_model_name_or_path: str = setting(
        "stable-diffusion-v1-5/stable-diffusion-v1-5",
        "Hub id, local diffusers folder, or 'tiny' (offline)",
        not_blank=True,
        hint="a Hub id, a diffusers folder, 'toyworld' or 'tiny'",
    )
    revision: str | None = setting(None, "Hub revision of the model")
    train_data_dir: str | None = setting(None, "folder with 3-5 images of the concept")
    placeholder_token: str = setting(
        "<dicoo>", "the new token that will stand for the concept", one_word=True, hint="e.g. '<dicoo>'"
    )
    initializer_token: str = setting(
        "toy",
        "one existing token the new embedding starts from",
        not_blank=True,
        hint="one existing word that describes the concept, e.g. 'toy'",
    )
    num_vectors: int = setting(1, "embedding vectors for the concept (>1 adds <tok>_1, <tok>_2, ...)", ge=1)
    learnable_property: str = setting("object", "object or style", choices=LEARNABLE_PROPERTIES)
    repeats: int = setting(100, "how many times each image is repeated per epoch", ge=1)
    resolution: int = setting(
        512,
        "training image size (multiple of 8)",
        gt=0,
        le=MAX_RESOLUTION,
        multiple_of=8,
        hint="e.g. 512, or 64 for 'tiny'",
    )
    center_crop: bool = setting(False, "center-crop to a square before resizing")
    train_batch_size: int = setting(1, "images per process per step", ge=1)
    gradient_accumulation_steps: int = setting(1, "micro-batches accumulated per optimizer step", ge=1)
    max_train_steps: int | None = setting(
        3000,
        "optimizer steps in total (overrides num_train_epochs)",
        ge=1,
        hint="or null to train num_train_epochs epochs",
    )
    num_train_epochs: int = setting(100, "epochs, used when max_train_steps is not set", ge=1)
    learning_rate: float = setting(
        5e-4, "initial learning rate (before scale_lr)", gt=0, hint="e.g. 5e-4", usual=(1e-4, 5e-3)
    )
    scale_lr: bool = setting(False, "multiply the learning rate by batch x accumulation x processes")
    lr_scheduler: str = setting("constant", "learning-rate schedule", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = setting(0, "warm-up steps of the schedule", ge=0)
    lr_num_cycles: int = setting(1, "restarts of cosine_with_restarts", ge=1)
    adam_beta1: float = setting(0.9, "AdamW beta1", ge=0, lt=1, hint="e.g. 0.9")
    adam_beta2: float = setting(0.999, "AdamW beta2", ge=0, lt=1, hint="e.g. 0.999")
    adam_weight_decay: float = setting(1e-2, "AdamW weight decay (applies to the new rows only)", ge=0)
    adam_epsilon: float = setting(1e-8, "AdamW epsilon", gt=0, hint="e.g. 1e-8")
    seed: int = setting(
        0,
        "seed of everything random (data order, noise, timesteps)",
        ge=0,
        le=2**32 - 1,
        hint="numpy's seed range",
    )
    mixed_precision: str = setting(
        "auto",
        "auto: bf16 where the CPU has native bf16 and multiplies faster in it",
        choices=MIXED_PRECISION,
        hint=schema.FP16_HINT,
    )
    output_dir: str = setting(
        "textual_inversion_output", "where embeddings, checkpoints and samples go", not_blank=True
    )
    overwrite_output_dir: bool = setting(False, "allow replacing a finished run in output_dir")
    report_to: str = setting(
        "tensorboard",
        "tensorboard: loss, learning rate and validation images as TensorBoard event files; none: off",
        choices=REPORT_TO,
        hint="wandb and comet_ml need their online services, and this workshop runs offline",
    )
    logging_dir: str = setting(
        "logs",
        "TensorBoard's folder, relative to output_dir (`tensorboard --logdir OUTPUT_DIR/logs`)",
        not_blank=True,
    )
    save_steps: int = setting(500, "save learned_embeds-steps-N.safetensors every N steps", ge=1)
    checkpointing_steps: int = setting(500, "save a resumable checkpoint every N steps", ge=1)
    checkpoints_total_limit: int | None = setting(
        None, "keep at most this many checkpoints", ge=1, hint="or null for no limit"
    )
    resume_from_checkpoint: str | None = setting(None, "a checkpoint folder or 'latest'")
    save_as_full_pipeline: bool = setting(False, "also save a complete diffusers pipeline folder")
    validation_prompt: str | None = setting(None, "prompt for sample images during training")
    num_validation_images: int = setting(4, "sample images per validation", ge=0)
    validation_steps: int = setting(100, "validate every N steps", ge=1)
    gradient_checkpointing: bool = setting(False, "trade compute for memory in the UNet and text encoder")
    dataloader_num_workers: int = setting(0, "data-loading worker processes", ge=0)
    latent_cache: bool = setting(
        True,
        "keep the VAE's latents of each image view in a cache shared by the machine's runs, so a re-run "
        "skips the VAE (--no-latent_cache, or WORKSHOP_LATENT_CACHE=off, turns it off)",
    )
    latent_cache_dir: str | None = setting(
        None,
        "folder of the latent cache (default: $WORKSHOP_LATENT_CACHE, else latents/ in "
        "$WORKSHOP_CACHE or ~/.cache/sd-cpu-workshop)",
    )
    prepack_convs: bool | None = setting(
        None,
        "lay out the frozen UNet's convolution weights for oneDNN once instead of in every step: faster "
        "steps for one more weight's worth of memory (two copies replace the weight). Default: below 512 "
        "px (where it pays), as far as the copies fit in memory; "
        "--prepack_convs: always (one line and exit 2 where memory is short); --no-prepack_convs: off",
    )
    prepack_linears: bool | None = setting(
        None,
        "lay out the frozen UNet's and text encoder's linear-layer weights for oneDNN once instead of "
        "in every call: faster steps for one more weight's worth of memory. Default: below 512 px (the "
        "text encoder's at any size under bf16, where its copies replace a cast each step), as far as the "
        "copies fit in memory; --prepack_linears: always (one line and exit 2 where memory is short); "
        "--no-prepack_linears: off",
    )
    use_ipex: bool = setting(
        False, "optimise the UNet with Intel Extension for PyTorch (its environment: make setup-ipex)"
    )

    error: ClassVar[type[InputError]] = ConfigError
    what: ClassVar[str] = "training setting"


def build_parser() -> argparse.ArgumentParser:
    """The ``helpers.train`` argument parser, generated from :class:`TrainConfig`."""
    return schema.build_parser(
        TrainConfig,
        "python -m helpers.train",
        "Textual Inversion on CPU (flags as in diffusers' textual_inversion.py).",
        IGNORED_FLAGS,
        UNSUPPORTED_DIFFUSERS_FLAGS,
    )


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``helpers.train`` flags (and ``--config``) into a checked :class:`TrainConfig`.

    Raises:
        ConfigError: an unsupported diffusers flag, an unreadable or malformed ``--config``, an
            unknown setting, an invalid value, or an output_dir that cannot be written.
    """
    return schema.parse_flags(TrainConfig, build_parser(), argv, IGNORED_FLAGS, UNSUPPORTED_DIFFUSERS_FLAGS)

"""``DreamBoothConfig``: every DreamBooth-LoRA knob, defined once, with the flags of diffusers' script.

Field names equal the flags of diffusers' ``examples/dreambooth/train_dreambooth_lora.py``, so
the command lines of the original guides run unchanged apart from the program name
(``--output_kohya_format`` is its SDXL script's flag, taken for every model). Flags that
make no sense on a CPU or offline are an error that says why (:data:`UNSUPPORTED_DIFFUSERS_FLAGS`);
a few are accepted and have no effect, with the reason (:data:`IGNORED_FLAGS`). The same object
round-trips through YAML (``--config run.yaml``) and the command line. Types, coercion, ranges,
YAML and flags are Textual Inversion's schema (:mod:`helpers.training.schema`), so both trainers
apply the same rules.

This module imports neither torch nor diffusers: ``helpers.launch`` parses a job's flags with it
before any process starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from helpers.core.errors import InputError
from helpers.training import schema
from helpers.training.config import LAUNCHER_FLAGS, UNSUPPORTED_IN_BOTH, ConfigError, TrainConfig
from helpers.training.schema import Settings, same_as, setting

PRIOR_GENERATION_PRECISION = ("no", "fp32", "bf16")

UNSUPPORTED_DIFFUSERS_FLAGS = {
    **UNSUPPORTED_IN_BOTH,  # the Hub's, xformers, TF32, tokenizer_name, variant: as Textual Inversion
    "use_8bit_adam": "bitsandbytes' 8-bit Adam is GPU-only; the LoRA optimizer state is small anyway (a few MB)",
    "tokenizer_max_length": "Stable Diffusion v1's CLIP tokenizer always pads to its 77 tokens",
    "text_encoder_use_attention_mask": "Stable Diffusion v1's CLIP text encoder is trained without an attention mask",
    "validation_images": "only for image-conditioned pipelines (DeepFloyd IF upscalers), not Stable Diffusion",
    "class_labels_conditioning": "only for DeepFloyd IF's UNet, which takes class labels",
}
"""Flags of the diffusers script that this trainer does not support, and why: passing one is an error."""

IGNORED_FLAGS = {
    **LAUNCHER_FLAGS,
    "pre_compute_text_embeddings": "with a frozen text encoder the two prompts are always encoded once, before training",
    "center_crop": "pictures are always centre-cropped, so each one is encoded by the VAE once "
    "(for square pictures a random crop is the whole picture)",
}
"""Flags accepted for compatibility that change nothing here, and the reason."""


class DreamBoothConfigError(ConfigError):
    """One or more DreamBooth settings are invalid; the one-line message lists each with its fix."""


@dataclass
class DreamBoothConfig(Settings):
    """Every setting of a DreamBooth-LoRA run (names as in diffusers' ``train_dreambooth_lora.py``).

    Checked and coerced on creation by the shared schema (:mod:`helpers.training.schema`), then the
    rules between settings (:meth:`more_problems`); every problem is reported at once. A setting
    Textual Inversion has too is its :class:`~helpers.training.config.TrainConfig` field
    (:func:`~helpers.training.schema.same_as`): same default, help and rules.
    """

    error: ClassVar[type[InputError]] = DreamBoothConfigError
    what: ClassVar[str] = "DreamBooth setting"

    pretrained_model_name_or_path: str = same_as(
        TrainConfig,
        "pretrained_model_name_or_path",
        help="Hub id, local diffusers folder, 'toyworld' or 'tiny' (offline)",
    )
    revision: str | None = same_as(TrainConfig, "revision")
    instance_data_dir: str | None = setting(None, "folder with 3-5 pictures of the subject")
    instance_prompt: str = setting(
        "", "prompt naming the subject with a rare word, e.g. 'a photo of sks toy'"
    )
    with_prior_preservation: bool = setting(
        False, "also train on class images so the class keeps its meaning"
    )
    class_data_dir: str | None = setting(None, "folder of class images (missing ones are generated into it)")
    class_prompt: str | None = setting(None, "prompt of the class, e.g. 'a photo of a toy'")
    num_class_images: int = setting(
        100, "class images to use; the base model generates the missing ones", ge=1
    )
    prior_loss_weight: float = setting(1.0, "weight of the class images' loss", ge=0)
    sample_batch_size: int = setting(4, "pictures per call when generating class images", ge=1)
    prior_generation_precision: str | None = setting(
        None, "precision of class-image generation (default: the training precision)",
        choices=PRIOR_GENERATION_PRECISION,
    )  # fmt: skip
    class_num_inference_steps: int = setting(25, "denoising steps per class image (DPM-Solver++)", ge=1)
    class_guidance_scale: float = setting(7.5, "classifier-free guidance of class-image generation", ge=0)
    rank: int = setting(4, "rank of the LoRA update matrices", ge=1, hint="4 to 16 is usual")
    train_text_encoder: bool = setting(False, "also put LoRA layers on the text encoder's attention")
    resolution: int = same_as(TrainConfig, "resolution", hint="e.g. 512, or 64 for 'toyworld'")
    train_batch_size: int = setting(
        1, "subject pictures per process per step (as many class pictures are added)", ge=1
    )
    gradient_accumulation_steps: int = same_as(TrainConfig, "gradient_accumulation_steps")
    max_train_steps: int | None = same_as(TrainConfig, "max_train_steps", default=None)
    num_train_epochs: int = same_as(TrainConfig, "num_train_epochs", default=1)
    learning_rate: float = same_as(TrainConfig, "learning_rate", hint="e.g. 1e-4", usual=(1e-5, 1e-3))
    scale_lr: bool = same_as(TrainConfig, "scale_lr")
    lr_scheduler: str = same_as(TrainConfig, "lr_scheduler")
    lr_warmup_steps: int = same_as(TrainConfig, "lr_warmup_steps")
    lr_num_cycles: int = same_as(TrainConfig, "lr_num_cycles")
    lr_power: float = setting(1.0, "power of the polynomial schedule", gt=0)
    adam_beta1: float = same_as(TrainConfig, "adam_beta1")
    adam_beta2: float = same_as(TrainConfig, "adam_beta2")
    adam_weight_decay: float = setting(1e-2, "AdamW weight decay (of the LoRA matrices)", ge=0)
    adam_epsilon: float = same_as(TrainConfig, "adam_epsilon")
    max_grad_norm: float = setting(1.0, "clip the LoRA gradient to this norm (0: no clipping)", ge=0)
    seed: int = same_as(
        TrainConfig,
        "seed",
        help="seed of everything random (LoRA init, data order, noise, timesteps, class images)",
    )
    mixed_precision: str = same_as(TrainConfig, "mixed_precision")
    output_dir: str = setting(
        "lora-dreambooth-model", "where LoRA weights, checkpoints and samples go", not_blank=True
    )
    report_to: str = same_as(TrainConfig, "report_to")
    logging_dir: str = same_as(TrainConfig, "logging_dir")
    overwrite_output_dir: bool = same_as(TrainConfig, "overwrite_output_dir")
    checkpointing_steps: int = same_as(TrainConfig, "checkpointing_steps")
    checkpoints_total_limit: int | None = same_as(TrainConfig, "checkpoints_total_limit")
    resume_from_checkpoint: str | None = same_as(TrainConfig, "resume_from_checkpoint")
    save_as_full_pipeline: bool = setting(
        False, "also save the full pipeline with the LoRA fused in (output_dir/pipeline)"
    )
    output_kohya_format: bool = setting(
        False,
        "also write the LoRA in kohya's layout, pytorch_lora_weights_kohya.safetensors (AUTOMATIC1111, "
        "ComfyUI); the flag of diffusers' train_dreambooth_lora_sdxl.py",
    )
    validation_prompt: str | None = setting(None, "prompt for sample images during and after training")
    num_validation_images: int = same_as(TrainConfig, "num_validation_images")
    validation_epochs: int = setting(50, "validate after every N-th epoch (and at the end)", ge=1)
    gradient_checkpointing: bool = setting(False, "trade compute for memory in the UNet (and text encoder)")
    prepack_convs: bool | None = same_as(TrainConfig, "prepack_convs")
    dataloader_num_workers: int = same_as(TrainConfig, "dataloader_num_workers")

    def more_problems(self) -> list[str]:
        """The rules between settings: the subject's folder and prompt, and prior preservation's class."""
        problems: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        need(
            self.instance_data_dir is not None and bool(self.instance_data_dir.strip()),
            "instance_data_dir is not set: pass the folder of 3-5 pictures of the subject (--instance_data_dir DIR)",
        )
        need(
            bool(self.instance_prompt.strip()),
            "instance_prompt is empty: name the subject with a rare word and its class, e.g. "
            "--instance_prompt 'a photo of sks toy'",
        )
        if self.with_prior_preservation:
            need(
                bool(self.class_data_dir),
                "with_prior_preservation needs class_data_dir: pass a folder for the class images "
                "(--class_data_dir DIR; missing images are generated into it)",
            )
            need(
                bool(self.class_prompt and self.class_prompt.strip()),
                "with_prior_preservation needs class_prompt: describe the class, e.g. --class_prompt 'a photo of a toy'",
            )
        else:
            for name in ("class_prompt", "class_data_dir"):
                need(
                    getattr(self, name) is None,
                    f"{name} is set but with_prior_preservation is off, so the class images would not be used: "
                    f"add --with_prior_preservation, or drop --{name}",
                )
        return problems


def build_parser() -> argparse.ArgumentParser:
    """The ``helpers.dreambooth`` argument parser, generated from :class:`DreamBoothConfig`."""
    return schema.build_parser(
        DreamBoothConfig,
        "python -m helpers.dreambooth",
        "DreamBooth with LoRA and prior preservation on CPU (flags as in diffusers' train_dreambooth_lora.py).",
        IGNORED_FLAGS,
        UNSUPPORTED_DIFFUSERS_FLAGS,
    )


def parse_args(argv: list[str] | None = None) -> DreamBoothConfig:
    """Parse ``helpers.dreambooth`` flags (and ``--config``) into a checked :class:`DreamBoothConfig`.

    Raises:
        DreamBoothConfigError: an unsupported diffusers flag, an unreadable or malformed ``--config``,
            an unknown setting, an invalid value, or an output_dir that cannot be written.
    """
    return schema.parse_flags(
        DreamBoothConfig, build_parser(), argv, IGNORED_FLAGS, UNSUPPORTED_DIFFUSERS_FLAGS
    )

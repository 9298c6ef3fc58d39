"""``DreamBoothConfig``: every DreamBooth-LoRA knob, defined once, with the flags of diffusers' script.

Field names equal the flags of diffusers' ``examples/dreambooth/train_dreambooth_lora.py``, so
the command lines of the original guides run unchanged apart from the program name. Flags that
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
from helpers.training.config import (
    LOGGING_DIR_HELP,
    LR_SCHEDULERS,
    MIXED_PRECISION,
    PREPACK_CONVS_HELP,
    REPORT_TO,
    REPORT_TO_HELP,
    REPORT_TO_HINT,
    ConfigError,
)
from helpers.training.schema import Settings, setting

DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
PRIOR_GENERATION_PRECISION = ("no", "fp32", "bf16")

UNSUPPORTED_DIFFUSERS_FLAGS = {
    "push_to_hub": "this workshop runs offline; upload output_dir with `huggingface-cli upload` afterwards",
    "hub_token": "this workshop runs offline; log in with `huggingface-cli login` to upload afterwards",
    "hub_model_id": "this workshop runs offline; upload output_dir with `huggingface-cli upload` afterwards",
    "enable_xformers_memory_efficient_attention": "xformers is GPU-only; PyTorch's SDPA attention is used on CPU",
    "allow_tf32": "TF32 exists only on NVIDIA GPUs",
    "use_8bit_adam": "bitsandbytes' 8-bit Adam is GPU-only; the LoRA optimizer state is small anyway (a few MB)",
    "tokenizer_name": "the tokenizer is always the one in the model folder",
    "variant": "CPU training loads the full-precision weights; drop the flag",
    "tokenizer_max_length": "Stable Diffusion v1's CLIP tokenizer always pads to its 77 tokens",
    "text_encoder_use_attention_mask": "Stable Diffusion v1's CLIP text encoder is trained without an attention mask",
    "validation_images": "only for image-conditioned pipelines (DeepFloyd IF upscalers), not Stable Diffusion",
    "class_labels_conditioning": "only for DeepFloyd IF's UNet, which takes class labels",
}
"""Flags of the diffusers script that this trainer does not support, and why: passing one is an error."""

IGNORED_FLAGS = {
    "local_rank": "the rank comes from the launcher's environment (LOCAL_RANK / PMI_RANK)",
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
    rules between settings (:meth:`more_problems`); every problem is reported at once.
    """

    error: ClassVar[type[InputError]] = DreamBoothConfigError
    what: ClassVar[str] = "DreamBooth setting"

    pretrained_model_name_or_path: str = setting(
        DEFAULT_MODEL,
        "Hub id, local diffusers folder, 'toyworld' or 'tiny' (offline)",
        not_blank=True,
        hint="a Hub id, a diffusers folder, 'toyworld' or 'tiny'",
    )
    revision: str | None = setting(None, "Hub revision of the model")
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
    resolution: int = setting(
        512, "training image size (multiple of 8)", gt=0, multiple_of=8, hint="e.g. 512, or 64 for 'toyworld'"
    )
    train_batch_size: int = setting(
        1, "subject pictures per process per step (as many class pictures are added)", ge=1
    )
    gradient_accumulation_steps: int = setting(1, "micro-batches accumulated per optimizer step", ge=1)
    max_train_steps: int | None = setting(
        None,
        "optimizer steps in total (overrides num_train_epochs)",
        ge=1,
        hint="or null to train num_train_epochs epochs",
    )
    num_train_epochs: int = setting(1, "epochs, used when max_train_steps is not set", ge=1)
    learning_rate: float = setting(
        5e-4, "initial learning rate (before scale_lr)", gt=0, hint="e.g. 1e-4", usual=(1e-5, 1e-3)
    )
    scale_lr: bool = setting(False, "multiply the learning rate by batch x accumulation x processes")
    lr_scheduler: str = setting("constant", "learning-rate schedule", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = setting(0, "warm-up steps of the schedule", ge=0)
    lr_num_cycles: int = setting(1, "restarts of cosine_with_restarts", ge=1)
    lr_power: float = setting(1.0, "power of the polynomial schedule", gt=0)
    adam_beta1: float = setting(0.9, "AdamW beta1", ge=0, lt=1, hint="e.g. 0.9")
    adam_beta2: float = setting(0.999, "AdamW beta2", ge=0, lt=1, hint="e.g. 0.999")
    adam_weight_decay: float = setting(1e-2, "AdamW weight decay (of the LoRA matrices)", ge=0)
    adam_epsilon: float = setting(1e-8, "AdamW epsilon", gt=0, hint="e.g. 1e-8")
    max_grad_norm: float = setting(1.0, "clip the LoRA gradient to this norm (0: no clipping)", ge=0)
    seed: int = setting(
        0,
        "seed of everything random (LoRA init, data order, noise, timesteps, class images)",
        ge=0,
        le=2**32 - 1,
        hint="numpy's seed range",
    )
    mixed_precision: str = setting(
        "auto",
        "auto: bf16 only where the CPU has native bf16",
        choices=MIXED_PRECISION,
        hint=schema.FP16_HINT,
    )
    output_dir: str = setting(
        "lora-dreambooth-model", "where LoRA weights, checkpoints and samples go", not_blank=True
    )
    report_to: str = setting("tensorboard", REPORT_TO_HELP, choices=REPORT_TO, hint=REPORT_TO_HINT)
    logging_dir: str = setting("logs", LOGGING_DIR_HELP, not_blank=True)
    overwrite_output_dir: bool = setting(False, "allow replacing a finished run in output_dir")
    checkpointing_steps: int = setting(500, "save a resumable checkpoint every N steps", ge=1)
    checkpoints_total_limit: int | None = setting(
        None, "keep at most this many checkpoints", ge=1, hint="or null for no limit"
    )
    resume_from_checkpoint: str | None = setting(None, "a checkpoint folder or 'latest'")
    save_as_full_pipeline: bool = setting(
        False, "also save the full pipeline with the LoRA fused in (output_dir/pipeline)"
    )
    validation_prompt: str | None = setting(None, "prompt for sample images during and after training")
    num_validation_images: int = setting(4, "sample images per validation", ge=0)
    validation_epochs: int = setting(50, "validate after every N-th epoch (and at the end)", ge=1)
    gradient_checkpointing: bool = setting(False, "trade compute for memory in the UNet (and text encoder)")
    prepack_convs: bool = setting(True, PREPACK_CONVS_HELP)
    dataloader_num_workers: int = setting(0, "data-loading worker processes", ge=0)

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

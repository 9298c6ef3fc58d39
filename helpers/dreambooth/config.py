"""``DreamBoothConfig``: every DreamBooth-LoRA knob, defined once, with the flags of diffusers' script.

Field names equal the flags of diffusers' ``examples/dreambooth/train_dreambooth_lora.py``, so
the command lines of the original guides run unchanged apart from the program name. Flags that
make no sense on a CPU or offline are an error that says why (:data:`UNSUPPORTED_DIFFUSERS_FLAGS`);
a few are accepted and have no effect, with the reason (:data:`IGNORED_FLAGS`). The same object
round-trips through YAML (``--config run.yaml``) and the command line.

This module imports neither torch nor diffusers: ``helpers.launch`` parses a job's flags with it
before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from helpers.core.errors import InputError
from helpers.core.files import write_text_atomic
from helpers.training.config import PREPACK_CONVS_HELP

DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "no", "bf16")
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
    "report_to": "metrics go to output_dir/history.json and the notebook plots; drop the flag",
    "logging_dir": "metrics go to output_dir/history.json; drop the flag",
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


class DreamBoothConfigError(InputError):
    """One or more DreamBooth settings are invalid; the message lists each with its fix."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class DreamBoothConfig:
    """Every setting of a DreamBooth-LoRA run (names as in diffusers' ``train_dreambooth_lora.py``)."""

    pretrained_model_name_or_path: str = _f(
        DEFAULT_MODEL, "Hub id, local diffusers folder, 'toyworld' or 'tiny' (offline)"
    )
    revision: str | None = _f(None, "Hub revision of the model")
    instance_data_dir: str | None = _f(None, "folder with 3-5 pictures of the subject")
    instance_prompt: str = _f("", "prompt naming the subject with a rare word, e.g. 'a photo of sks toy'")
    with_prior_preservation: bool = _f(False, "also train on class images so the class keeps its meaning")
    class_data_dir: str | None = _f(None, "folder of class images (missing ones are generated into it)")
    class_prompt: str | None = _f(None, "prompt of the class, e.g. 'a photo of a toy'")
    num_class_images: int = _f(100, "class images to use; the base model generates the missing ones")
    prior_loss_weight: float = _f(1.0, "weight of the class images' loss")
    sample_batch_size: int = _f(4, "pictures per call when generating class images")
    prior_generation_precision: str | None = _f(
        None, "precision of class-image generation (default: the training precision)",
        choices=PRIOR_GENERATION_PRECISION,
    )  # fmt: skip
    class_num_inference_steps: int = _f(25, "denoising steps per class image (DPM-Solver++)")
    class_guidance_scale: float = _f(7.5, "classifier-free guidance of class-image generation")
    rank: int = _f(4, "rank of the LoRA update matrices")
    train_text_encoder: bool = _f(False, "also put LoRA layers on the text encoder's attention")
    resolution: int = _f(512, "training image size (multiple of 8)")
    train_batch_size: int = _f(1, "subject pictures per process per step (as many class pictures are added)")
    gradient_accumulation_steps: int = _f(1, "micro-batches accumulated per optimizer step")
    max_train_steps: int | None = _f(None, "optimizer steps in total (overrides num_train_epochs)")
    num_train_epochs: int = _f(1, "epochs, used when max_train_steps is not set")
    learning_rate: float = _f(5e-4, "initial learning rate (before scale_lr)")
    scale_lr: bool = _f(False, "multiply the learning rate by batch x accumulation x processes")
    lr_scheduler: str = _f("constant", "learning-rate schedule", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = _f(0, "warm-up steps of the schedule")
    lr_num_cycles: int = _f(1, "restarts of cosine_with_restarts")
    lr_power: float = _f(1.0, "power of the polynomial schedule")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_weight_decay: float = _f(1e-2, "AdamW weight decay (of the LoRA matrices)")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "clip the LoRA gradient to this norm (0: no clipping)")
    seed: int = _f(0, "seed of everything random (LoRA init, data order, noise, timesteps, class images)")
    mixed_precision: str = _f(
        "auto", "auto: bf16 only where the CPU has native bf16", choices=MIXED_PRECISION
    )
    output_dir: str = _f("lora-dreambooth-model", "where LoRA weights, checkpoints and samples go")
    overwrite_output_dir: bool = _f(False, "allow replacing a finished run in output_dir")
    checkpointing_steps: int = _f(500, "save a resumable checkpoint every N steps")
    checkpoints_total_limit: int | None = _f(None, "keep at most this many checkpoints")
    resume_from_checkpoint: str | None = _f(None, "a checkpoint folder or 'latest'")
    save_as_full_pipeline: bool = _f(
        False, "also save the full pipeline with the LoRA fused in (output_dir/pipeline)"
    )
    validation_prompt: str | None = _f(None, "prompt for sample images during and after training")
    num_validation_images: int = _f(4, "sample images per validation")
    validation_epochs: int = _f(50, "validate after every N-th epoch (and at the end)")
    gradient_checkpointing: bool = _f(False, "trade compute for memory in the UNet (and text encoder)")
    prepack_convs: bool = _f(True, PREPACK_CONVS_HELP)
    dataloader_num_workers: int = _f(0, "data-loading worker processes")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise one :class:`DreamBoothConfigError` listing every invalid setting and its fix."""
        problems: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        need(
            self.instance_data_dir is not None and bool(str(self.instance_data_dir).strip()),
            "instance_data_dir is not set: pass the folder of 3-5 pictures of the subject (--instance_data_dir DIR)",
        )
        need(
            bool(self.instance_prompt.strip()),
            "instance_prompt is empty: name the subject with a rare word and its class, e.g. "
            "--instance_prompt 'a photo of sks toy'",
        )
        need(self.rank >= 1, f"rank={self.rank}: the LoRA rank must be at least 1 (4 to 16 is usual)")
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
            need(self.num_class_images >= 1, f"num_class_images={self.num_class_images}: must be at least 1")
        else:
            for name in ("class_prompt", "class_data_dir"):
                need(
                    getattr(self, name) is None,
                    f"{name} is set but with_prior_preservation is off, so the class images would not be used: "
                    f"add --with_prior_preservation, or drop --{name}",
                )
        need(
            self.resolution > 0 and self.resolution % 8 == 0,
            f"resolution={self.resolution}: must be a positive multiple of 8 (e.g. 512, or 64 for 'toyworld')",
        )
        need(
            self.max_train_steps is None or self.max_train_steps >= 1,
            f"max_train_steps={self.max_train_steps}: must be at least 1 (or unset to use num_train_epochs)",
        )
        for name in ("num_train_epochs", "train_batch_size", "gradient_accumulation_steps", "checkpointing_steps",
                     "validation_epochs", "lr_num_cycles", "sample_batch_size", "class_num_inference_steps"):  # fmt: skip
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("lr_warmup_steps", "dataloader_num_workers", "num_validation_images", "prior_loss_weight",
                     "adam_weight_decay", "max_grad_norm"):  # fmt: skip
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)}: must be 0 or more")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate}: must be positive")
        need(
            self.checkpoints_total_limit is None or self.checkpoints_total_limit >= 1,
            f"checkpoints_total_limit={self.checkpoints_total_limit}: must be at least 1 (or unset for no limit)",
        )
        for f in fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                fp16 = " (fp16 is a GPU format: on a CPU use auto, which picks bf16 where it is native)"
                problems.append(
                    f"{f.name}={value!r}: must be one of {', '.join(choices)}{fp16 if value == 'fp16' else ''}"
                )
        if problems:
            raise DreamBoothConfigError("invalid DreamBooth settings:\n  - " + "\n  - ".join(problems))

    # --- YAML -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "settings") -> DreamBoothConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise DreamBoothConfigError(
                f"{source}: unknown setting(s) {', '.join(unknown)}; known settings: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def to_yaml(self, path: str | os.PathLike) -> Path:
        """Write the settings as YAML (atomically)."""
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> DreamBoothConfig:
        path = Path(path)
        if not path.is_file():
            raise DreamBoothConfigError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise DreamBoothConfigError(f"config file {path}: expected a mapping of setting: value")
        return cls.from_dict(values, source=str(path))

    def replace(self, **changes: Any) -> DreamBoothConfig:
        """A copy with some settings changed (validated again)."""
        return type(self).from_dict({**self.to_dict(), **changes})

    # --- command line -----------------------------------------------------------------------
    def to_args(self) -> list[str]:
        """The command-line flags that reproduce these settings (only those not at default)."""
        args: list[str] = []
        default = {f.name: f.default for f in fields(self)}
        for name, value in self.to_dict().items():
            if value == default[name] or value is None:
                continue
            if isinstance(value, bool):
                args.append(f"--{name}" if value else f"--no-{name}")
            else:
                args.append(f"--{name}={value}")
        return args


def build_parser() -> argparse.ArgumentParser:
    """The ``helpers.dreambooth`` argument parser, generated from :class:`DreamBoothConfig`."""
    parser = argparse.ArgumentParser(
        prog="python -m helpers.dreambooth",
        description="DreamBooth with LoRA and prior preservation on CPU (flags as in diffusers' "
        "train_dreambooth_lora.py).",
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML file of settings; flags given on the command line override it")
    for f in fields(DreamBoothConfig):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        opts: dict[str, Any] = {"help": f.metadata["help"], "default": argparse.SUPPRESS}
        if kind == "bool":
            opts["action"] = argparse.BooleanOptionalAction
        else:
            opts["type"] = {"int": int, "float": float, "str": str}[kind.split(" | ")[0]]
        parser.add_argument(f"--{f.name}", **opts)
    for name in (*IGNORED_FLAGS, *UNSUPPORTED_DIFFUSERS_FLAGS):
        parser.add_argument(
            f"--{name}", nargs="?", const=True, help=argparse.SUPPRESS, default=argparse.SUPPRESS
        )
    return parser


def parse_args(argv: list[str] | None = None) -> DreamBoothConfig:
    """Parse ``helpers.dreambooth`` flags (and ``--config``) into a validated :class:`DreamBoothConfig`.

    Raises:
        DreamBoothConfigError: an unsupported diffusers flag, an unknown setting or an invalid value.
    """
    ns = vars(build_parser().parse_args(argv))
    unsupported = [n for n in UNSUPPORTED_DIFFUSERS_FLAGS if n in ns]
    if unsupported:
        raise DreamBoothConfigError(
            "unsupported flag(s) of the diffusers script:\n  - "
            + "\n  - ".join(f"--{n}: {UNSUPPORTED_DIFFUSERS_FLAGS[n]}" for n in unsupported)
        )
    for name in IGNORED_FLAGS:
        ns.pop(name, None)
    config_file = ns.pop("config", None)
    values = DreamBoothConfig.from_yaml(config_file).to_dict() if config_file else {}
    values.update(ns)
    return DreamBoothConfig.from_dict(values, source=config_file or "command line")

"""``TrainConfig``: every textual-inversion knob, defined once.

Field names equal the flags of diffusers' ``examples/textual_inversion/textual_inversion.py``,
so the command lines of the original guides run unchanged apart from the program name. The
same object round-trips through YAML (``--config run.yaml``) and the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from helpers.errors import InputError
from helpers.files import write_text_atomic

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "no", "bf16")
LEARNABLE_PROPERTIES = ("object", "style")

# Flags of the diffusers script that this engine does not support, and why. Passing one is an
# error rather than being silently ignored.
UNSUPPORTED_DIFFUSERS_FLAGS = {
    "push_to_hub": "this workshop runs offline; upload output_dir with `huggingface-cli upload` afterwards",
    "hub_token": "this workshop runs offline; log in with `huggingface-cli login` to upload afterwards",
    "hub_model_id": "this workshop runs offline; upload output_dir with `huggingface-cli upload` afterwards",
    "enable_xformers_memory_efficient_attention": "xformers is GPU-only; PyTorch's SDPA attention is used on CPU",
    "allow_tf32": "TF32 exists only on NVIDIA GPUs",
    "tokenizer_name": "the tokenizer is always the one in the model folder",
    "variant": "CPU training loads the full-precision weights; drop the flag",
    "report_to": "metrics go to output_dir/history.json and the notebook plots; drop the flag",
    "logging_dir": "metrics go to output_dir/history.json; drop the flag",
    "validation_epochs": "deprecated in diffusers too; use --validation_steps",
    "no_safe_serialization": "outputs are always safetensors, the format load_textual_inversion prefers",
}
# Flags accepted for compatibility and ignored, with the reason (launchers add them).
IGNORED_FLAGS = {"local_rank": "the rank comes from the launcher's environment (LOCAL_RANK / PMI_RANK)"}


class ConfigError(InputError):
    """One or more training settings are invalid; the message lists each with its fix."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Every setting of a textual-inversion run (names as in diffusers' example script)."""

    pretrained_model_name_or_path: str = _f(
        "stable-diffusion-v1-5/stable-diffusion-v1-5", "Hub id, local diffusers folder, or 'tiny' (offline)"
    )
    revision: str | None = _f(None, "Hub revision of the model")
    train_data_dir: str | None = _f(None, "folder with 3-5 images of the concept")
    placeholder_token: str = _f("<dicoo>", "the new token that will stand for the concept")
    initializer_token: str = _f("toy", "one existing token the new embedding starts from")
    num_vectors: int = _f(1, "embedding vectors for the concept (>1 adds <tok>_1, <tok>_2, ...)")
    learnable_property: str = _f("object", "object or style", choices=LEARNABLE_PROPERTIES)
    repeats: int = _f(100, "how many times each image is repeated per epoch")
    resolution: int = _f(512, "training image size (multiple of 8)")
    center_crop: bool = _f(False, "center-crop to a square before resizing")
    train_batch_size: int = _f(1, "images per process per step")
    gradient_accumulation_steps: int = _f(1, "micro-batches accumulated per optimizer step")
    max_train_steps: int | None = _f(3000, "optimizer steps in total (overrides num_train_epochs)")
    num_train_epochs: int = _f(100, "epochs, used when max_train_steps is not set")
    learning_rate: float = _f(5e-4, "initial learning rate (before scale_lr)")
    scale_lr: bool = _f(False, "multiply the learning rate by batch x accumulation x processes")
    lr_scheduler: str = _f("constant", "learning-rate schedule", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = _f(0, "warm-up steps of the schedule")
    lr_num_cycles: int = _f(1, "restarts of cosine_with_restarts")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_weight_decay: float = _f(1e-2, "AdamW weight decay (applies to the new rows only)")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    seed: int = _f(0, "seed of everything random (data order, noise, timesteps)")
    mixed_precision: str = _f(
        "auto", "auto: bf16 only where the CPU has native bf16", choices=MIXED_PRECISION
    )
    output_dir: str = _f("textual_inversion_output", "where embeddings, checkpoints and samples go")
    overwrite_output_dir: bool = _f(False, "allow replacing a finished run in output_dir")
    save_steps: int = _f(500, "save learned_embeds-steps-N.safetensors every N steps")
    checkpointing_steps: int = _f(500, "save a resumable checkpoint every N steps")
    checkpoints_total_limit: int | None = _f(None, "keep at most this many checkpoints")
    resume_from_checkpoint: str | None = _f(None, "a checkpoint folder or 'latest'")
    save_as_full_pipeline: bool = _f(False, "also save a complete diffusers pipeline folder")
    validation_prompt: str | None = _f(None, "prompt for sample images during training")
    num_validation_images: int = _f(4, "sample images per validation")
    validation_steps: int = _f(100, "validate every N steps")
    gradient_checkpointing: bool = _f(False, "trade compute for memory in the UNet and text encoder")
    dataloader_num_workers: int = _f(0, "data-loading worker processes")
    use_ipex: bool = _f(False, "use Intel Extension for PyTorch if it is installed")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise one :class:`ConfigError` listing every invalid setting and its fix."""
        problems = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        need(
            self.resolution > 0 and self.resolution % 8 == 0,
            f"resolution={self.resolution}: must be a positive multiple of 8 (e.g. 512, or 64 for 'tiny')",
        )
        need(
            self.max_train_steps is None or self.max_train_steps >= 1,
            f"max_train_steps={self.max_train_steps}: must be at least 1 (or unset to use num_train_epochs)",
        )
        for name in (
            "num_train_epochs",
            "train_batch_size",
            "gradient_accumulation_steps",
            "repeats",
            "num_vectors",
            "save_steps",
            "checkpointing_steps",
            "validation_steps",
            "lr_num_cycles",
        ):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("lr_warmup_steps", "dataloader_num_workers", "num_validation_images"):
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)}: must be 0 or more")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate}: must be positive")
        need(self.adam_weight_decay >= 0, f"adam_weight_decay={self.adam_weight_decay}: must be 0 or more")
        need(
            self.checkpoints_total_limit is None or self.checkpoints_total_limit >= 1,
            f"checkpoints_total_limit={self.checkpoints_total_limit}: must be at least 1 (or unset for no limit)",
        )
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            need(
                not choices or value in choices,
                f"{f.name}={value!r}: must be one of {', '.join(choices or ())}",
            )
        need(
            bool(self.placeholder_token) and not any(c.isspace() for c in self.placeholder_token),
            f"placeholder_token={self.placeholder_token!r}: must be one word without spaces, e.g. '<dicoo>'",
        )
        need(
            bool(self.initializer_token.strip()),
            "initializer_token is empty: give one existing word that describes the concept, e.g. 'toy'",
        )
        if problems:
            raise ConfigError("invalid training settings:\n  - " + "\n  - ".join(problems))

    # --- YAML -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "settings") -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown setting(s) {', '.join(unknown)}; known settings: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def to_yaml(self, path: str | os.PathLike) -> Path:
        """Write the settings as YAML (atomically)."""
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> TrainConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path}: expected a mapping of setting: value")
        return cls.from_dict(values, source=str(path))

    # --- command line -----------------------------------------------------------------------
    def to_args(self) -> list[str]:
        """The command-line flags that reproduce these settings (only those not at default)."""
        args: list[str] = []
        default = {f.name: f.default for f in fields(self)}
        for name, value in self.to_dict().items():
            if value == default[name]:
                continue
            if isinstance(value, bool):
                args.append(f"--{name}" if value else f"--no-{name}")
            elif value is None:
                continue  # defaults are never None-overridden to None; nothing to pass
            else:
                args.append(f"--{name}={value}")
        return args


def build_parser() -> argparse.ArgumentParser:
    """The ``helpers.train`` argument parser, generated from :class:`TrainConfig`."""
    parser = argparse.ArgumentParser(
        prog="python -m helpers.train",
        description="Textual Inversion on CPU (flags as in diffusers' textual_inversion.py).",
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML file of settings; flags given on the command line override it")
    for f in fields(TrainConfig):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        opts: dict[str, Any] = {"help": f.metadata["help"], "default": argparse.SUPPRESS}
        if kind == "bool":
            opts["action"] = argparse.BooleanOptionalAction
        else:
            base = kind.split(" | ")[0]
            opts["type"] = {"int": int, "float": float, "str": str}[base]
            if "choices" in f.metadata:
                opts["choices"] = f.metadata["choices"]
        parser.add_argument(f"--{f.name}", **opts)
    for name in IGNORED_FLAGS:
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS, default=argparse.SUPPRESS)
    for name in UNSUPPORTED_DIFFUSERS_FLAGS:
        parser.add_argument(
            f"--{name}", nargs="?", const=True, help=argparse.SUPPRESS, default=argparse.SUPPRESS
        )
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``helpers.train`` flags (and ``--config``) into a validated :class:`TrainConfig`.

    Raises:
        ConfigError: an unsupported diffusers flag, an unknown setting or an invalid value.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    unsupported = [n for n in UNSUPPORTED_DIFFUSERS_FLAGS if n in ns]
    if unsupported:
        raise ConfigError(
            "unsupported flag(s) of the diffusers script:\n  - "
            + "\n  - ".join(f"--{n}: {UNSUPPORTED_DIFFUSERS_FLAGS[n]}" for n in unsupported)
        )
    for name in IGNORED_FLAGS:
        ns.pop(name, None)
    config_file = ns.pop("config", None)
    values = TrainConfig.from_yaml(config_file).to_dict() if config_file else {}
    values.update(ns)
    return TrainConfig.from_dict(values, source=config_file or "command line")

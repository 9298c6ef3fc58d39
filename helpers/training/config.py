"""``TrainConfig``: every textual-inversion knob, defined once.

Field names equal the flags of diffusers' ``examples/textual_inversion/textual_inversion.py``,
so the command lines of the original guides run unchanged apart from the program name. The
same object round-trips through YAML (``--config run.yaml``) and the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from helpers.core.errors import InputError, read_yaml
from helpers.core.files import write_text_atomic

LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
MIXED_PRECISION = ("auto", "no", "bf16")
# Also DreamBooth-LoRA's flag (helpers.dreambooth.config): both trainers freeze the convolutions.
PREPACK_CONVS_HELP = (
    "lay out the frozen UNet's convolution weights for oneDNN once instead of in every step: faster "
    "steps for two more copies of those weights, skipped if memory is short (--no-prepack_convs: off)"
)
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
    """One or more training settings are invalid; the one-line message lists each with its fix."""


# --- the schema ----------------------------------------------------------------------------------
# Each field of TrainConfig carries its rules in its metadata, and one table-driven check applies
# them (``_check_field``): the type (from the annotation; values from YAML, the command line or
# Python are coerced the same way: YAML reads ``5e-4`` as text), then the rules:
#   choices        the value must be one of these
#   ge, gt, le, lt the bounds (floats must also be finite)
#   multiple_of    e.g. 8 for the resolution
#   one_word       text without spaces (the placeholder token)
#   not_blank      text that is not empty
#   hint           what to write instead, appended to the problem


def _f(default: Any, help: str, **rules: Any) -> Any:
    return field(default=default, metadata={"help": help, **rules})


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~", ""}


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            value = float(value)  # "1e3" (YAML 1.1 reads exponents without a dot as text)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    return float(value.strip() if isinstance(value, str) else value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError


def _to_str(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError
    return str(value)


_TYPES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "int": (_to_int, "a whole number"),
    "float": (_to_float, "a number"),
    "bool": (_to_bool, "true or false"),
    "str": (_to_str, "text"),
}


def _kind(f: dataclasses.Field) -> tuple[str, bool]:
    """(base type name, whether None is allowed) of a TrainConfig field, from its annotation."""
    parts = [p.strip() for p in str(f.type).split("|")]
    return parts[0], "None" in parts


def _bounds_text(rules: dict[str, Any]) -> str:
    words = {"gt": "greater than", "ge": "at least", "lt": "less than", "le": "at most"}
    return " and ".join(f"{words[k]} {rules[k]}" for k in ("gt", "ge", "lt", "le") if k in rules)


def _check_field(f: dataclasses.Field, value: Any) -> tuple[Any, str | None]:
    """Coerce ``value`` to the field's type and apply its rules: (the value, None) or (value, problem)."""
    rules, (kind, optional) = f.metadata, _kind(f)
    hint = f" ({rules['hint']})" if "hint" in rules else ""
    if value is None or (
        optional and kind != "str" and isinstance(value, str) and value.strip().lower() in _NONE
    ):
        if optional:
            return None, None
        return value, f"{f.name} is not set: it must be {_TYPES[kind][1]}, e.g. {f.default!r}"
    convert, expected = _TYPES[kind]
    try:
        coerced = convert(value)
    except (ValueError, TypeError, OverflowError):
        example = f", e.g. {f.default!r}" if f.default is not None else ""
        return value, f"{f.name}={value!r}: expected {expected}{example}"
    shown = f"{f.name}={value!r}"
    if isinstance(coerced, float) and not math.isfinite(coerced):
        return value, f"{shown}: must be a finite number{hint}"
    if "choices" in rules and coerced not in rules["choices"]:
        return value, f"{shown}: must be one of {', '.join(rules['choices'])}"
    bounds = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}
    within = all(op(coerced, rules[k]) for k, op in bounds.items() if k in rules)
    if not within:
        return value, f"{shown}: must be {_bounds_text(rules)}{hint}"
    if "multiple_of" in rules and coerced % rules["multiple_of"]:
        return value, f"{shown}: must be a multiple of {rules['multiple_of']}{hint}"
    if rules.get("not_blank") and not coerced.strip():
        return value, f"{f.name}={value!r}: must not be empty{hint}"
    if rules.get("one_word") and (not coerced or any(c.isspace() for c in coerced)):
        return value, f"{shown}: must be one word without spaces{hint}"
    return coerced, None


@dataclass
class TrainConfig:
    """Every setting of a textual-inversion run (names as in diffusers' example script).

    Values are checked and coerced on creation (``"64"`` becomes 64, ``"5e-4"`` 0.0005, the way
    YAML and the command line give them); every problem is reported at once in one
    :class:`ConfigError`.
    """

    pretrained_model_name_or_path: str = _f(
        "stable-diffusion-v1-5/stable-diffusion-v1-5",
        "Hub id, local diffusers folder, or 'tiny' (offline)",
        not_blank=True,
        hint="a Hub id, a diffusers folder, 'toyworld' or 'tiny'",
    )
    revision: str | None = _f(None, "Hub revision of the model")
    train_data_dir: str | None = _f(None, "folder with 3-5 images of the concept")
    placeholder_token: str = _f(
        "<dicoo>", "the new token that will stand for the concept", one_word=True, hint="e.g. '<dicoo>'"
    )
    initializer_token: str = _f(
        "toy",
        "one existing token the new embedding starts from",
        not_blank=True,
        hint="one existing word that describes the concept, e.g. 'toy'",
    )
    num_vectors: int = _f(1, "embedding vectors for the concept (>1 adds <tok>_1, <tok>_2, ...)", ge=1)
    learnable_property: str = _f("object", "object or style", choices=LEARNABLE_PROPERTIES)
    repeats: int = _f(100, "how many times each image is repeated per epoch", ge=1)
    resolution: int = _f(
        512, "training image size (multiple of 8)", gt=0, multiple_of=8, hint="e.g. 512, or 64 for 'tiny'"
    )
    center_crop: bool = _f(False, "center-crop to a square before resizing")
    train_batch_size: int = _f(1, "images per process per step", ge=1)
    gradient_accumulation_steps: int = _f(1, "micro-batches accumulated per optimizer step", ge=1)
    max_train_steps: int | None = _f(
        3000,
        "optimizer steps in total (overrides num_train_epochs)",
        ge=1,
        hint="or null to train num_train_epochs epochs",
    )
    num_train_epochs: int = _f(100, "epochs, used when max_train_steps is not set", ge=1)
    learning_rate: float = _f(5e-4, "initial learning rate (before scale_lr)", gt=0, hint="e.g. 5e-4")
    scale_lr: bool = _f(False, "multiply the learning rate by batch x accumulation x processes")
    lr_scheduler: str = _f("constant", "learning-rate schedule", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = _f(0, "warm-up steps of the schedule", ge=0)
    lr_num_cycles: int = _f(1, "restarts of cosine_with_restarts", ge=1)
    adam_beta1: float = _f(0.9, "AdamW beta1", ge=0, lt=1, hint="e.g. 0.9")
    adam_beta2: float = _f(0.999, "AdamW beta2", ge=0, lt=1, hint="e.g. 0.999")
    adam_weight_decay: float = _f(1e-2, "AdamW weight decay (applies to the new rows only)", ge=0)
    adam_epsilon: float = _f(1e-8, "AdamW epsilon", gt=0, hint="e.g. 1e-8")
    seed: int = _f(
        0,
        "seed of everything random (data order, noise, timesteps)",
        ge=0,
        le=2**32 - 1,
        hint="numpy's seed range",
    )
    mixed_precision: str = _f(
        "auto", "auto: bf16 only where the CPU has native bf16", choices=MIXED_PRECISION
    )
    output_dir: str = _f(
        "textual_inversion_output", "where embeddings, checkpoints and samples go", not_blank=True
    )
    overwrite_output_dir: bool = _f(False, "allow replacing a finished run in output_dir")
    save_steps: int = _f(500, "save learned_embeds-steps-N.safetensors every N steps", ge=1)
    checkpointing_steps: int = _f(500, "save a resumable checkpoint every N steps", ge=1)
    checkpoints_total_limit: int | None = _f(
        None, "keep at most this many checkpoints", ge=1, hint="or null for no limit"
    )
    resume_from_checkpoint: str | None = _f(None, "a checkpoint folder or 'latest'")
    save_as_full_pipeline: bool = _f(False, "also save a complete diffusers pipeline folder")
    validation_prompt: str | None = _f(None, "prompt for sample images during training")
    num_validation_images: int = _f(4, "sample images per validation", ge=0)
    validation_steps: int = _f(100, "validate every N steps", ge=1)
    gradient_checkpointing: bool = _f(False, "trade compute for memory in the UNet and text encoder")
    dataloader_num_workers: int = _f(0, "data-loading worker processes", ge=0)
    latent_cache: bool = _f(
        True,
        "keep the VAE's latents of each image view in a cache shared by the machine's runs, so a re-run "
        "skips the VAE (--no-latent_cache, or WORKSHOP_LATENT_CACHE=off, turns it off)",
    )
    latent_cache_dir: str | None = _f(
        None,
        "folder of the latent cache (default: $WORKSHOP_LATENT_CACHE, else latents/ in "
        "$WORKSHOP_CACHE or ~/.cache/sd-cpu-workshop)",
    )
    prepack_convs: bool = _f(True, PREPACK_CONVS_HELP)
    prepack_linears: bool = _f(
        True,
        "lay out the frozen UNet's and text encoder's linear-layer weights for oneDNN once instead of "
        "in every call: faster steps for two more copies of those weights, skipped if memory is short "
        "(--no-prepack_linears: off)",
    )
    use_ipex: bool = _f(
        False, "optimise the UNet with Intel Extension for PyTorch (its environment: make setup-ipex)"
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Coerce every setting to its type and check it; raise one :class:`ConfigError` listing every problem.

        Also refuses paths that cannot work whatever happens later (cheap, nothing is created):
        an ``output_dir`` that is a file or lies under a file, and a ``resume_from_checkpoint``
        folder that is empty or a file.
        """
        problems = []
        for f in fields(self):
            value, problem = _check_field(f, getattr(self, f.name))
            if problem:
                problems.append(problem)
            else:
                setattr(self, f.name, value)
        if not problems:
            problems += self._path_problems()
        if problems:
            raise ConfigError(_problems_message(problems))

    def _path_problems(self) -> list[str]:
        problems = []
        out = Path(self.output_dir).expanduser()
        blocker = _file_in_the_way(out)
        if blocker is not None:
            where = "is a file" if blocker == out else f"lies under {blocker}, which is a file"
            problems.append(
                f"output_dir={self.output_dir!r} {where}: it must be a folder (choose another output_dir)"
            )
        ckpt = self.resume_from_checkpoint
        if ckpt and ckpt != "latest":
            path = Path(ckpt).expanduser()
            if path.is_file():
                problems.append(
                    f"resume_from_checkpoint={ckpt!r} is a file: pass a checkpoint folder "
                    f"(output_dir/checkpoints/checkpoint-N) or 'latest'"
                )
            elif path.is_dir() and not any(path.iterdir()):
                problems.append(
                    f"resume_from_checkpoint={ckpt!r} is an empty folder (an interrupted save?): pass a "
                    f"complete checkpoint folder or 'latest', or start without resume_from_checkpoint"
                )
        return problems

    def check_output_dir_writable(self) -> None:
        """Raise :class:`ConfigError` if ``output_dir`` (or, if it is missing, the folder it would be
        created in) cannot be written by this user. Cheap; call it before loading a model.

        Not part of :meth:`validate`: a finished run's settings must stay readable from a read-only copy.
        """
        out = Path(self.output_dir).expanduser().absolute()
        existing = next(p for p in (out, *out.parents) if p.exists())
        if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(
                f"output_dir={self.output_dir!r}: {existing} is not writable by this user. "
                f"Fix: choose an output_dir you can write to, or change the folder's permissions"
            )

    # --- YAML -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "settings") -> TrainConfig:
        """Settings from a mapping (YAML, flags); problems are reported as ``<source>: ...``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(values) - known))
        if unknown:
            raise ConfigError(
                f"{source}: unknown setting(s) {', '.join(unknown)}; known settings: {', '.join(sorted(known))}"
            )
        try:
            return cls(**values)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None

    def to_yaml(self, path: str | os.PathLike) -> Path:
        """Write the settings as YAML (atomically)."""
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> TrainConfig:
        """Read settings written by :meth:`to_yaml` or by hand (``--config run.yaml``).

        Raises:
            ConfigError: the file is missing, unreadable, not YAML (file and line named), not a
                mapping, or holds unknown or invalid settings.
        """
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist. Fix: pass the YAML file of settings")
        values = read_yaml(path, "config file", ConfigError)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(
                f"config file {path}: expected a mapping of setting: value (e.g. `learning_rate: 5.0e-4`), "
                f"found {type(values).__name__}"
            )
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
                args.append(f"--{name}=none")  # e.g. max_train_steps unset: train num_train_epochs
            else:
                args.append(f"--{name}={value}")
        return args


def _problems_message(problems: list[str]) -> str:
    head = "invalid training setting" + ("s" if len(problems) > 1 else "")
    return f"{head}: " + "; ".join(problems)


def _file_in_the_way(folder: Path) -> Path | None:
    """``folder`` itself or the nearest of its parents that exists as something other than a folder."""
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            return None if path.is_dir() else path
    return None


def build_parser() -> argparse.ArgumentParser:
    """The ``helpers.train`` argument parser, generated from :class:`TrainConfig`.

    Values stay text here: :class:`TrainConfig` coerces and checks them exactly as it does the
    values of a ``--config`` YAML, and reports every problem at once.
    """
    parser = argparse.ArgumentParser(
        prog="python -m helpers.train",
        description="Textual Inversion on CPU (flags as in diffusers' textual_inversion.py).",
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML file of settings; flags given on the command line override it")
    for f in fields(TrainConfig):
        kind, optional = _kind(f)
        opts: dict[str, Any] = {"help": f.metadata["help"], "default": argparse.SUPPRESS}
        if kind == "bool":
            opts["action"] = argparse.BooleanOptionalAction
        elif "choices" in f.metadata:
            opts["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
        else:
            opts["metavar"] = kind.upper() + ("|none" if optional and kind != "str" else "")
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

    Also checks that ``output_dir`` can be written, so that a command line fails before any model loads.

    Raises:
        ConfigError: an unsupported diffusers flag, an unreadable or malformed ``--config``, an
            unknown setting, an invalid value, or an output_dir that cannot be written.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    unsupported = [n for n in UNSUPPORTED_DIFFUSERS_FLAGS if n in ns]
    if unsupported:
        raise ConfigError(
            "unsupported flag(s) of the diffusers script: "
            + "; ".join(f"--{n} ({UNSUPPORTED_DIFFUSERS_FLAGS[n]})" for n in unsupported)
        )
    for name in IGNORED_FLAGS:
        ns.pop(name, None)
    config_file = ns.pop("config", None)
    values = TrainConfig.from_yaml(config_file).to_dict() if config_file else {}
    values.update(ns)
    config = TrainConfig.from_dict(values, source="command line" if ns or not config_file else config_file)
    config.check_output_dir_writable()
    return config

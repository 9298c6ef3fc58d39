"""The state of an output folder, read before any model loads: empty, finished or interrupted.

One notion used everywhere a run starts: a fresh run needs an empty folder (or
``--overwrite_output_dir``, which removes every file the engine owns and nothing else), a
resumed run needs a checkpoint of the same run (same seed, model, placeholder token, number of
vectors), and a finished run is one whose ``run_summary.json`` exists (written last).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from helpers.core.outputs import (
    CHECKPOINTS,
    HISTORY,
    HISTORY_PARTIAL,
    LEARNED_EMBEDS,
    MODEL_INDEX,
    PIPELINE_DIR,
    PIPELINE_PARTS,
    SAMPLES,
    SUMMARY,
    TRAIN_CONFIG,
)
from helpers.training.engine import TrainingInputError

EMPTY, FINISHED, INTERRUPTED = "empty", "finished", "interrupted"
IDENTITY = ("seed", "pretrained_model_name_or_path", "placeholder_token", "num_vectors")
"""The settings that make a checkpoint belong to a run: resuming with any other value is refused."""

_FILES = (TRAIN_CONFIG, HISTORY, HISTORY_PARTIAL, LEARNED_EMBEDS, SUMMARY)
_DIRS = (CHECKPOINTS, SAMPLES, PIPELINE_DIR)  # PIPELINE_DIR: where earlier versions put the pipeline
_STEP_EMBEDS = re.compile(r"learned_embeds-steps-\d+\.safetensors")
# Hidden temporaries are named after what they were becoming: ".<stem>.<pid>-<hex>.tmp<suffix>"
# (helpers.core.files), ".checkpoint-N.tmp", ".<name>.<pid>-<hex>.old" (a folder swapped out).
_STEMS = {name.split(".")[0] for name in (*_FILES, *_DIRS, MODEL_INDEX, *PIPELINE_PARTS)}
_HIDDEN_STEM = re.compile(r"\.(learned_embeds-steps-\d+|[A-Za-z_]+)\.")


@dataclass(frozen=True)
class OutputFolder:
    """What an output folder holds, as far as the engine is concerned.

    Attributes:
        path: the folder (it may not exist).
        state: ``"empty"`` (nothing of a run, maybe temporaries), ``"finished"`` (``run_summary.json``)
            or ``"interrupted"`` (a run's files without the summary).
        settings: the run's ``train_config.yaml`` ({} if none).
        checkpoints: its complete checkpoints, oldest first.
        owned: every entry the engine wrote (files and folders, not the temporaries).
        leftovers: hidden temporaries of writes that never finished (a killed run leaves them).
        foreign: a diffusers model folder that no run wrote (``model_index.json``, no run files).
    """

    path: Path
    state: str
    settings: dict[str, Any]
    checkpoints: list[Path]
    owned: list[Path]
    leftovers: list[Path]
    foreign: bool = False

    def describe(self) -> str:
        """The run in a few words, e.g. ``an interrupted run (seed 3, model 'tiny', ...)``."""
        s = self.settings
        facts = [
            f"{key} {s[key]!r}" if isinstance(s[key], str) else f"{key} {s[key]}"
            for key in (*IDENTITY, "max_train_steps")
            if key in s
        ]
        if self.checkpoints:
            facts.append(f"last checkpoint {self.checkpoints[-1].name}")
        elif self.state == INTERRUPTED:
            facts.append("no checkpoint")
        return f"a{'n' if self.state == INTERRUPTED else ''} {self.state} run" + (
            f" ({', '.join(facts)})" if facts else ""
        )


def read_settings(path: Path) -> dict[str, Any]:
    """A ``train_config.yaml`` as a mapping ({} if it is missing or unreadable)."""
    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return values if isinstance(values, dict) else {}


def checkpoint_settings(ckpt: Path) -> dict[str, Any]:
    """The settings of the run a checkpoint belongs to: its own copy, else its run folder's."""
    own = Path(ckpt) / TRAIN_CONFIG
    return read_settings(own if own.is_file() else Path(ckpt).parent.parent / TRAIN_CONFIG)


def settings_differences(settings: dict[str, Any], config) -> list[str]:
    """The :data:`IDENTITY` settings of a saved run that differ from ``config``, in words."""
    found = []
    for key in IDENTITY:
        if key not in settings:
            continue
        theirs, ours = settings[key], getattr(config, key)
        if theirs == ours or (key == "pretrained_model_name_or_path" and _same_folder(theirs, ours)):
            continue
        found.append(f"{key} {theirs!r} there, {ours!r} here")
    return found


def _same_folder(a: Any, b: Any) -> bool:
    try:
        return Path(a).is_dir() and Path(b).is_dir() and Path(a).resolve() == Path(b).resolve()
    except (TypeError, OSError):
        return False


def _is_leftover_name(name: str) -> bool:
    match = _HIDDEN_STEM.match(name)
    return bool(match) and (match.group(1) in _STEMS or match.group(1).startswith("learned_embeds-steps-"))


def inspect_output_dir(output_dir: str | os.PathLike) -> OutputFolder:
    """Read the state of ``output_dir`` (nothing is changed)."""
    from helpers.training.engine.checkpoints import list_checkpoints

    path = Path(output_dir)
    if not path.is_dir():
        return OutputFolder(path, EMPTY, {}, [], [], [])
    names = {p.name for p in path.iterdir()}
    has_run = bool(names & {TRAIN_CONFIG, SUMMARY})
    owned = [path / n for n in sorted(names) if n in _FILES or n in _DIRS or _STEP_EMBEDS.fullmatch(n)]
    pipeline = [path / n for n in sorted(names) if n in PIPELINE_PARTS or n == MODEL_INDEX]
    leftovers = [path / n for n in sorted(names) if _is_leftover_name(n)]
    for sub in (CHECKPOINTS, SAMPLES):
        if (path / sub).is_dir():
            leftovers += sorted(p for p in (path / sub).iterdir() if p.name.startswith("."))
    foreign = MODEL_INDEX in names and not has_run
    if has_run:
        owned += pipeline
    if SUMMARY in names:
        state = FINISHED
    elif owned:
        state = INTERRUPTED
    else:
        state = EMPTY
    settings = read_settings(path / TRAIN_CONFIG)
    return OutputFolder(path, state, settings, list_checkpoints(path), owned, leftovers, foreign)


def check_output_dir(config) -> OutputFolder:
    """Check ``config.output_dir`` can take this run; return its state. Reads only the file system.

    A fresh run needs an empty folder, or ``overwrite_output_dir`` (the run's files will be
    removed). A resumed run continues its folder: it must not hold another run. With
    ``resume_from_checkpoint``, ``overwrite_output_dir`` removes nothing.

    Raises:
        TrainingInputError: the folder is a file, not writable, a model no run wrote, or holds a
            finished or interrupted run that these settings would clobber; the message says the fixes.
    """
    path = Path(config.output_dir)
    if path.exists() and not path.is_dir():
        raise TrainingInputError(
            f"output_dir {path} is a file, not a folder. Fix: choose a folder name (it is created if missing)."
        )
    nearest = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise TrainingInputError(
            f"output_dir {path}: {nearest} is not writable. Fix: choose a folder you can write to."
        )
    folder = inspect_output_dir(path)
    resuming = bool(config.resume_from_checkpoint)
    if folder.foreign:
        raise TrainingInputError(
            f"output_dir {path} holds a diffusers model ({MODEL_INDEX}) that no training run wrote. "
            f"Fix: choose another output_dir."
        )
    if folder.state == FINISHED and not (config.overwrite_output_dir or resuming):
        raise TrainingInputError(
            f"output_dir {path} already holds a finished run ({SUMMARY}). "
            f"Fix: choose another output_dir, or pass --overwrite_output_dir to replace it."
        )
    if folder.state == INTERRUPTED and not (config.overwrite_output_dir or resuming):
        resume = (
            "resume it with --resume_from_checkpoint latest, or pass "
            if folder.checkpoints
            else "it saved no checkpoint to resume: pass "
        )
        raise TrainingInputError(
            f"output_dir {path} holds {folder.describe()}. "
            f"Fix: {resume}--overwrite_output_dir to delete it and start again, or choose another output_dir."
        )
    if resuming and folder.state != EMPTY:
        differs = settings_differences(folder.settings, config)
        if differs:
            raise TrainingInputError(
                f"output_dir {path} holds another run than the one resumed ({'; '.join(differs)}). "
                f"Fix: resume with that run's settings (its {TRAIN_CONFIG}), or choose another output_dir."
            )
    return folder


def check_checkpoint_matches(ckpt: Path, config) -> None:
    """Refuse a checkpoint of another run (seed, model, placeholder token or number of vectors differ).

    Raises:
        TrainingInputError: naming each difference and the fix.
    """
    differs = settings_differences(checkpoint_settings(ckpt), config)
    if differs:
        raise TrainingInputError(
            f"resume_from_checkpoint {ckpt} belongs to another run ({'; '.join(differs)}). "
            f"Fix: resume it with that run's settings (its {TRAIN_CONFIG}), or start without "
            f"--resume_from_checkpoint."
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clear_run(output_dir: str | os.PathLike) -> list[Path]:
    """Remove everything the engine owns in ``output_dir`` (nothing else); return what was removed."""
    folder = inspect_output_dir(output_dir)
    owned = folder.owned
    if not folder.foreign:  # a pipeline's parts, whole or half-moved, belong to the run
        owned = sorted(
            set(owned)
            | {folder.path / n for n in (*PIPELINE_PARTS, MODEL_INDEX) if (folder.path / n).exists()}
        )
    removed = [*folder.leftovers, *owned]
    for path in removed:
        _remove(path)
    return removed


def clear_leftovers(output_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporaries of writes that never finished, and pipeline parts without
    ``model_index.json`` (a pipeline write that never finished); return what was removed."""
    folder = inspect_output_dir(output_dir)
    removed = list(folder.leftovers)
    if folder.settings and not (folder.path / MODEL_INDEX).exists():
        removed += [folder.path / n for n in PIPELINE_PARTS if (folder.path / n).exists()]
    for path in removed:
        _remove(path)
    return removed

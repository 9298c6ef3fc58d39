"""The state of an output folder, read before any model loads: empty, finished or interrupted.

One notion used everywhere a run starts, by both trainers (each describes what it writes in a
:class:`RunLayout`): a fresh run needs an empty folder (or ``--overwrite_output_dir``, which
removes every file the trainer owns and nothing else), a resumed run needs a checkpoint of the
same run (its :attr:`RunLayout.identity` settings equal), and a finished run is one whose
``run_summary.json`` exists (written last). One run at a time uses a folder: it holds the
folder's lock (:class:`FolderLock`) from before the models load to its end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from helpers.core.outputs import (
    CHECKPOINTS,
    HISTORY,
    HISTORY_PARTIAL,
    LEARNED_EMBEDS,
    LEARNED_EMBEDS_2,
    LOGS,
    MODEL_INDEX,
    PIPELINE_DIR,
    PIPELINE_PARTS,
    SAMPLES,
    SUMMARY,
    TRAIN_CONFIG,
)
from helpers.training.engine import TrainingInputError
from helpers.training.engine.checkpoints import list_checkpoints

# The lock lives in its own module; its names stay importable from here, where the trainers take them.
from helpers.training.engine.lock import LOCK_FILE as LOCK_FILE
from helpers.training.engine.lock import FolderLock as FolderLock
from helpers.training.engine.lock import is_main_process as is_main_process

logger = logging.getLogger(__name__)

EMPTY, FINISHED, INTERRUPTED = "empty", "finished", "interrupted"
IDENTITY = ("seed", "pretrained_model_name_or_path", "placeholder_token", "num_vectors")
"""The settings that make a textual-inversion checkpoint belong to a run: resuming with any other
value is refused."""


@dataclass(frozen=True)
class RunLayout:
    """What one trainer writes into its output folder; the folder and checkpoint functions take it.

    Attributes:
        config_file: the settings' YAML, in ``output_dir`` (written first) and in each checkpoint.
        weights_file: what the run learns, in ``output_dir`` and in each checkpoint.
        files, dirs: every file and folder of ``output_dir`` the trainer owns (what
            ``--overwrite_output_dir`` removes).
        identity: the settings that make a checkpoint belong to a run (others may change on resume).
        pipeline_in_folder: whether ``--save_as_full_pipeline`` makes ``output_dir`` itself a pipeline.
        step_files: the names of files saved every N steps, if any.
    """

    config_file: str
    weights_file: str
    files: tuple[str, ...]
    dirs: tuple[str, ...]
    identity: tuple[str, ...]
    pipeline_in_folder: bool = False
    step_files: re.Pattern | None = None

    def stems(self) -> set[str]:
        """The names a hidden temporary of this trainer starts with (``.<stem>.``)."""
        names = (
            *self.files,
            *self.dirs,
            *((MODEL_INDEX, *PIPELINE_PARTS) if self.pipeline_in_folder else ()),
        )
        return {name.split(".")[0] for name in names}


TEXTUAL_INVERSION = RunLayout(
    config_file=TRAIN_CONFIG,
    weights_file=LEARNED_EMBEDS,
    files=(TRAIN_CONFIG, HISTORY, HISTORY_PARTIAL, LEARNED_EMBEDS, LEARNED_EMBEDS_2, SUMMARY),
    dirs=(CHECKPOINTS, SAMPLES, LOGS, PIPELINE_DIR),  # PIPELINE_DIR: where earlier versions put the pipeline
    identity=IDENTITY,
    pipeline_in_folder=True,
    step_files=re.compile(r"learned_embeds(_2)?-steps-\d+\.safetensors"),  # _2: SDXL's second encoder
)
"""The textual-inversion engine's output folder (:mod:`helpers.core.outputs`)."""

# Hidden temporaries are named after what they were becoming: ".<stem>.<writer>.tmp<suffix>"
# (helpers.core.files), ".checkpoint-N.tmp", ".<name>.<writer>.old" (a folder swapped out).
_HIDDEN_STEM = re.compile(r"\.(learned_embeds(?:_2)?-steps-\d+|[A-Za-z_0-9]+)\.")


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
        layout: the trainer's :class:`RunLayout`.
    """

    path: Path
    state: str
    settings: dict[str, Any]
    checkpoints: list[Path]
    owned: list[Path]
    leftovers: list[Path]
    foreign: bool = False
    layout: RunLayout = TEXTUAL_INVERSION

    def describe(self) -> str:
        """The run in a few words, e.g. ``an interrupted run (seed 3, model 'tiny', ...)``."""
        s = self.settings
        facts = [
            f"{key} {s[key]!r}" if isinstance(s[key], str) else f"{key} {s[key]}"
            for key in (*self.layout.identity, "max_train_steps")
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
    """A run's settings file as a mapping ({} if it is missing or unreadable)."""
    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return values if isinstance(values, dict) else {}


def checkpoint_settings(ckpt: Path, layout: RunLayout = TEXTUAL_INVERSION) -> dict[str, Any]:
    """The settings of the run a checkpoint belongs to: its own copy, else its run folder's."""
    own = Path(ckpt) / layout.config_file
    return read_settings(own if own.is_file() else Path(ckpt).parent.parent / layout.config_file)


def settings_differences(settings: dict[str, Any], config, identity: tuple[str, ...] = IDENTITY) -> list[str]:
    """The ``identity`` settings of a saved run that differ from ``config``, in words."""
    found = []
    for key in identity:
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


def _is_leftover_name(name: str, layout: RunLayout) -> bool:
    match = _HIDDEN_STEM.match(name)
    if not match:
        return False
    stem = match.group(1)
    return stem in layout.stems() or (
        layout.step_files is not None and layout.step_files.fullmatch(f"{stem}.safetensors") is not None
    )


def _is_owned(name: str, layout: RunLayout) -> bool:
    step_file = layout.step_files is not None and layout.step_files.fullmatch(name)
    return name in layout.files or name in layout.dirs or bool(step_file)


def inspect_output_dir(output_dir: str | os.PathLike, layout: RunLayout = TEXTUAL_INVERSION) -> OutputFolder:
    """Read the state of ``output_dir`` as ``layout``'s trainer sees it (nothing is changed)."""
    path = Path(output_dir)
    if not path.is_dir():
        return OutputFolder(path, EMPTY, {}, [], [], [], layout=layout)
    names = {p.name for p in path.iterdir()}
    has_run = bool(names & {layout.config_file, SUMMARY})
    owned = [path / n for n in sorted(names) if _is_owned(n, layout)]
    pipeline = [
        path / n
        for n in sorted(names)
        if layout.pipeline_in_folder and (n in PIPELINE_PARTS or n == MODEL_INDEX)
    ]
    leftovers = [path / n for n in sorted(names) if _is_leftover_name(n, layout)]
    for sub in (CHECKPOINTS, SAMPLES):
        if (path / sub).is_dir() and not (path / sub).is_symlink():
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
    settings = read_settings(path / layout.config_file)
    return OutputFolder(path, state, settings, list_checkpoints(path), owned, leftovers, foreign, layout)


def check_output_dir(config, layout: RunLayout = TEXTUAL_INVERSION) -> OutputFolder:
    """Check ``config.output_dir`` can take this run; return its state. Reads only the file system.

    A folder another run is using (:class:`FolderLock`) is refused, whatever the settings. A fresh
    run needs an empty folder, or ``overwrite_output_dir`` (the run's files will be removed). A
    resumed run continues its folder: it must not hold another run. With
    ``resume_from_checkpoint``, ``overwrite_output_dir`` removes nothing.

    Raises:
        TrainingInputError: the folder is a file, not writable, in use, a model no run wrote, or
            holds a finished or interrupted run that these settings would clobber; the message
            says the fixes.
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
    check_logging_dir(config)
    if is_main_process():  # the other ranks of a job share the lock their main process takes
        FolderLock(path).refuse_if_held()
    refuse_links(path, layout)
    folder = inspect_output_dir(path, layout)
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
    if folder.state == INTERRUPTED and not (
        config.overwrite_output_dir or resuming or starts_over(folder, config)
    ):
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
        differs = settings_differences(folder.settings, config, layout.identity)
        if differs:
            raise TrainingInputError(
                f"output_dir {path} holds another run than the one resumed ({'; '.join(differs)}). "
                f"Fix: resume with that run's settings (its {layout.config_file}), or choose another output_dir."
            )
    return folder


def check_logging_dir(config) -> None:
    """With ``--report_to tensorboard``: ``output_dir/logging_dir`` must be a folder this user can
    create or write into (checked with the output folder, before anything is written).

    Raises:
        TrainingInputError: it, or a folder above it, is a file, or it cannot be written.
    """
    if getattr(config, "report_to", "none") == "none" or not getattr(config, "logging_dir", None):
        return
    path = Path(config.output_dir) / config.logging_dir
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == path else f"lies under {blocker}, which is a file"
        raise TrainingInputError(
            f"logging_dir {path} {where}: TensorBoard writes a folder there. Fix: pass another --logging_dir "
            f"(a folder name, relative to output_dir), or --report_to none."
        )
    nearest = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise TrainingInputError(
            f"logging_dir {path}: {nearest} is not writable. Fix: pass a --logging_dir you can write to "
            f"(relative to output_dir), or --report_to none."
        )


def _links_in(path: Path, layout: RunLayout) -> Iterator[Path]:
    """The symbolic links at the names a run writes in ``path`` and anywhere inside its folders."""
    names = [*layout.files, *layout.dirs]
    if layout.pipeline_in_folder:
        names += [*PIPELINE_PARTS, MODEL_INDEX]
    for name in names:
        entry = path / name
        if entry.is_symlink():
            yield entry
        elif name in layout.dirs and entry.is_dir():
            for root, dirs, found in os.walk(entry):  # os.walk never descends into a link
                yield from (Path(root) / n for n in (*dirs, *found) if os.path.islink(os.path.join(root, n)))


def refuse_links(output_dir: str | os.PathLike, layout: RunLayout = TEXTUAL_INVERSION) -> None:
    """Refuse a symbolic link where the run writes (its files and folders, what is inside them).

    A run never writes through a link: in a shared folder anyone could plant one at a name the run
    writes and have it overwrite, or fill, a file or folder elsewhere. ``output_dir`` itself may be
    a link (e.g. to a larger disk). Reads only the file system.

    Raises:
        TrainingInputError: naming the first link, where it points and the fix.
    """
    path = Path(output_dir)
    if not path.is_dir():
        return
    link = next(_links_in(path, layout), None)
    if link is not None:
        raise TrainingInputError(
            f"output_dir {path}: {link.relative_to(path)} is a symbolic link (to {os.readlink(link)}); a run "
            f"writes its own files and never through a link. Fix: remove the link (rm {link}), or choose "
            f"another output_dir (output_dir itself may be a link)."
        )


_NOT_THE_RUN = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint")  # how, not what, it runs


def starts_over(folder: OutputFolder, config) -> bool:
    """Whether a fresh run of ``config`` restarts ``folder``'s interrupted run: one that saved no
    checkpoint (nothing to resume) with the same settings (the same command run again).

    Such a run was stopped (Ctrl-C, TERM, a kill) before its first checkpoint; running the command
    again is the only way on, so it is accepted and the old run's files are removed under the lock
    (:func:`hold_output_dir`). Another command is still refused: that folder is someone's run.
    """
    if folder.state != INTERRUPTED or folder.checkpoints or config.resume_from_checkpoint:
        return False
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None or not folder.settings:
        return False
    ours = yaml.safe_load(yaml.safe_dump(to_dict(), sort_keys=False))  # as its YAML reads back
    theirs = folder.settings
    return {k: v for k, v in ours.items() if k not in _NOT_THE_RUN} == {
        k: v for k, v in theirs.items() if k not in _NOT_THE_RUN
    }


def check_checkpoint_matches(ckpt: Path, config, layout: RunLayout = TEXTUAL_INVERSION) -> None:
    """Refuse a checkpoint of another run (one of ``layout.identity``, e.g. the seed or model, differs).

    Raises:
        TrainingInputError: naming each difference and the fix.
    """
    differs = settings_differences(checkpoint_settings(ckpt, layout), config, layout.identity)
    if differs:
        raise TrainingInputError(
            f"resume_from_checkpoint {ckpt} belongs to another run ({'; '.join(differs)}). "
            f"Fix: resume it with that run's settings (its {layout.config_file}), or start without "
            f"--resume_from_checkpoint."
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clear_run(output_dir: str | os.PathLike, layout: RunLayout = TEXTUAL_INVERSION) -> list[Path]:
    """Remove everything the trainer owns in ``output_dir`` (nothing else); return what was removed."""
    folder = inspect_output_dir(output_dir, layout)
    owned = folder.owned
    if (
        layout.pipeline_in_folder and not folder.foreign
    ):  # a pipeline's parts, whole or half-moved, belong to the run
        owned = sorted(
            set(owned)
            | {folder.path / n for n in (*PIPELINE_PARTS, MODEL_INDEX) if (folder.path / n).exists()}
        )
    removed = [*folder.leftovers, *owned]
    for path in removed:
        _remove(path)
    return removed


def clear_leftovers(output_dir: str | os.PathLike, layout: RunLayout = TEXTUAL_INVERSION) -> list[Path]:
    """Remove the temporaries of writes that never finished, and pipeline parts without
    ``model_index.json`` (a pipeline write that never finished); return what was removed."""
    folder = inspect_output_dir(output_dir, layout)
    removed = list(folder.leftovers)
    if layout.pipeline_in_folder and folder.settings and not (folder.path / MODEL_INDEX).exists():
        removed += [folder.path / n for n in PIPELINE_PARTS if (folder.path / n).exists()]
    for path in removed:
        _remove(path)
    return removed


# --- one run per folder: the lock (helpers.training.engine.lock), held around the run ------------


@contextlib.contextmanager
def hold_output_dir(config, layout: RunLayout = TEXTUAL_INVERSION) -> Iterator[FolderLock | None]:
    """Hold ``config.output_dir``'s lock on the main process for the ``with`` block (None elsewhere).

    The folder is checked again once the lock is held (:func:`check_output_dir`): another run may
    have finished in it between the first check and this one. A run of the same command stopped
    before its first checkpoint is removed here (:func:`starts_over`), under the lock.
    """
    if not is_main_process():
        yield None
        return
    with FolderLock(config.output_dir) as lock:
        folder = check_output_dir(config, layout)
        if starts_over(folder, config) and not config.overwrite_output_dir:
            clear_run(folder.path, layout)
            logger.warning(
                "output_dir %s: the same command was stopped here before its first checkpoint; starting over",
                folder.path,
            )
        yield lock

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
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import socket
import sys
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
    files=(TRAIN_CONFIG, HISTORY, HISTORY_PARTIAL, LEARNED_EMBEDS, SUMMARY),
    dirs=(CHECKPOINTS, SAMPLES, LOGS, PIPELINE_DIR),  # PIPELINE_DIR: where earlier versions put the pipeline
    identity=IDENTITY,
    pipeline_in_folder=True,
    step_files=re.compile(r"learned_embeds-steps-\d+\.safetensors"),
)
"""The textual-inversion engine's output folder (:mod:`helpers.core.outputs`)."""

# Hidden temporaries are named after what they were becoming: ".<stem>.<pid>-<hex>.tmp<suffix>"
# (helpers.core.files), ".checkpoint-N.tmp", ".<name>.<pid>-<hex>.old" (a folder swapped out).
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
        layout.step_files is not None and stem.startswith("learned_embeds-steps-")
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
    if is_main_process():  # the other ranks of a job share the lock their main process takes
        FolderLock(path).refuse_if_held()
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
        differs = settings_differences(folder.settings, config, layout.identity)
        if differs:
            raise TrainingInputError(
                f"output_dir {path} holds another run than the one resumed ({'; '.join(differs)}). "
                f"Fix: resume with that run's settings (its {layout.config_file}), or choose another output_dir."
            )
    return folder


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


# --- one run per folder --------------------------------------------------------------------------

LOCK_FILE = ".output_dir.lock"
"""The file in ``output_dir`` whose ``flock`` the running run holds (removed when it ends)."""

_HELD: dict[Path, FolderLock] = {}  # the folders this process holds: its own checks must not refuse them


def env_rank() -> int | None:
    """This process's global rank as the launchers set it (torchrun, Hydra/PMI, Open MPI), before
    any process group exists; None outside a launcher."""
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def is_main_process() -> bool:
    """Whether this process is its job's main process (rank 0, or not launched as a rank)."""
    return env_rank() in (None, 0)


class FolderLock:
    """One run at a time in an output folder: an exclusive ``fcntl.flock`` on ``output_dir/.output_dir.lock``.

    The kernel frees a flock when its process ends, however it ends (SIGKILL included), so the
    file a killed run leaves is free and the next run takes it over. The file holds the holder's
    pid, host and command, for the line a second run gets. Only a job's main process takes it:
    the ranks of one job share ``output_dir``. A flock keeps apart the runs of one host only
    (not two hosts writing one network folder).

    Args:
        output_dir: the run's folder (created by :meth:`acquire` if missing).
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_FILE
        self.taken_over: str | None = None  # the holder a killed run left in the file, if any
        self._fd: int | None = None

    def holder(self) -> str | None:
        """Who holds the lock now (``pid N on host H: command``), or None if no other run does."""
        if self.path.absolute() in _HELD:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # no lock file (or not readable: then no run of this user holds it)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _describe(_read_all(fd))
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def refuse_if_held(self) -> None:
        """Raise :class:`TrainingInputError` naming the run that holds the lock, if one does."""
        held = self.holder()
        if held is not None:
            raise self._in_use(held)

    def _in_use(self, held: str) -> TrainingInputError:
        return TrainingInputError(
            f"output_dir {self.folder} is in use by another run ({held}). "
            f"Fix: wait for that run to end (or stop it), or choose another output_dir."
        )

    def acquire(self) -> FolderLock:
        """Take the lock (creating the folder), or raise :class:`TrainingInputError` naming its holder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a holder ending between our open and flock removes the file: open it again
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _describe(_read_all(fd))
                os.close(fd)
                raise self._in_use(held) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise TrainingInputError(f"output_dir {self.folder}: {LOCK_FILE} keeps changing. Fix: try again.")
        previous = _read_all(fd)
        self.taken_over = _describe(previous) if previous.strip() else None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(shlex.join(sys.orig_argv).split())[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        _HELD[self.path.absolute()] = self
        if self.taken_over:
            logger.warning(
                "output_dir %s: took over the lock of a run that ended (%s)", self.folder, self.taken_over
            )
        return self

    def release(self) -> None:
        """Remove the lock file and free the lock (the file first, so nobody locks a removed file)."""
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink()
        except OSError:
            pass  # the folder went away: nothing to clean
        os.close(self._fd)
        self._fd = None
        _HELD.pop(self.path.absolute(), None)

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def hold_output_dir(config, layout: RunLayout = TEXTUAL_INVERSION) -> Iterator[FolderLock | None]:
    """Hold ``config.output_dir``'s lock on the main process for the ``with`` block (None elsewhere).

    The folder is checked again once the lock is held (:func:`check_output_dir`): another run may
    have finished in it between the first check and this one.
    """
    if not is_main_process():
        yield None
        return
    with FolderLock(config.output_dir) as lock:
        check_output_dir(config, layout)
        yield lock


def _read_all(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace")


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, theirs = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)

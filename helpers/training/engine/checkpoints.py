"""Resumable checkpoints: ``output_dir/checkpoints/checkpoint-N`` (accelerate's state, what the run
learns and its settings), for both trainers: save, rotate, find, check."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from helpers.core import files
from helpers.core.errors import one_line
from helpers.core.outputs import CHECKPOINTS, HISTORY, HISTORY_PARTIAL, TRAIN_CONFIG
from helpers.training.engine import TrainingInputError
from helpers.training.engine.saving import storage_errors, write_json

_NAME = re.compile(r"checkpoint-(\d+)")
_STATE_FILE = "random_states_0.pkl"  # accelerate's save_state writes it for rank 0, whatever was prepared


INTERRUPTED = (
    "interrupted (Ctrl-C): the run stopped before it finished; its last complete checkpoint is kept. "
    "Fix: resume it with the same command plus --resume_from_checkpoint latest"
)
"""The one line a training command prints when Ctrl-C stops it after a checkpoint (exit code 130, as the shell's)."""
START_OVER = (
    "interrupted (Ctrl-C) before the first checkpoint: there is nothing to resume, the run must start over. "
    "Fix: run the same command again (it is accepted into this folder and starts from step 0)"
)
"""The line when Ctrl-C stops a run that has no checkpoint to resume."""
INTERRUPTED_EXIT = 130


def interrupted_line(output_dir: str | os.PathLike) -> str:
    """What to tell a person whose run in ``output_dir`` was stopped: resume it, or start it over."""
    return INTERRUPTED if list_checkpoints(Path(output_dir)) else START_OVER


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was saved at (``checkpoint-N`` → N)."""
    return int(_NAME.fullmatch(Path(path).name).group(1))


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a whole accelerate checkpoint (it holds rank 0's ``random_states_0.pkl``).

    The engines fill a checkpoint under a hidden name and rename it when it is whole, so a folder
    named ``checkpoint-N`` without this file was made some other way (e.g. by hand).
    """
    return (Path(path) / _STATE_FILE).is_file()


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (a link is none: the run never writes one)."""
    found = [
        p
        for p in (Path(output_dir) / CHECKPOINTS).glob("checkpoint-*")
        if _NAME.fullmatch(p.name) and not p.is_symlink() and is_complete(p)
    ]
    return sorted(found, key=checkpoint_step)


def resolve_checkpoint(output_dir: Path, resume_from_checkpoint: str) -> Path:
    """The checkpoint folder ``resume_from_checkpoint`` names (``"latest"``: the run's newest).

    Raises:
        TrainingInputError: there is no such complete checkpoint; the message says the fix.
    """
    if resume_from_checkpoint == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise TrainingInputError(
                f"resume_from_checkpoint='latest' but {Path(output_dir) / CHECKPOINTS} holds no checkpoint. "
                f"Fix: start without resume_from_checkpoint, or point it at a checkpoint folder."
            )
        return found[-1]
    path = Path(resume_from_checkpoint)
    if not _NAME.fullmatch(path.name) or not path.is_dir():
        raise TrainingInputError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a checkpoint folder (…/checkpoints/checkpoint-N). "
            f"Fix: pass an existing checkpoint folder or 'latest'."
        )
    if not is_complete(path):
        raise TrainingInputError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a complete checkpoint (no {_STATE_FILE}). "
            f"Fix: pass a checkpoint the run saved, or 'latest'."
        )
    return path


def load_state(accelerator, ckpt: Path) -> None:
    """accelerate's ``load_state`` of ``ckpt``; a file it refuses or cannot read is one line.

    accelerate unpickles with ``weights_only=True``, so a planted payload is refused, not run; a
    refused, truncated or otherwise unreadable file becomes a :class:`TrainingInputError` naming
    the checkpoint and the fix instead of a traceback.
    """
    try:
        accelerator.load_state(str(ckpt))
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as err:
        reason = one_line(err).split("; ")[0][:200]
        raise TrainingInputError(
            f"checkpoint {ckpt} cannot be loaded: a file in it is damaged or not plain tensors ({reason}). "
            "Fix: remove that folder to resume from the checkpoint before it, or start in a new --output_dir"
        ) from None


def save_checkpoint(
    accelerator,
    config,
    output_dir: Path,
    step: int,
    history: list[dict],
    write_weights: Callable[[Path], object],
    config_file: str = TRAIN_CONFIG,
) -> Path:
    """Save a resumable checkpoint ``checkpoint-{step}``, then prune the oldest beyond the limit.

    Complete or absent: every process writes accelerate's state into ``.checkpoint-{step}.tmp`` (a
    name all processes know); once all are done the main process adds what the run learns and
    its settings, records the history so far (``history.json.partial``) and swaps the folder in
    (:func:`helpers.core.files.move_dir_into_place`). Only then are old checkpoints removed, each
    renamed aside first, so a crash at any moment leaves every checkpoint name whole. A full disk
    or an I/O error removes the temporary and is one :class:`~helpers.training.engine.saving.StorageError`.

    Args:
        accelerator: the run's accelerator (its prepared objects are saved).
        config: the settings (``checkpoints_total_limit``; saved with ``to_yaml``).
        output_dir: the run's folder.
        step: the step just completed.
        history: the records so far.
        write_weights: writes what the run learns into the folder it is given.
        config_file: the name of the settings' YAML in the checkpoint.
    """
    root = Path(output_dir) / CHECKPOINTS
    final = root / f"checkpoint-{step}"
    tmp = root / f".{final.name}.tmp"
    main = accelerator.is_main_process
    if main:
        files.discard(tmp)  # what a killed attempt left (a link planted there: the link, not its target)
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # new, so accelerate never writes through something planted under this known name
    accelerator.wait_for_everyone()
    with storage_errors(final, f"checkpoint {final.name}", discard=tmp if main else None):
        accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's random states are in before the swap
    if main:
        with storage_errors(final, f"checkpoint {final.name}", discard=tmp):
            write_weights(tmp)
            config.to_yaml(tmp / config_file)
            write_json(Path(output_dir) / HISTORY_PARTIAL, history)
            files.move_dir_into_place(tmp, final)
        prune_checkpoints(output_dir, keep=final, limit=config.checkpoints_total_limit)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(output_dir: Path, keep: Path, limit: int | None) -> list[Path]:
    """Delete the oldest checkpoints so that at most ``limit`` remain, never ``keep``; return the deleted.

    Each is renamed to a hidden name before it is deleted: a crash while deleting leaves a hidden
    leftover, never a half-deleted checkpoint under its checkpoint name.
    """
    if not limit:
        return []
    others = [c for c in list_checkpoints(output_dir) if c != keep]
    doomed = others[: max(0, len(others) + 1 - limit)]
    for old in doomed:
        aside = old.with_name(f".{old.name}.deleting")
        files.discard(aside)  # a link planted at this known name goes, never what it points to
        os.rename(old, aside)
        shutil.rmtree(aside)
    return doomed


def check_not_past_the_end(ckpt: Path, max_steps: int) -> None:
    """Refuse to resume a checkpoint saved after the run's last step.

    A checkpoint at the last step is fine (the run writes its outputs without training); one past
    it holds weights trained longer than this run may train, so it is refused rather than reported
    as a shorter run.

    Raises:
        TrainingInputError: with the two fixes.
    """
    step = checkpoint_step(ckpt)
    if step > max_steps:
        earlier = [p.name for p in list_checkpoints(ckpt.parent.parent) if checkpoint_step(p) <= max_steps]
        raise TrainingInputError(
            f"resume_from_checkpoint {ckpt} was saved at step {step}, after this run's last step "
            f"(max_train_steps={max_steps}). Fix: pass --max_train_steps {step} or more to continue from it"
            + (f", or resume an earlier checkpoint ({', '.join(earlier)})." if earlier else ".")
        )


def load_history(output_dir: Path, upto_step: int) -> list[dict]:
    """The records of steps 1..``upto_step`` a run in ``output_dir`` wrote (a resume continues them)."""
    path = Path(output_dir) / HISTORY
    partial = Path(output_dir) / HISTORY_PARTIAL
    source = partial if partial.exists() else path
    if not source.exists():
        return []
    return [h for h in json.loads(source.read_text()) if h["step"] <= upto_step]

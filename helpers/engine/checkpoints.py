"""Resumable checkpoints: ``output_dir/checkpoints/checkpoint-N`` (accelerate's state and the learned rows)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from helpers import files
from helpers.engine import TrainingInputError
from helpers.engine.saving import save_learned_embeds, write_json
from helpers.outputs import CHECKPOINTS, HISTORY, HISTORY_PARTIAL, LEARNED_EMBEDS

_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint was saved at (``checkpoint-N`` → N)."""
    return int(_NAME.fullmatch(Path(path).name).group(1))


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoints of a run, oldest first."""
    found = [p for p in (Path(output_dir) / CHECKPOINTS).glob("checkpoint-*") if _NAME.fullmatch(p.name)]
    return sorted(found, key=checkpoint_step)


def resolve_checkpoint(output_dir: Path, resume_from_checkpoint: str) -> Path:
    """The checkpoint folder ``resume_from_checkpoint`` names (``"latest"``: the run's newest).

    Raises:
        TrainingInputError: there is no such checkpoint; the message says the fix.
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
    return path


def save_checkpoint(
    accelerator, config, output_dir: Path, step: int, vectors: torch.Tensor, history: list[dict]
) -> Path:
    """Save a resumable checkpoint (accelerate state + embeddings), pruning old ones."""
    final = Path(output_dir) / CHECKPOINTS / f"checkpoint-{step}"
    tmp = final.with_name(f".{final.name}.tmp")
    if accelerator.is_main_process and config.checkpoints_total_limit:
        existing = list_checkpoints(output_dir)
        # make room for the one about to be saved
        for old in existing[: max(0, len(existing) - config.checkpoints_total_limit + 1)]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        save_learned_embeds(tmp / LEARNED_EMBEDS, config.placeholder_token, vectors)
        write_json(Path(output_dir) / HISTORY_PARTIAL, history)
        files.move_dir_into_place(tmp, final)
    accelerator.wait_for_everyone()
    return final


def load_history(output_dir: Path, upto_step: int) -> list[dict]:
    """The records of steps 1..``upto_step`` a run in ``output_dir`` wrote (a resume continues them)."""
    path = Path(output_dir) / HISTORY
    partial = Path(output_dir) / HISTORY_PARTIAL
    source = partial if partial.exists() else path
    if not source.exists():
        return []
    return [h for h in json.loads(source.read_text()) if h["step"] <= upto_step]

"""Crash safety of the engine, table-driven: a run stopped at any point resumes to the same result.

Each case stops a 4-step run of the tiny model at one point, either by an exception raised there
(in this process) or by a real ``SIGKILL`` (in a ``python -m helpers.train`` subprocess, which
leaves the temporaries an exception would clean up). It then states what the output folder holds
(its state, its checkpoints, no half-written pipeline) and what the next run does: resumed with
``--resume_from_checkpoint latest`` or started again with ``--overwrite_output_dir`` it ends with
the uninterrupted run's embedding and history and no leftovers; started afresh it refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from helpers import data
from helpers import textual_inversion as ti
from helpers.config import TrainConfig
from helpers.engine import checkpoints
from helpers.outputs import HISTORY, HISTORY_PARTIAL, LEARNED_EMBEDS, SUMMARY

STEPS = 4
ROOT = Path(__file__).resolve().parents[1]


class Crash(RuntimeError):
    """Stands for whatever stops a run at that point (an error, Ctrl-C, a full disk)."""


def settings(output_dir: Path, **overrides) -> dict:
    values = dict(
        pretrained_model_name_or_path="tiny",
        train_data_dir=str(data.sample_concept_dir()),
        placeholder_token="<dicoo>",
        initializer_token="toy",
        resolution=64,
        max_train_steps=STEPS,
        checkpointing_steps=2,
        save_steps=100,
        learning_rate=5e-3,
        seed=3,
        output_dir=str(output_dir),
    )
    return {**values, **overrides}


def config(output_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(**settings(output_dir, **overrides))


def embeds(output_dir: Path) -> torch.Tensor:
    return load_file(Path(output_dir) / LEARNED_EMBEDS)["<dicoo>"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every case must end equal to."""
    result = ti.train(config(tmp_path_factory.mktemp("reference") / "out"))
    return result


class Counter:
    """Counts the optimisation steps a run takes (``training_step`` calls)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = ti.training_step

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(ti, "training_step", counting)


def crash_when(monkeypatch, module, name: str, when=lambda *a, **k: True) -> None:
    """Make ``module.name`` raise :class:`Crash` on the first call for which ``when(*args)`` holds."""
    real = getattr(module, name)

    def crashing(*args, **kwargs):
        if when(*args, **kwargs):
            raise Crash(f"simulated crash in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, crashing)


def named(path_name: str, position: int = 0):
    """``when`` for :func:`crash_when`: the argument at ``position`` is a path named ``path_name``."""
    return lambda *args, **kwargs: Path(args[position]).name == path_name


def in_folder(folder_name: str, position: int = 0):
    """``when`` for :func:`crash_when`: the argument at ``position`` is a path inside ``folder_name``."""
    return lambda *args, **kwargs: Path(args[position]).parent.name == folder_name


@dataclass(frozen=True)
class Case:
    """One crash point: where the run stops, what the folder then holds, what the next run does."""

    name: str
    crash: object  # (monkeypatch) -> None: installs the crash point in this process
    checkpoints: list[str]  # the complete checkpoints left behind
    then: str = "resume"  # "resume" (latest) or "overwrite"
    trained_after: int = 0  # optimisation steps the next run takes
    overrides: dict = field(default_factory=dict)


CASES = [
    Case(
        "final embeddings write: resumed at the last step, only the outputs are written",
        lambda mp: crash_when(mp, ti, "save_learned_embeds", named(LEARNED_EMBEDS)),
        checkpoints=["checkpoint-2", "checkpoint-4"],
        trained_after=0,
    ),
    Case(
        "checkpoint-4 write, limit 1: checkpoint-2 survives (rotation waits for the new one)",
        lambda mp: crash_when(mp, checkpoints, "save_learned_embeds", in_folder(".checkpoint-4.tmp")),
        checkpoints=["checkpoint-2"],
        trained_after=2,
        overrides={"checkpoints_total_limit": 1},
    ),
    Case(
        "accelerate's state write of checkpoint-4, limit 1: checkpoint-2 survives",
        lambda mp: crash_when(mp, Accelerator, "save_state", named(".checkpoint-4.tmp", position=1)),
        checkpoints=["checkpoint-2"],
        trained_after=2,
        overrides={"checkpoints_total_limit": 1},
    ),
    Case(
        "rotation, limit 1: checkpoint-4 is whole before checkpoint-2 goes",
        lambda mp: crash_when(
            mp, checkpoints, "prune_checkpoints", lambda *a, keep, limit: keep.name == "checkpoint-4"
        ),
        checkpoints=["checkpoint-2", "checkpoint-4"],
        trained_after=0,
        overrides={"checkpoints_total_limit": 1},
    ),
    Case(
        "after step 3: resumed from checkpoint-2, trains steps 3 and 4 again",
        lambda mp: crash_when(mp, ti, "_periodic_saves", lambda run, step, history: step == 3),
        checkpoints=["checkpoint-2"],
        trained_after=2,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name.split(":")[0] for c in CASES])
def test_crash_then_next_run(case: Case, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        case.crash(mp)
        with pytest.raises(Crash):
            ti.train(config(out, **case.overrides))
    assert not (out / SUMMARY).exists()  # never reported as finished
    assert [p.name for p in ti.list_checkpoints(out)] == case.checkpoints

    counter = Counter(monkeypatch)
    flag = {"resume": {"resume_from_checkpoint": "latest"}, "overwrite": {"overwrite_output_dir": True}}
    result = ti.train(config(out, **case.overrides, **flag[case.then]))
    assert counter.calls == case.trained_after
    assert torch.equal(embeds(out), embeds(reference.output_dir))
    history = json.loads((out / HISTORY).read_text())
    assert [h["step"] for h in history] == list(range(1, STEPS + 1)) == [h["step"] for h in result.history]
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in reference.history], rel=1e-6)
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["steps"] == STEPS
    assert not (out / HISTORY_PARTIAL).exists()
    limit = case.overrides.get("checkpoints_total_limit")
    assert len(ti.list_checkpoints(out)) <= (limit or STEPS)


def test_a_checkpoint_past_the_last_step_is_refused_before_loading(reference, tmp_path, monkeypatch):
    """checkpoint-4 of a 4-step run resumed with max_train_steps=2: it holds rows trained for 4
    steps, so a 2-step run refuses it (naming the fixes), before any model loads."""
    from helpers import models

    monkeypatch.setattr(models, "load_components", lambda *a, **k: pytest.fail("weights were loaded"))
    ckpt = reference.output_dir / "checkpoints" / "checkpoint-4"
    with pytest.raises(ti.TrainingInputError, match="saved at step 4, after this run's last step") as err:
        ti.train(config(tmp_path / "out", max_train_steps=2, resume_from_checkpoint=str(ckpt)))
    assert "--max_train_steps 4 or more" in str(err.value) and "checkpoint-2" in str(err.value)
    assert not (tmp_path / "out").exists()

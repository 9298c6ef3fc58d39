"""Crash safety of DreamBooth-LoRA, as ``tests/training/test_crash_safety.py`` checks Textual Inversion's.

A 4-step run of the tiny model (checkpoints every 2 steps) is stopped at one point, by an exception
raised there or by a real ``SIGKILL`` in a ``python -m helpers.dreambooth`` subprocess. The folder
then holds an interrupted run with whole checkpoints only; a fresh run into it refuses before any
model loads; ``--resume_from_checkpoint latest`` ends with the uninterrupted run's LoRA weights and
history. Then: resuming at the end trains nothing, checkpoints of another run or past the end are
refused, a diverging run stops with one line, a full disk is one line and leaves no temporary, and
one run at a time uses a folder (a second real process is refused; a killed holder's lock is taken over).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from tiny_parts import (
    Crash,
    crash_when,
    lock_holder,
    one_thread,  # noqa: F401 (autouse: every run of this module on one thread)
    run_killed,
)

from helpers.core import files
from helpers.core.outputs import HISTORY, HISTORY_PARTIAL, SUMMARY
from helpers.dreambooth import command, lora, saving, training
from helpers.dreambooth.config import DreamBoothConfig
from helpers.training import data, models
from helpers.training.engine import TrainingInputError, checkpoints, loop
from helpers.training.engine.folder import LOCK_FILE, FolderLock, inspect_output_dir

STEPS = 4


def settings(output_dir: Path, **overrides) -> dict:
    values = dict(
        pretrained_model_name_or_path="tiny",
        instance_data_dir=str(data.sample_concept_dir()),
        instance_prompt="a photo of sks toy",
        resolution=64,
        max_train_steps=STEPS,
        checkpointing_steps=2,
        learning_rate=1e-2,
        mixed_precision="no",
        output_dir=str(output_dir),
        seed=3,
    )
    return {**values, **overrides}


def config(output_dir: Path, **overrides) -> DreamBoothConfig:
    return DreamBoothConfig(**settings(output_dir, **overrides))


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(output_dir) / lora.LORA_WEIGHTS)


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def inspect(out: Path):
    return inspect_output_dir(out, saving.DREAMBOOTH)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every case must end equal to."""
    return training.train(config(tmp_path_factory.mktemp("reference") / "out"))


@pytest.fixture
def counter(monkeypatch):
    """Counts the steps a run trains (``training_step`` calls, one per optimisation step)."""
    calls = []
    real = training.training_step
    monkeypatch.setattr(training, "training_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@dataclass(frozen=True)
class Case:
    name: str
    crash: object  # (monkeypatch) -> None, or None for the SIGKILL case
    checkpoints: list[str]  # the complete checkpoints left behind
    trained_after: int  # steps the resumed run takes
    overrides: dict = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)  # globs of the temporaries the crash leaves


LIMIT_1 = {"checkpoints_total_limit": 1}
CASES = [
    Case(
        "LoRA write of checkpoint-4, limit 1: checkpoint-2 survives (rotation waits for the new one)",
        lambda mp: crash_when(
            mp, saving, "save_lora_weights", lambda folder, *a: Path(folder).name == ".checkpoint-4.tmp"
        ),
        ["checkpoint-2"],
        2,
        LIMIT_1,
    ),
    Case(
        "accelerate's state write of checkpoint-4, limit 1: checkpoint-2 survives",
        lambda mp: crash_when(mp, Accelerator, "save_state", lambda self, path, *a: Path(path).name == ".checkpoint-4.tmp"),
        ["checkpoint-2"],
        2,
        LIMIT_1,
    ),
    Case(
        "rotation, limit 1: checkpoint-4 is whole before checkpoint-2 goes",
        lambda mp: crash_when(mp, checkpoints, "prune_checkpoints", lambda *a, keep, limit: keep.name == "checkpoint-4"),
        ["checkpoint-2", "checkpoint-4"],
        0,
        LIMIT_1,
    ),
    Case(
        "summary write: not finished, resume at the end rewrites the outputs",
        lambda mp: crash_when(mp, loop, "write_json", lambda path, value: Path(path).name == SUMMARY),
        ["checkpoint-2", "checkpoint-4"],
        0,
    ),
    Case(
        "killed in the checkpoint-4 swap (SIGKILL), limit 1: checkpoint-2 and a temporary remain",
        None,
        ["checkpoint-2"],
        2,
        LIMIT_1,
        ["checkpoints/.checkpoint-4.tmp"],
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name.split(":")[0] for c in CASES])
def test_crash_then_resume(case: Case, reference, tmp_path, monkeypatch, counter):
    out = tmp_path / "out"
    if case.crash is None:
        run_killed("helpers.dreambooth.command", "checkpoint-4", config(out, **case.overrides).to_args())
    else:
        with monkeypatch.context() as mp:
            case.crash(mp)
            with pytest.raises(Crash):
                training.train(config(out, **case.overrides))
    folder = inspect(out)
    assert folder.state == "interrupted" and not (out / SUMMARY).exists()
    assert [p.name for p in folder.checkpoints] == case.checkpoints
    assert sorted(folder.leftovers) == sorted(p for g in case.leftovers for p in out.glob(g))
    assert not (out / LOCK_FILE).exists() or case.crash is None  # an exception releases the lock

    # A fresh run into it refuses, naming the run and both choices, before any model loads.
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with monkeypatch.context() as mp:
        mp.setattr(models, "load_components", lambda *a, **k: pytest.fail("weights were loaded"))
        with pytest.raises(TrainingInputError, match="holds an interrupted run") as err:
            training.train(config(out, **case.overrides))
    assert f"last checkpoint {case.checkpoints[-1]}" in str(err.value)
    assert "--resume_from_checkpoint latest" in str(err.value) and "--overwrite_output_dir" in str(err.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before

    counter.clear()
    result = training.train(config(out, resume_from_checkpoint="latest", **case.overrides))
    assert len(counter) == case.trained_after
    assert same_weights(out, reference.output_dir)
    history = json.loads((out / HISTORY).read_text(), parse_constant=pytest.fail)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1)) == [h["step"] for h in result.history]
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in reference.history], rel=1e-6)
    assert json.loads((out / SUMMARY).read_text(), parse_constant=pytest.fail)["steps"] == STEPS
    folder = inspect(out)
    assert folder.state == "finished" and folder.leftovers == [] and not (out / HISTORY_PARTIAL).exists()
    assert len(folder.checkpoints) <= (case.overrides.get("checkpoints_total_limit") or STEPS)
    assert not (out / LOCK_FILE).exists()


def test_resumed_at_the_end_trains_no_step_past_it(reference, tmp_path, counter):
    """Issue 37: resumed from checkpoint-4 of a 4-step run, DreamBooth trained a step 5. Now it trains
    nothing and writes the same outputs."""
    out = tmp_path / "out"
    shutil.copytree(reference.output_dir, out)
    result = training.train(config(out, resume_from_checkpoint="latest"))
    assert counter == [] and [h["step"] for h in result.history] == [1, 2, 3, 4]
    assert result.summary["steps"] == STEPS and same_weights(out, reference.output_dir)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_train_steps": 3}, "was saved at step 4, after this run's last step (max_train_steps=3). "
                                 "Fix: pass --max_train_steps 4 or more to continue from it, or resume an earlier "
                                 "checkpoint (checkpoint-2)."),
        ({"rank": 8}, "(rank 4 there, 8 here)"),
        ({"train_text_encoder": True}, "(train_text_encoder False there, True here)"),
        ({"seed": 4}, "(seed 3 there, 4 here)"),
    ],
    ids=["past the end", "another rank", "text encoder", "another seed"],
)  # fmt: skip
def test_resume_refuses_another_runs_checkpoint_or_one_past_the_end(
    overrides, message, reference, tmp_path, monkeypatch
):
    """Issue 37: resuming checkpoint-4 with --max_train_steps 3 or another --rank gave exit 0 or a raw
    ValueError. Each is one line before any model loads, and nothing is written."""
    out = tmp_path / "out"
    shutil.copytree(reference.output_dir, out)
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("the model was resolved"))
    with pytest.raises(TrainingInputError) as err:
        training.train(config(out, resume_from_checkpoint="latest", **overrides))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_a_diverging_run_stops_with_one_line_and_exit_2(tmp_path, capsys):
    """Issue 37: --learning_rate 1e30 exited 0 with NaN LoRA weights and "final_loss": NaN. Now the
    first step whose loss, gradient or weights stop being finite ends the run: one line, exit 2,
    no finished run, checkpoints before it finite, what was written strict JSON."""
    out = tmp_path / "out"
    flags = config(out, learning_rate=1e30, checkpointing_steps=1, max_train_steps=6).to_args()
    assert command.cli(flags) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: training diverged at step "), errors
    step = int(errors[0].split("at step ")[1].split(":")[0])
    assert "is not finite" in errors[0] and "--overwrite_output_dir" in errors[0]
    assert "the learning rate 1e+30 is too high (DreamBooth-LoRA trains well at 1e-5 to 1e-3)" in errors[0]
    folder = inspect(out)
    assert folder.state == "interrupted" and not (out / lora.LORA_WEIGHTS).exists()
    assert [checkpoints.checkpoint_step(c) for c in folder.checkpoints] == list(range(1, step))
    for ckpt in folder.checkpoints:
        assert all(torch.isfinite(t).all() for t in weights(ckpt).values())
    if step > 1:
        strict = json.loads((out / HISTORY_PARTIAL).read_text(), parse_constant=pytest.fail)
        assert [h["step"] for h in strict] == list(range(1, step))


@pytest.mark.parametrize("where", ["lora", "state", "pipeline"])
def test_a_full_disk_is_one_line_naming_the_path_and_free_space(where, tmp_path, monkeypatch, capsys):
    """A write that fails with ENOSPC (injected): one line naming what was saved and the free space,
    exit 2, no temporary left, the last complete checkpoint kept."""
    out = tmp_path / "out"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_lora, real_state, real_fused = (
        saving.save_lora_weights,
        Accelerator.save_state,
        saving.save_fused_pipeline,
    )
    if where == "lora":  # the LoRA file of checkpoint-4
        monkeypatch.setattr(
            saving,
            "save_lora_weights",
            lambda folder, *a: full() if Path(folder).name == ".checkpoint-4.tmp" else real_lora(folder, *a),
        )
    elif where == "state":  # accelerate's files of checkpoint-4
        monkeypatch.setattr(
            Accelerator,
            "save_state",
            lambda self, path, *a, **k: (
                full() if Path(path).name == ".checkpoint-4.tmp" else real_state(self, path, *a, **k)
            ),
        )
    else:  # the fused pipeline, after the last checkpoint
        monkeypatch.setattr(
            saving,
            "save_fused_pipeline",
            lambda model, weights, dest: files.replace_dir_atomic(
                dest, lambda tmp: (Path(tmp, "unet").mkdir(parents=True), full())
            ),
        )
    assert real_fused is not None
    flags = config(out, save_as_full_pipeline=where == "pipeline").to_args()
    assert command.cli(flags) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    target = {"lora": out / "checkpoints" / "checkpoint-4", "state": out / "checkpoints" / "checkpoint-4",
              "pipeline": out / "pipeline"}[where]  # fmt: skip
    assert len(lines) == 1 and f" to {target} failed: No space left on device; " in lines[0], err[-2000:]
    assert " free on that disk. Fix: free space there" in lines[0] and "Traceback" not in err
    folder = inspect(out)
    kept = ["checkpoint-2", "checkpoint-4"] if where == "pipeline" else ["checkpoint-2"]
    assert [p.name for p in folder.checkpoints] == kept and folder.leftovers == []
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no temporary of any writer
    assert not (out / SUMMARY).exists() and not (out / "pipeline").exists()


# --- one run per folder ---------------------------------------------------------------------------


@pytest.fixture
def holder(tmp_path):
    """A second real process holding ``tmp_path/out``'s lock (killed with SIGKILL at the end)."""
    with lock_holder(tmp_path / "out") as proc:
        yield proc


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_process(holder, tmp_path, capsys):
    out = tmp_path / "out"
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert command.cli(config(out).to_args()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: output_dir {out} is in use by another run (pid {holder.pid} on host "
                          f"{socket.gethostname()}: ")  # fmt: skip
    assert "import sys, time from helpers.training.engine.folder import FolderLock" in err
    assert "Fix: wait for that run to end (or stop it), or choose another output_dir." in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before == [Path(LOCK_FILE)]


def test_a_killed_runs_lock_is_taken_over(holder, tmp_path):
    out = tmp_path / "out"
    holder.kill()
    holder.wait(timeout=60)
    assert (out / LOCK_FILE).exists() and FolderLock(out).holder() is None  # the file stays, the lock is free
    lock = FolderLock(out).acquire()
    try:
        assert lock.taken_over.startswith(f"pid {holder.pid} on host {socket.gethostname()}: ")
        assert FolderLock(out).holder() is None  # this process's own lock never refuses it
    finally:
        lock.release()
    assert not (out / LOCK_FILE).exists()
    result = training.train(config(out, max_train_steps=1))  # a real run starts in the folder
    assert result.summary["steps"] == 1 and not (out / LOCK_FILE).exists()

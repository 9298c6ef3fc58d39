"""Crash safety of the engine, table-driven: a run stopped at any point resumes to the same result.

Each case stops a 4-step run of the tiny model at one point, either by an exception raised there
(in this process) or by a real ``SIGKILL`` (in a ``python -m helpers.train`` subprocess, which
leaves the temporaries an exception would clean up). It then states what the output folder holds
(its state, its checkpoints, no half-written pipeline) and what the next run does: resumed with
``--resume_from_checkpoint latest`` or started again with ``--overwrite_output_dir`` it ends with
the uninterrupted run's embedding and history and no leftovers; started afresh it refuses.
The table is ``CASES``; the tests after it cover what is refused before any model loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file
from tiny_parts import (
    Crash,
    crash_when,
    lock_holder,
    one_thread,  # noqa: F401 (autouse: every run of this module on one thread)
    run_killed,
    tiny_settings,
)

from helpers.core import files
from helpers.core.errors import InputError
from helpers.core.outputs import (
    HISTORY,
    HISTORY_PARTIAL,
    LEARNED_EMBEDS,
    MODEL_INDEX,
    PIPELINE_PARTS,
    SUMMARY,
)
from helpers.training import models
from helpers.training import textual_inversion as ti
from helpers.training.config import TrainConfig
from helpers.training.engine import checkpoints, encoder_rows, loop
from helpers.training.engine.folder import check_output_dir, hold_output_dir

STEPS = 4


def settings(output_dir: Path, **overrides) -> dict:
    values = dict(max_train_steps=STEPS, checkpointing_steps=2, save_steps=100)
    return tiny_settings(output_dir, **{**values, **overrides})


def config(output_dir: Path, **overrides) -> TrainConfig:
    return TrainConfig(**settings(output_dir, **overrides))


def embeds(output_dir: Path) -> torch.Tensor:
    return load_file(Path(output_dir) / LEARNED_EMBEDS)["<dicoo>"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every case must end equal to."""
    return ti.train(config(tmp_path_factory.mktemp("reference") / "out"))


class Counter:
    """Counts the optimisation steps a run takes (``training_step`` calls)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = ti.training_step

        def counting(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(ti, "training_step", counting)


def named(path_name: str, position: int = 0):
    """``when`` for :func:`crash_when`: the argument at ``position`` is a path named ``path_name``."""
    return lambda *args, **kwargs: Path(args[position]).name == path_name


def final(path_name: str):
    """``when`` for :func:`crash_when`: the first argument is ``output_dir/path_name`` (not a checkpoint's)."""
    return lambda *args, **kwargs: (
        Path(args[0]).name == path_name and not Path(args[0]).parent.name.startswith(".")
    )


def in_folder(folder_name: str, position: int = 0):
    """``when`` for :func:`crash_when`: the argument at ``position`` is a path inside ``folder_name``."""
    return lambda *args, **kwargs: Path(args[position]).parent.name == folder_name


@dataclass(frozen=True)
class Case:
    """One crash point: where the run stops, what the folder then holds, what the next run does."""

    name: str
    crash: object  # (monkeypatch) -> None: installs the crash point in this process, or None
    checkpoints: list[str]  # the complete checkpoints left behind
    then: str = "resume"  # the next run: "resume" (latest) or "overwrite"
    trained_after: int = 0  # optimisation steps the next run takes
    overrides: dict = field(default_factory=dict)  # settings of both runs
    crashed: dict = field(default_factory=dict)  # settings of the crashed run only
    kill_at: str | None = None  # SIGKILL the run (a subprocess) as it swaps in the folder of this name
    leftovers: list[str] = field(default_factory=list)  # globs: the temporaries the crash leaves
    whole_pipeline: bool = False  # model_index.json left (and every part it names), else none


PIPELINE = {"save_as_full_pipeline": True}

CASES = [
    Case(
        "final embeddings write: resumed at the last step, only the outputs are written",
        lambda mp: crash_when(mp, encoder_rows, "save_learned_embeds", final(LEARNED_EMBEDS)),
        checkpoints=["checkpoint-2", "checkpoint-4"],
        trained_after=0,
    ),
    Case(
        "checkpoint-4 write, limit 1: checkpoint-2 survives (rotation waits for the new one)",
        lambda mp: crash_when(mp, encoder_rows, "save_learned_embeds", in_folder(".checkpoint-4.tmp")),
        checkpoints=["checkpoint-2"],
        trained_after=2,
        overrides={"checkpoints_total_limit": 1},  # the error removed the temporary on its way out
    ),
    Case(
        "accelerate's state write of checkpoint-4, limit 1: checkpoint-2 survives",
        lambda mp: crash_when(mp, Accelerator, "save_state", named(".checkpoint-4.tmp", position=1)),
        checkpoints=["checkpoint-2"],
        trained_after=2,
        overrides={"checkpoints_total_limit": 1},  # the error removed the temporary on its way out
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
        "final history write: resumed at the last step",
        lambda mp: crash_when(mp, loop, "write_json", named(HISTORY)),
        checkpoints=["checkpoint-2", "checkpoint-4"],
    ),
    Case(
        "summary write (everything else written): not finished, resume rewrites the outputs",
        lambda mp: crash_when(mp, loop, "write_json", named(SUMMARY)),
        checkpoints=["checkpoint-2", "checkpoint-4"],
        overrides=PIPELINE,
        whole_pipeline=True,
    ),
    Case(
        "validation samples of step 4: checkpoint-4 was saved before them",
        lambda mp: crash_when(mp, files, "replace_dir_atomic", named("step-4")),
        checkpoints=["checkpoint-2", "checkpoint-4"],
        overrides={
            "validation_prompt": "a photo of <dicoo>",
            "validation_steps": 2,
            "num_validation_images": 1,
        },
    ),
    Case(
        "after step 3: resumed from checkpoint-2, trains steps 3 and 4 again",
        lambda mp: crash_when(mp, ti.METHOD, "after_step", lambda run, step: step == 3),
        checkpoints=["checkpoint-2"],
        trained_after=2,
    ),
    Case(
        "pipeline write, unet moved in next: no model_index.json, resume finishes it",
        lambda mp: crash_when(mp, files, "move_dir_into_place", named("unet", position=1)),
        checkpoints=["checkpoint-2", "checkpoint-4"],
        overrides=PIPELINE,
    ),
    Case(
        "killed in the pipeline write (SIGKILL): its temporary and half-moved parts, resume cleans up",
        None,
        checkpoints=["checkpoint-2", "checkpoint-4"],
        overrides=PIPELINE,
        kill_at="unet",
        leftovers=[".pipeline.*.tmp"],
    ),
    Case(
        "killed in the checkpoint-4 swap (SIGKILL), limit 1: checkpoint-2 and a temporary remain",
        None,
        checkpoints=["checkpoint-2"],
        trained_after=2,
        overrides={"checkpoints_total_limit": 1},
        kill_at="checkpoint-4",
        leftovers=["checkpoints/.checkpoint-4.tmp"],
    ),
    Case(
        "killed in the pipeline write (SIGKILL), then --overwrite_output_dir: every part removed, trained again",
        None,
        checkpoints=["checkpoint-2", "checkpoint-4"],
        then="overwrite",
        trained_after=STEPS,
        crashed=PIPELINE,
        kill_at="text_encoder",
        leftovers=[".pipeline.*.tmp"],
    ),
    Case(
        "another run's folder (seed 1, stopped after step 3): --overwrite_output_dir starts over",
        lambda mp: crash_when(mp, ti.METHOD, "after_step", lambda run, step: step == 3),
        checkpoints=["checkpoint-2"],
        then="overwrite",
        trained_after=STEPS,
        crashed={"seed": 1},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name.split(":")[0] for c in CASES])
def test_crash_then_next_run(case: Case, reference, tmp_path, monkeypatch):
    out = tmp_path / "out"
    crashed = {**case.overrides, **case.crashed}
    if case.kill_at:
        run_killed("helpers.train", case.kill_at, _flags(settings(out, **crashed)))
    else:
        with monkeypatch.context() as mp:
            case.crash(mp)
            with pytest.raises(Crash):
                ti.train(config(out, **crashed))
    folder = ti.inspect_output_dir(out)
    assert folder.state == "interrupted" and not (out / SUMMARY).exists()  # never reported as finished
    assert (out / MODEL_INDEX).exists() == case.whole_pipeline  # a pipeline only if a whole one
    if case.whole_pipeline:
        index = json.loads((out / MODEL_INDEX).read_text())
        assert all((out / k).is_dir() for k, v in index.items() if isinstance(v, list) and v[0])
    assert [p.name for p in folder.checkpoints] == case.checkpoints
    assert sorted(folder.leftovers) == sorted(p for g in case.leftovers for p in out.glob(g))
    assert folder.settings["seed"] == case.crashed.get("seed", 3)

    # A fresh run into it refuses, naming the run and both choices, before any model loads.
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with monkeypatch.context() as mp:
        mp.setattr(models, "load_components", lambda *a, **k: pytest.fail("weights were loaded"))
        with pytest.raises(ti.TrainingInputError, match="holds an interrupted run") as err:
            ti.train(config(out, **case.overrides))
    message = str(err.value)
    assert f"seed {case.crashed.get('seed', 3)}" in message and "--overwrite_output_dir" in message
    assert (
        f"last checkpoint {case.checkpoints[-1]}" in message and "--resume_from_checkpoint latest" in message
    )
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing touched

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
    folder = ti.inspect_output_dir(out)
    assert folder.state == "finished" and folder.leftovers == [] and not (out / HISTORY_PARTIAL).exists()
    assert len(folder.checkpoints) <= (case.overrides.get("checkpoints_total_limit") or STEPS)
    assert all(ti.checkpoint_settings(c)["seed"] == 3 for c in folder.checkpoints)  # none of another run
    if case.overrides.get("save_as_full_pipeline"):
        pipe = StableDiffusionPipeline.from_pretrained(out)  # the guides' line: output_dir is the pipeline
        ids = pipe.tokenizer.convert_tokens_to_ids(["<dicoo>"])
        assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[ids], embeds(out))
    else:  # an earlier attempt's pipeline (or its parts) never outlives a run that saves none
        assert not any((out / name).exists() for name in (MODEL_INDEX, *PIPELINE_PARTS))


def test_a_checkpoint_past_the_last_step_is_refused_before_loading(reference, tmp_path, monkeypatch):
    """checkpoint-4 of a 4-step run resumed with max_train_steps=2: it holds rows trained for 4
    steps, so a 2-step run refuses it (naming the fixes), before any model loads."""
    monkeypatch.setattr(models, "load_components", lambda *a, **k: pytest.fail("weights were loaded"))
    ckpt = reference.output_dir / "checkpoints" / "checkpoint-4"
    with pytest.raises(ti.TrainingInputError, match="saved at step 4, after this run's last step") as err:
        ti.train(config(tmp_path / "out", max_train_steps=2, resume_from_checkpoint=str(ckpt)))
    assert "--max_train_steps 4 or more" in str(err.value) and "checkpoint-2" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "setting, value",
    [
        ("seed", 4),
        ("placeholder_token", "<other>"),
        ("num_vectors", 2),
        ("pretrained_model_name_or_path", "toyworld"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_run(setting, value, reference, tmp_path, monkeypatch):
    """Each setting that makes a checkpoint another run's is named, before any model loads."""
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("the model was resolved"))
    ckpt = reference.output_dir / "checkpoints" / "checkpoint-2"
    with pytest.raises(ti.TrainingInputError, match="belongs to another run") as err:
        ti.train(config(tmp_path / "out", resume_from_checkpoint=str(ckpt), **{setting: value}))
    theirs = getattr(config(tmp_path), setting)
    assert f"{setting} {theirs!r} there, {value!r} here" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_resume_into_a_folder_of_another_run_is_refused(reference, tmp_path, monkeypatch):
    """The issue's case: a folder holding another run (seed 1) is never continued with a checkpoint
    of this one; its history would mix two runs."""
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        crash_when(mp, ti.METHOD, "after_step", lambda run, step: step == 3)
        with pytest.raises(Crash):
            ti.train(config(out, seed=1))
    ckpt = reference.output_dir / "checkpoints" / "checkpoint-2"
    with pytest.raises(ti.TrainingInputError, match="holds another run than the one resumed") as err:
        ti.train(config(out, resume_from_checkpoint=str(ckpt)))
    assert "seed 1 there, 3 here" in str(err.value)
    with pytest.raises(ti.TrainingInputError, match="seed 1 there, 3 here"):
        ti.train(config(out, resume_from_checkpoint="latest"))  # its own checkpoint-2 is seed 1's


def test_overwrite_removes_every_engine_leftover_and_nothing_else(reference, tmp_path):
    """--overwrite_output_dir removes a killed run's files (hidden temporaries of every writer, a stale
    checkpoint and its temporary, samples, partial history, step embeddings, half-moved pipeline
    parts) and keeps what is not the engine's (the launcher's folder, a user's notes)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(reference.output_dir / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / "checkpoint-4").rename(out / "checkpoints" / "checkpoint-20")
    (out / "checkpoints" / ".checkpoint-22.tmp").mkdir()
    for name in (
        ".learned_embeds.123-0a1b2c3d.tmp.safetensors",
        ".history.json.123-0a1b2c3d.tmp.partial",
        ".run_summary.77-deadbeef.tmp.json",
        ".train_config.5-00000000.tmp.yaml",
        "history.json.partial",
        "learned_embeds-steps-20.safetensors",
        "train_config.yaml",
        "notes.txt",
    ):
        (out / name).write_text("x")
    for folder in (
        ".pipeline.abc123",
        ".unet.9-12345678.old",
        "unet",
        "text_encoder",
        "samples/step-20",
        "launch/status",
    ):
        (out / folder).mkdir(parents=True)
    (out / "launch" / "status" / "rank0.json").write_text("{}")
    folder = ti.inspect_output_dir(out)
    assert folder.state == "interrupted" and len(folder.leftovers) == 7
    result = ti.train(config(out, overwrite_output_dir=True))
    assert torch.equal(embeds(out), embeds(reference.output_dir)) and result.summary["steps"] == STEPS
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints",
        "history.json",
        "launch",
        "learned_embeds.safetensors",
        "logs",  # the new run's TensorBoard events (--report_to tensorboard, diffusers' default)
        "notes.txt",
        "run_summary.json",
        "train_config.yaml",
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "notes.txt").read_text() == "x" and (out / "launch" / "status" / "rank0.json").is_file()


@pytest.mark.parametrize("kind", ["file", "model"])
def test_an_output_dir_that_cannot_hold_a_run_is_refused_before_loading(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: pytest.fail("the model was resolved"))
    out = tmp_path / "out"
    if kind == "file":  # the settings' own check may find it first: either way one input error
        out.write_text("x")
        match = "is a file"
    else:
        out.mkdir()
        (out / "model_index.json").write_text("{}")
        match = "holds a diffusers model .* that no training run wrote"
    with pytest.raises(InputError, match=match):
        ti.train(config(out, overwrite_output_dir=True))
    assert out.is_file() or sorted(p.name for p in out.iterdir()) == ["model_index.json"]


def _flags(values: dict) -> list[str]:
    """``helpers.train`` flags of settings (booleans as ``--x`` / ``--no-x``)."""
    flags = []
    for key, value in values.items():
        if isinstance(value, bool):
            flags.append(f"--{key}" if value else f"--no-{key}")
        elif value is not None:
            flags += [f"--{key}", str(value)]
    return flags


def test_a_diverging_run_stops_at_once_with_one_line_and_exit_2(tmp_path, capsys):
    """--learning_rate 1e30: the step whose loss (or rows) stop being finite ends the run with one
    line naming the step and the likely cause; checkpoints before it hold finite rows, nothing is
    saved as a finished run, and what was written is strict JSON."""
    from helpers import train as train_module

    out = tmp_path / "out"
    flags = _flags(settings(out, learning_rate=1e30, checkpointing_steps=1))
    assert train_module.cli(flags) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: training diverged at step ")
    step = int(errors[0].split("at step ")[1].split(":")[0])
    assert 1 <= step <= STEPS and "is not finite" in errors[0]
    assert "the learning rate 1e+30 is too high" in errors[0] and "--overwrite_output_dir" in errors[0]
    folder = ti.inspect_output_dir(out)
    assert folder.state == "interrupted" and not (out / LEARNED_EMBEDS).exists()
    assert [ti.checkpoint_step(c) for c in folder.checkpoints] == list(range(1, step))
    assert all(torch.isfinite(load_file(c / LEARNED_EMBEDS)["<dicoo>"]).all() for c in folder.checkpoints)
    if step > 1:
        strict = json.loads((out / HISTORY_PARTIAL).read_text(), parse_constant=pytest.fail)
        assert [h["step"] for h in strict] == list(range(1, step))


def test_json_records_are_strict(tmp_path):
    path = tmp_path / "summary.json"
    with pytest.raises(ValueError):
        ti.write_json(path, {"final_loss": float("nan")})
    assert not path.exists() and list(tmp_path.iterdir()) == []
    ti.write_json(path, {"final_loss": None, "steps": 4})
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"final_loss": None, "steps": 4}


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a planted checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("damage", ["planted", "truncated"])
def test_a_damaged_or_planted_checkpoint_file_is_one_line_and_runs_nothing(damage, reference, tmp_path):
    """A checkpoint whose ``optimizer.bin`` was replaced by a code-running pickle, or cut short:
    resuming it is one line naming the checkpoint and the fix (exit 2), and the payload never runs."""
    import shutil

    out, marker = tmp_path / "out", tmp_path / "payload-ran"
    shutil.copytree(reference.output_dir, out)
    optimizer = out / "checkpoints" / "checkpoint-4" / "optimizer.bin"
    if damage == "planted":
        torch.save({"state": _Payload(marker)}, optimizer)
    else:
        optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    flags = _flags(settings(out, max_train_steps=6, resume_from_checkpoint="latest"))
    result = subprocess.run([sys.executable, "-m", "helpers.train", *flags], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: checkpoint {out / 'checkpoints' / 'checkpoint-4'} cannot be loaded: ")
    assert line.endswith(
        "Fix: remove that folder to resume from the checkpoint before it, or start in a new --output_dir"
    )
    assert not marker.exists()


def test_ctrl_c_is_one_line_saying_how_to_resume(tmp_path):
    """Issue 37: Ctrl-C in helpers.train printed a 113-line traceback. A real SIGINT to a training
    process now ends it with one line naming the resume flag (exit 130), its checkpoints kept."""
    import time

    out = tmp_path / "out"
    flags = _flags(settings(out, max_train_steps=500, checkpointing_steps=2))
    # Ctrl-C as a terminal delivers it. A shell's background job (`make test &`, some CI runners)
    # starts with SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so the
    # trainer starts with SIGINT's default restored, as in a terminal.
    proc = subprocess.Popen([sys.executable, "-m", "helpers.train", *flags], cwd=tmp_path, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not checkpoints.list_checkpoints(out) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert checkpoints.list_checkpoints(out), "no checkpoint within 300 s"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == checkpoints.INTERRUPTED_EXIT, err[-2000:]
    assert err.rstrip().splitlines()[-1] == checkpoints.INTERRUPTED and "Traceback" not in err
    assert ti.inspect_output_dir(out).state == "interrupted" and checkpoints.list_checkpoints(out)


def test_ctrl_c_before_the_first_checkpoint_says_start_over_and_the_same_command_is_accepted(tmp_path):
    """Issue 48: Ctrl-C before any checkpoint said to resume from one (none existed; that command
    then failed) and the folder refused the same command again. Now the line says the run must start
    over, and running the same command again is accepted: the stopped run's files are removed."""
    import time

    from helpers.training.config import parse_args

    out = tmp_path / "out"
    flags = _flags(settings(out, max_train_steps=500, checkpointing_steps=400))
    proc = subprocess.Popen([sys.executable, "-m", "helpers.train", *flags], cwd=tmp_path, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while (
            not (out / "train_config.yaml").exists() and time.monotonic() < deadline and proc.poll() is None
        ):
            time.sleep(0.2)
        assert (out / "train_config.yaml").exists(), "no settings written within 300 s"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == checkpoints.INTERRUPTED_EXIT, err[-2000:]
    assert err.rstrip().splitlines()[-1] == checkpoints.START_OVER and "Traceback" not in err
    assert ti.inspect_output_dir(out).state == "interrupted" and not checkpoints.list_checkpoints(out)
    with pytest.raises(ti.TrainingInputError, match="holds an interrupted run .*no checkpoint"):
        check_output_dir(parse_args([*flags, "--seed", "4"]))  # another command: still that run's folder
    same = parse_args(flags)
    assert check_output_dir(same).state == "interrupted"
    with hold_output_dir(same):
        assert sorted(p.name for p in out.iterdir()) == [".output_dir.lock"]  # ready to start over


def test_a_second_train_into_a_folder_in_use_is_refused_naming_the_process(tmp_path):
    """Two real processes: while one holds output_dir's lock, ``python -m helpers.train`` into it is
    one line naming that process (exit 2, nothing written); once it is killed, the next run takes over."""
    import socket

    out = tmp_path / "out"
    with lock_holder(out) as holder:
        flags = _flags(settings(out, max_train_steps=1))
        refused = subprocess.run([sys.executable, "-m", "helpers.train", *flags], cwd=tmp_path, text=True,
                                 capture_output=True, timeout=300)  # fmt: skip
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert line.startswith(
        f"error: output_dir {out} is in use by another run (pid {holder.pid} on host {socket.gethostname()}: "
    )
    assert sorted(p.name for p in out.iterdir()) == [".output_dir.lock"]  # the holder's, untouched
    result = ti.train(config(out, max_train_steps=1))  # the killed holder's lock is taken over
    assert result.summary["steps"] == 1 and not (out / ".output_dir.lock").exists()

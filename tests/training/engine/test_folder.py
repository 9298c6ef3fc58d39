"""helpers.training.engine.folder: an output folder's state (empty, interrupted, finished), what
``--overwrite_output_dir`` and a restart remove, and the lock that keeps a second run out."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.ranks import status
from helpers.training.engine import TrainingInputError
from helpers.training.engine import folder as f

SETTINGS = {
    "seed": 3,
    "pretrained_model_name_or_path": "tiny",
    "placeholder_token": "<dicoo>",
    "num_vectors": 1,
    "max_train_steps": 6,
}


@pytest.fixture(autouse=True)
def main_process(monkeypatch):
    """Tests run as a job's main process unless they set a rank themselves."""
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)


def config(out: Path, **overrides) -> SimpleNamespace:
    """What the folder functions read of a ``TrainConfig``."""
    values = dict(SETTINGS, output_dir=str(out), resume_from_checkpoint=None, overwrite_output_dir=False)
    return SimpleNamespace(**{**values, **overrides})


def write_run(out: Path, checkpoints=(), summary=False, settings=SETTINGS) -> Path:
    """A run's folder as the engine leaves it: settings, complete checkpoints, maybe the summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items()))
    for step in checkpoints:
        ckpt = out / "checkpoints" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "random_states_0.pkl").write_bytes(b"rng")
    if summary:
        (out / "run_summary.json").write_text("{}")
    return out


def names(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


# --- the state of a folder -------------------------------------------------------------------------


def test_a_folder_is_empty_until_a_run_writes_and_finished_once_the_summary_exists(tmp_path):
    out = tmp_path / "out"
    missing = f.inspect_output_dir(out)
    assert (missing.state, missing.settings, missing.checkpoints, missing.owned) == ("empty", {}, [], [])
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert f.inspect_output_dir(out).state == "empty"  # a file no run writes is not a run
    write_run(out, checkpoints=[4, 2])
    interrupted = f.inspect_output_dir(out)
    assert interrupted.state == "interrupted" and interrupted.settings == SETTINGS
    assert interrupted.checkpoints == [out / "checkpoints/checkpoint-2", out / "checkpoints/checkpoint-4"]
    assert interrupted.owned == [out / "checkpoints", out / "train_config.yaml"]
    assert interrupted.describe() == (
        "an interrupted run (seed 3, pretrained_model_name_or_path 'tiny', placeholder_token '<dicoo>', "
        "num_vectors 1, max_train_steps 6, last checkpoint checkpoint-4)"
    )
    (out / "run_summary.json").write_text("{}")
    finished = f.inspect_output_dir(out)
    assert finished.state == "finished" and finished.describe().startswith("a finished run (seed 3, ")


def test_an_interrupted_run_without_a_checkpoint_says_so():
    folder = f.OutputFolder(Path("x"), f.INTERRUPTED, {"seed": 5}, [], [Path("x/train_config.yaml")], [])
    assert folder.describe() == "an interrupted run (seed 5, no checkpoint)"


def test_hidden_temporaries_of_the_run_are_leftovers_and_other_files_are_not(tmp_path):
    out = write_run(tmp_path / "out", checkpoints=[2])
    leftovers = [
        ".learned_embeds-steps-4.77-0badcafe.tmp.safetensors",  # a step file being written
        ".learned_embeds.77-0badcafe.tmp.safetensors",
        ".pipeline.77-0badcafe.tmp",  # saving.PipelineCopy's folder
        ".samples.77-0badcafe.old",  # a folder swapped out
        "checkpoints/.checkpoint-4.tmp",  # checkpoints.save_checkpoint's folder
        "samples/.step-4.77-0badcafe.tmp",
    ]
    for name in leftovers:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).mkdir() if name.endswith((".tmp", ".old")) else (out / name).write_bytes(b"half")
    (out / ".notes.txt").write_text("the user's")  # hidden, but not named after anything the run writes
    folder = f.inspect_output_dir(out)
    assert folder.leftovers == [out / name for name in leftovers]
    assert folder.state == "interrupted" and folder.checkpoints == [out / "checkpoints/checkpoint-2"]


def test_a_model_folder_no_run_wrote_is_foreign_and_refused(tmp_path):
    out = tmp_path / "model"
    (out / "unet").mkdir(parents=True)
    (out / "model_index.json").write_text("{}")
    folder = f.inspect_output_dir(out)
    assert folder.foreign and folder.state == "empty" and folder.owned == []  # its unet/ is not the run's
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(config(out, overwrite_output_dir=True))
    assert str(err.value) == (
        f"output_dir {out} holds a diffusers model (model_index.json) that no training run wrote. "
        f"Fix: choose another output_dir."
    )


# --- what a new run accepts ------------------------------------------------------------------------


def test_a_finished_run_is_refused_unless_overwritten_or_resumed(tmp_path):
    out = write_run(tmp_path / "out", checkpoints=[6], summary=True)
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(config(out))
    assert str(err.value) == (
        f"output_dir {out} already holds a finished run (run_summary.json). "
        f"Fix: choose another output_dir, or pass --overwrite_output_dir to replace it."
    )
    assert f.check_output_dir(config(out, overwrite_output_dir=True)).state == "finished"
    assert f.check_output_dir(config(out, resume_from_checkpoint="latest")).state == "finished"


def test_an_interrupted_run_is_refused_with_resume_advice_only_if_it_has_a_checkpoint(tmp_path):
    with_ckpt = write_run(tmp_path / "a", checkpoints=[2])
    without = write_run(tmp_path / "b")
    with pytest.raises(
        TrainingInputError,
        match=r"Fix: resume it with --resume_from_checkpoint latest, or pass "
        r"--overwrite_output_dir to delete it",
    ):
        f.check_output_dir(config(with_ckpt))
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(config(without))
    assert str(err.value).endswith(
        "(seed 3, pretrained_model_name_or_path 'tiny', placeholder_token '<dicoo>', num_vectors 1, "
        "max_train_steps 6, no checkpoint). Fix: it saved no checkpoint to resume: pass --overwrite_output_dir "
        "to delete it and start again, or choose another output_dir."
    )


def test_resuming_another_runs_folder_names_each_differing_setting(tmp_path):
    out = write_run(tmp_path / "out", checkpoints=[2])
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(config(out, resume_from_checkpoint="latest", seed=4, placeholder_token="<cat>"))
    assert str(err.value) == (
        f"output_dir {out} holds another run than the one resumed (seed 3 there, 4 here; placeholder_token "
        f"'<dicoo>' there, '<cat>' here). Fix: resume with that run's settings (its train_config.yaml), or "
        f"choose another output_dir."
    )
    # max_train_steps is not part of a run's identity: a resume may train longer
    assert f.check_output_dir(config(out, resume_from_checkpoint="latest", max_train_steps=10)).checkpoints


def test_the_same_model_folder_spelled_differently_is_the_same_run(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    saved = {"pretrained_model_name_or_path": str(model)}
    spelled = SimpleNamespace(pretrained_model_name_or_path=str(tmp_path / "model" / ".." / "model"))
    assert f.settings_differences(saved, spelled) == []
    other = SimpleNamespace(pretrained_model_name_or_path="tiny")
    assert f.settings_differences(saved, other) == [
        f"pretrained_model_name_or_path {str(model)!r} there, 'tiny' here"
    ]


def test_a_checkpoint_is_matched_by_its_own_settings_else_its_run_folders(tmp_path):
    out = write_run(tmp_path / "out", checkpoints=[2, 4])
    ckpt2, ckpt4 = out / "checkpoints/checkpoint-2", out / "checkpoints/checkpoint-4"
    (ckpt4 / "train_config.yaml").write_text("seed: 9\n")
    assert f.checkpoint_settings(ckpt2) == SETTINGS  # no copy of its own: the run folder's
    assert f.checkpoint_settings(ckpt4) == {"seed": 9}
    f.check_checkpoint_matches(ckpt2, config(out))
    with pytest.raises(TrainingInputError) as err:
        f.check_checkpoint_matches(ckpt4, config(out))
    assert str(err.value).startswith(
        f"resume_from_checkpoint {ckpt4} belongs to another run (seed 9 there, 3 here). "
    )


def test_a_file_or_a_read_only_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainingInputError, match=r"is a file, not a folder"):
        f.check_output_dir(config(tmp_path / "file"))
    locked = tmp_path / "ro"
    locked.mkdir()
    asked = []

    def access(path, mode):  # a read-only folder, even for root (who may write anywhere)
        asked.append(Path(path))
        return Path(path) != locked

    monkeypatch.setattr(f.os, "access", access)
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(config(locked / "new" / "out"))
    assert asked == [locked]  # the nearest folder that exists is the one that must be writable
    assert str(err.value) == (
        f"output_dir {locked / 'new' / 'out'}: {locked} is not writable. Fix: choose a folder you can write to."
    )


# --- what overwriting and restarting remove --------------------------------------------------------


def _full_folder(out: Path) -> Path:
    """A run with every kind of file the engine writes, a temporary of each kind, and the user's files."""
    write_run(out, checkpoints=[2])
    for name in (
        "learned_embeds.safetensors",
        "learned_embeds-steps-2.safetensors",
        "history.json.partial",
        "model_index.json",
        "notes.txt",
        ".notes.txt",
        ".learned_embeds.77-0badcafe.tmp.safetensors",
    ):
        (out / name).write_text("x")
    for name in (
        "samples/step-2",
        "logs",
        "unet",
        "text_encoder",
        "my_images",
        ".pipeline.77-0badcafe.tmp",
        "checkpoints/.checkpoint-4.tmp",
    ):
        (out / name).mkdir(parents=True)
    return out


def test_overwrite_removes_what_the_run_wrote_and_its_temporaries_and_nothing_else(tmp_path):
    out = _full_folder(tmp_path / "out")
    removed = f.clear_run(out)
    assert {p.relative_to(out).as_posix() for p in removed} == {
        ".learned_embeds.77-0badcafe.tmp.safetensors",
        ".pipeline.77-0badcafe.tmp",
        "checkpoints/.checkpoint-4.tmp",
        "checkpoints",
        "history.json.partial",
        "learned_embeds.safetensors",
        "learned_embeds-steps-2.safetensors",
        "logs",
        "model_index.json",
        "samples",
        "text_encoder",
        "train_config.yaml",
        "unet",
    }
    assert names(out) == {"notes.txt", ".notes.txt", "my_images"}
    assert f.inspect_output_dir(out).state == "empty"


def test_a_restart_removes_temporaries_and_a_half_moved_pipeline_only(tmp_path):
    out = _full_folder(tmp_path / "out")
    f.clear_leftovers(out)  # the pipeline is whole (model_index.json): its parts stay
    assert {"unet", "text_encoder", "model_index.json"} <= names(out)
    assert not {".pipeline.77-0badcafe.tmp", "checkpoints/.checkpoint-4.tmp"} & names(out)
    (out / "model_index.json").unlink()  # a pipeline whose move never finished
    assert sorted(p.name for p in f.clear_leftovers(out)) == ["text_encoder", "unet"]
    assert names(out) >= {
        "learned_embeds.safetensors",
        "checkpoints/checkpoint-2",
        "samples/step-2",
        "notes.txt",
    }
    assert not {"unet", "text_encoder"} & names(out)


# --- one run per folder ----------------------------------------------------------------------------


def _hold_like_another_process(out: Path, details: str) -> int:
    """Hold ``out``'s lock on a file descriptor of its own, as another run would (not through FolderLock)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / f.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, details.encode())
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_held_folder_is_refused_naming_its_holder_and_a_freed_one_is_taken_over(tmp_path):
    out = tmp_path / "out"
    other = {"pid": 4242, "host": "node7", "command": "python -m helpers.train --seed 3"}
    fd = _hold_like_another_process(out, json.dumps(other))
    try:
        assert f.FolderLock(out).holder() == "pid 4242 on host node7: python -m helpers.train --seed 3"
        message = (
            f"output_dir {out} is in use by another run (pid 4242 on host node7: python -m helpers.train "
            f"--seed 3). Fix: wait for that run to end (or stop it), or choose another output_dir."
        )
        with pytest.raises(TrainingInputError) as err:
            f.check_output_dir(config(out))
        assert str(err.value) == message
        with pytest.raises(TrainingInputError) as err:
            f.FolderLock(out).acquire()
        assert str(err.value) == message
    finally:
        os.close(fd)  # the other run ends (however it ends, the kernel frees the lock): its file stays
    assert (out / f.LOCK_FILE).exists() and f.FolderLock(out).holder() is None
    lock = f.FolderLock(out).acquire()
    try:
        assert lock.taken_over == "pid 4242 on host node7: python -m helpers.train --seed 3"
        mine = json.loads((out / f.LOCK_FILE).read_text())
        assert (mine["pid"], mine["host"]) == (os.getpid(), socket.gethostname())
        assert f.FolderLock(out).holder() is None  # this process's own lock never refuses its checks
        with pytest.raises(TrainingInputError, match=rf"in use by another run \(pid {os.getpid()} on host "):
            f.FolderLock(out).acquire()  # but a second run in this process is refused
    finally:
        lock.release()
    assert not (out / f.LOCK_FILE).exists() and f.FolderLock(out).holder() is None


def test_a_holder_that_left_no_details_is_still_refused(tmp_path):
    fd = _hold_like_another_process(tmp_path / "out", "not json")
    try:
        assert f.FolderLock(tmp_path / "out").holder() == "a process that left no details"
    finally:
        os.close(fd)


def test_the_lock_is_held_for_the_block_and_freed_when_the_check_inside_fails(tmp_path):
    fresh = tmp_path / "fresh"
    with f.hold_output_dir(config(fresh)) as lock:
        assert json.loads((fresh / f.LOCK_FILE).read_text())["pid"] == os.getpid()
        assert lock.path == fresh / f.LOCK_FILE
    assert not (fresh / f.LOCK_FILE).exists()
    done = write_run(tmp_path / "done", summary=True)
    with pytest.raises(TrainingInputError, match="already holds a finished run"):
        with f.hold_output_dir(config(done)):
            pytest.fail("the block ran although the folder holds a finished run")
    assert not (done / f.LOCK_FILE).exists()


def test_other_ranks_neither_take_nor_check_the_lock(tmp_path, monkeypatch):
    out = tmp_path / "out"
    fd = _hold_like_another_process(out, "{}")  # e.g. the job's main process
    try:
        monkeypatch.setenv("RANK", "1")
        assert not f.is_main_process()
        assert f.check_output_dir(config(out)).state == "empty"  # the main process's lock is no refusal
        with f.hold_output_dir(config(out)) as lock:
            assert lock is None
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, None),
        ({"RANK": "2"}, 2),
        ({"PMI_RANK": "3"}, 3),
        ({"OMPI_COMM_WORLD_RANK": "0"}, 0),
        ({"RANK": "", "PMI_RANK": "5"}, 5),  # an empty or non-numeric variable is not a rank
        ({"RANK": "x"}, None),
        ({"RANK": "1", "PMI_RANK": "4"}, 1),  # torchrun's RANK first
    ],
)
def test_the_rank_comes_from_the_launchers_variables(env, rank, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert status.rank_from_env() == rank
    assert f.is_main_process() is (rank in (None, 0))


# --- planted links: the lock and every name a run writes -------------------------------------------


def _plant(out: Path, name: str, kind: str, victim: Path) -> Path:
    """``out/name`` as someone else left it: a link to ``victim``, a dangling link, a folder or a FIFO."""
    path = out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        path.symlink_to(victim)
    elif kind == "dangling link":
        path.symlink_to(victim.parent / "not-there-yet")
    elif kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["link", "dangling link", "folder", "fifo"])
def test_a_lock_path_that_is_not_a_plain_file_is_refused_and_never_written(tmp_path, kind):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    path = _plant(out, f.LOCK_FILE, kind, victim)
    what = {"link": f"a symbolic link (to {victim})", "dangling link": "a symbolic link (to "
            f"{tmp_path / 'not-there-yet'})", "folder": "a folder", "fifo": "not a regular file"}[kind]  # fmt: skip
    message = (
        f"output_dir {out}: {f.LOCK_FILE} is {what}, where a run keeps its lock (a plain file it creates; a "
        f"link could make it overwrite another file). Fix: remove it (rm -r {path}), or choose another output_dir."
    )
    for attempt in (lambda: f.check_output_dir(config(out)), lambda: f.FolderLock(out).acquire()):
        with pytest.raises(TrainingInputError) as err:
            attempt()
        assert str(err.value) == message
    assert victim.read_text() == "precious" and not (tmp_path / "not-there-yet").exists()
    assert names(out) == {f.LOCK_FILE}


@pytest.mark.parametrize(
    "name",
    ["train_config.yaml", "history.json", "history.json.partial", "learned_embeds.safetensors", "run_summary.json",
     "model_index.json", "checkpoints", "samples", "logs", "unet", "checkpoints/checkpoint-2",
     "checkpoints/checkpoint-2/optimizer.bin", "checkpoints/.checkpoint-4.tmp", "samples/step-4-0.png",
     "logs/textual_inversion/events.out.tfevents.1.host.1.0"],
)  # fmt: skip
def test_a_link_where_the_run_writes_is_refused_before_anything_is_written(tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = write_run(tmp_path / "out", checkpoints=[2])
    (out / "samples").mkdir()
    (out / "logs" / "textual_inversion").mkdir(parents=True)
    if (out / name).exists():
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    link = _plant(out, name, "link", victim)
    before = names(out)
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(config(out, resume_from_checkpoint="latest"))
    assert str(err.value) == (
        f"output_dir {out}: {name} is a symbolic link (to {victim}); a run writes its own files and never "
        f"through a link. Fix: remove the link (rm {link}), or choose another output_dir (output_dir itself "
        f"may be a link)."
    )
    assert victim.read_text() == "precious" and names(out) == before


def test_the_output_folder_itself_may_be_a_link_and_a_users_own_links_stay(tmp_path):
    real = write_run(tmp_path / "disk" / "run")
    (real / "notes.txt").symlink_to(tmp_path / "disk")  # not a name the run writes
    (tmp_path / "out").symlink_to(real)
    assert f.check_output_dir(config(tmp_path / "out", overwrite_output_dir=True)).state == f.INTERRUPTED


def test_leftovers_are_never_looked_for_through_a_linked_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / ".git").mkdir(parents=True)
    out = write_run(tmp_path / "out")
    (out / "checkpoints").symlink_to(elsewhere)
    assert f.inspect_output_dir(out).leftovers == []
    f.clear_run(out)
    assert (elsewhere / ".git").is_dir() and not (out / "checkpoints").exists()


# --- a run stopped before its first checkpoint: the same command starts over -----------------------


@pytest.mark.parametrize("trainer", ["textual_inversion", "dreambooth"])
def test_the_same_command_restarts_a_run_stopped_before_its_first_checkpoint(tmp_path, trainer):
    """Ctrl-C, TERM or a kill before any checkpoint leaves only the settings (and samples, logs): the
    same command is accepted and the old files go under the lock; another command is still refused."""
    from helpers.dreambooth.config import DreamBoothConfig
    from helpers.dreambooth.saving import DREAMBOOTH
    from helpers.training.config import TrainConfig
    from helpers.training.data import sample_concept_dir

    out = tmp_path / "out"
    if trainer == "dreambooth":
        layout, make = (
            DREAMBOOTH,
            lambda **kw: DreamBoothConfig(
                instance_data_dir=str(sample_concept_dir()),
                instance_prompt="a sks toy",
                output_dir=str(out),
                **kw,
            ),
        )
    else:
        layout, make = f.TEXTUAL_INVERSION, lambda **kw: TrainConfig(output_dir=str(out), **kw)
    stopped = make(learning_rate=1e-3)
    out.mkdir()
    stopped.to_yaml(out / layout.config_file)
    (out / "samples").mkdir()
    (out / "samples" / "step-2-0.png").write_bytes(b"png")
    (out / "notes.txt").write_text("mine")
    folder = f.inspect_output_dir(out, layout)
    assert folder.state == f.INTERRUPTED and f.starts_over(folder, make(learning_rate=1e-3))
    assert not f.starts_over(folder, make(learning_rate=2e-3))
    with pytest.raises(
        TrainingInputError, match=r"it saved no checkpoint to resume: pass --overwrite_output_dir"
    ):
        f.check_output_dir(make(learning_rate=2e-3), layout)
    again = make(learning_rate=1e-3)
    assert f.check_output_dir(again, layout).state == f.INTERRUPTED
    with f.hold_output_dir(again, layout):
        assert names(out) == {f.LOCK_FILE, "notes.txt"}
    assert not f.starts_over(f.inspect_output_dir(out, layout), again)  # nothing left to restart


def test_a_stopped_run_with_a_checkpoint_is_resumed_not_restarted(tmp_path):
    from helpers.training.config import TrainConfig

    out = tmp_path / "out"
    run = TrainConfig(output_dir=str(out))
    write_run(out, checkpoints=[2])
    run.to_yaml(out / "train_config.yaml")
    assert not f.starts_over(f.inspect_output_dir(out), run)
    with pytest.raises(TrainingInputError, match="resume it with --resume_from_checkpoint latest"):
        f.check_output_dir(run)


# --- logging_dir, checked with the output folder ---------------------------------------------------


def test_logging_dir_is_checked_with_the_folder_only_when_tensorboard_writes_it(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    bad = config(tmp_path / "out", report_to="tensorboard", logging_dir=str(tmp_path / "notes.txt"))
    with pytest.raises(TrainingInputError) as err:
        f.check_output_dir(bad)
    assert str(err.value) == (
        f"logging_dir {tmp_path / 'notes.txt'} is a file: TensorBoard writes a folder there. Fix: pass another "
        "--logging_dir (a folder name, relative to output_dir), or --report_to none."
    )
    assert not (tmp_path / "out").exists()
    f.check_output_dir(config(tmp_path / "out", report_to="none", logging_dir=str(tmp_path / "notes.txt")))
    assert (
        f.check_output_dir(config(tmp_path / "out", report_to="tensorboard", logging_dir="logs")).state
        == f.EMPTY
    )

"""helpers.training.engine.checkpoints: naming, finding and resolving ``checkpoint-N``, saving one
whole before the oldest are rotated out (``checkpoints_total_limit``), and the resume checks."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.training.engine import TrainingInputError
from helpers.training.engine import checkpoints as ck
from helpers.training.engine.saving import StorageError


def make_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint folder; a complete one holds rank 0's random states, as accelerate writes them."""
    path = out / "checkpoints" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "random_states_0.pkl").write_bytes(b"rng")
    return path


class FakeAccelerator:
    """The accelerator's side of a save, on one process: ``save_state`` fills the folder it is given."""

    is_main_process = True

    def __init__(self, events: list):
        self.events = events

    def wait_for_everyone(self):
        self.events.append("wait")

    def save_state(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "random_states_0.pkl").write_bytes(b"rng")
        (Path(path) / "optimizer.bin").write_bytes(b"adam")
        self.events.append(("save_state", Path(path).name))


def settings(limit: int | None) -> SimpleNamespace:
    return SimpleNamespace(
        checkpoints_total_limit=limit, to_yaml=lambda path: Path(path).write_text("seed: 3\n")
    )


def test_a_checkpoint_is_named_by_its_step():
    assert ck.checkpoint_step(Path("out/checkpoints/checkpoint-12")) == 12
    assert ck.checkpoint_step(Path("checkpoint-500")) == 500


def test_only_complete_checkpoints_are_listed_in_step_order(tmp_path):
    for step in (10, 2, 30):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 40, complete=False)  # no random_states_0.pkl: not made by a save
    (tmp_path / "checkpoints" / ".checkpoint-50.tmp").mkdir()
    (tmp_path / "checkpoints" / "checkpoint-x").mkdir()
    found = ck.list_checkpoints(tmp_path)
    assert [p.name for p in found] == ["checkpoint-2", "checkpoint-10", "checkpoint-30"]  # 10 after 2
    assert ck.is_complete(found[0]) and not ck.is_complete(tmp_path / "checkpoints" / "checkpoint-40")
    assert ck.list_checkpoints(tmp_path / "missing") == []


def test_resume_latest_picks_the_highest_step_and_a_named_one_must_be_complete(tmp_path):
    for step in (9, 10):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 11, complete=False)
    assert ck.resolve_checkpoint(tmp_path, "latest") == tmp_path / "checkpoints" / "checkpoint-10"
    named = tmp_path / "checkpoints" / "checkpoint-9"
    assert ck.resolve_checkpoint(tmp_path, str(named)) == named
    with pytest.raises(TrainingInputError, match=r"is not a complete checkpoint \(no random_states_0.pkl\)"):
        ck.resolve_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "checkpoint-11"))
    with pytest.raises(
        TrainingInputError, match=r"is not a checkpoint folder \(…/checkpoints/checkpoint-N\)"
    ):
        ck.resolve_checkpoint(tmp_path, str(tmp_path / "checkpoints"))
    with pytest.raises(TrainingInputError) as err:
        ck.resolve_checkpoint(tmp_path / "new", "latest")
    assert str(err.value) == (
        f"resume_from_checkpoint='latest' but {tmp_path / 'new' / 'checkpoints'} holds no checkpoint. "
        f"Fix: start without resume_from_checkpoint, or point it at a checkpoint folder."
    )


def test_the_new_checkpoint_is_whole_before_the_oldest_are_deleted(tmp_path, monkeypatch):
    """Saving step 4 with a limit of 2 over checkpoints 1-3: the new one is filled under a hidden
    name while 1-3 all exist, renamed into place, and only then are 1 and 2 renamed aside and deleted."""
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    events, renames = [], []
    real_rename = os.rename

    def rename(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)

    def write_weights(folder: Path):
        assert folder == tmp_path / "checkpoints" / ".checkpoint-4.tmp"
        assert [p.name for p in ck.list_checkpoints(tmp_path)] == [
            "checkpoint-1",
            "checkpoint-2",
            "checkpoint-3",
        ]
        (folder / "learned_embeds.safetensors").write_bytes(b"rows")
        events.append("weights")

    history = [{"step": 1, "loss": 0.5}, {"step": 4, "loss": 0.25}]
    final = ck.save_checkpoint(FakeAccelerator(events), settings(2), tmp_path, 4, history, write_weights)
    assert final == tmp_path / "checkpoints" / "checkpoint-4"
    assert events == ["wait", ("save_state", ".checkpoint-4.tmp"), "wait", "weights", "wait"]
    assert renames == [
        (".checkpoint-4.tmp", "checkpoint-4"),
        ("checkpoint-1", ".checkpoint-1.deleting"),
        ("checkpoint-2", ".checkpoint-2.deleting"),
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert sorted(p.name for p in final.iterdir()) == [
        "learned_embeds.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "train_config.yaml",
    ]
    assert (final / "train_config.yaml").read_text() == "seed: 3\n"
    assert json.loads((tmp_path / "history.json.partial").read_text()) == history


def test_a_killed_attempts_temporary_is_replaced_and_no_limit_keeps_every_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 2)
    stale = tmp_path / "checkpoints" / ".checkpoint-4.tmp"
    stale.mkdir()
    (stale / "stale.bin").write_bytes(b"from a killed save")
    final = ck.save_checkpoint(FakeAccelerator([]), settings(None), tmp_path, 4, [], lambda folder: None)
    assert not (final / "stale.bin").exists() and not stale.exists()
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]


def test_a_full_disk_while_saving_leaves_no_part_of_the_new_checkpoint_and_deletes_nothing(tmp_path):
    for step in (1, 2):
        make_checkpoint(tmp_path, step)

    def full(folder: Path):
        (folder / "learned_embeds.safetensors").write_bytes(b"ha")  # half written
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError) as err:
        ck.save_checkpoint(FakeAccelerator([]), settings(1), tmp_path, 3, [], full)
    final = tmp_path / "checkpoints" / "checkpoint-3"
    assert str(err.value).startswith(
        f"saving checkpoint checkpoint-3 to {final} failed: No space left on device; "
    )
    assert str(err.value).endswith(
        "then resume with --resume_from_checkpoint latest (the last complete checkpoint is kept)."
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert not (tmp_path / "history.json.partial").exists()


def test_a_bug_while_saving_is_not_called_a_full_disk_but_still_leaves_nothing(tmp_path):
    def bug(folder: Path):
        raise KeyError("vectors")

    with pytest.raises(KeyError):
        ck.save_checkpoint(FakeAccelerator([]), settings(None), tmp_path, 3, [], bug)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize(
    ("limit", "keep", "deleted", "left"),
    [
        (2, 4, [1, 2], [3, 4]),
        (1, 4, [1, 2, 3], [4]),
        (3, 4, [1], [2, 3, 4]),
        (5, 4, [], [1, 2, 3, 4]),
        (None, 4, [], [1, 2, 3, 4]),
        (1, 1, [2, 3, 4], [1]),  # the checkpoint just saved stays, even as the oldest
    ],
)
def test_rotation_keeps_the_newest_within_the_limit_and_never_the_one_just_saved(
    tmp_path, limit, keep, deleted, left
):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)
    gone = ck.prune_checkpoints(tmp_path, tmp_path / "checkpoints" / f"checkpoint-{keep}", limit)
    assert [ck.checkpoint_step(p) for p in gone] == deleted
    assert [ck.checkpoint_step(p) for p in ck.list_checkpoints(tmp_path)] == left
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_checkpoint_past_the_last_step_is_refused_naming_the_earlier_ones(tmp_path):
    for step in (2, 4, 8):
        make_checkpoint(tmp_path, step)
    late = tmp_path / "checkpoints" / "checkpoint-8"
    ck.check_not_past_the_end(late, 8)  # at the last step: fine, the run only writes its outputs
    with pytest.raises(TrainingInputError) as err:
        ck.check_not_past_the_end(late, 6)
    assert str(err.value) == (
        f"resume_from_checkpoint {late} was saved at step 8, after this run's last step (max_train_steps=6). "
        f"Fix: pass --max_train_steps 8 or more to continue from it, or resume an earlier checkpoint "
        f"(checkpoint-2, checkpoint-4)."
    )
    with pytest.raises(TrainingInputError, match=r"or more to continue from it\.$"):
        ck.check_not_past_the_end(late, 1)  # nothing earlier to offer


def test_a_resume_reads_the_records_up_to_its_step_preferring_the_partial_ones(tmp_path):
    assert ck.load_history(tmp_path, 5) == []
    (tmp_path / "history.json").write_text(json.dumps([{"step": s} for s in (1, 2, 3, 4)]))
    assert ck.load_history(tmp_path, 3) == [{"step": 1}, {"step": 2}, {"step": 3}]
    (tmp_path / "history.json.partial").write_text(
        json.dumps([{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}])
    )
    assert ck.load_history(tmp_path, 4) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]


def test_an_unreadable_checkpoint_file_is_one_line_naming_the_checkpoint(tmp_path):
    ckpt = make_checkpoint(tmp_path, 2)

    class Refusing:
        def __init__(self, err):
            self.err = err

        def load_state(self, path):
            assert path == str(ckpt)
            raise self.err

    refused = pickle.UnpicklingError(
        "Weights only load failed.\nRe-running with weights_only=False could run code"
    )
    with pytest.raises(TrainingInputError) as err:
        ck.load_state(Refusing(refused), ckpt)
    assert str(err.value) == (
        f"checkpoint {ckpt} cannot be loaded: a file in it is damaged or not plain tensors (Weights only load "
        f"failed.). Fix: remove that folder to resume from the checkpoint before it, or start in a new --output_dir"
    )
    with pytest.raises(TrainingInputError, match=r"not plain tensors \(Ran out of input\)"):
        ck.load_state(Refusing(EOFError("Ran out of input")), ckpt)
    with pytest.raises(KeyError):  # not a damaged file: a bug, left as it is
        ck.load_state(Refusing(KeyError("model")), ckpt)


# --- planted links: never written through, never followed ------------------------------------------


def _elsewhere(tmp_path: Path) -> Path:
    """A folder outside the run's, with a file of known content, that planted links point at."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "optimizer.bin").write_bytes(b"theirs")
    return folder


def test_a_link_planted_at_the_checkpoints_known_temporary_name_is_removed_not_filled(tmp_path):
    out, elsewhere = tmp_path / "out", _elsewhere(tmp_path)
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / ".checkpoint-4.tmp").symlink_to(elsewhere)
    final = ck.save_checkpoint(FakeAccelerator([]), settings(None), out, 4, [], lambda folder: None)
    assert not final.is_symlink() and (final / "optimizer.bin").read_bytes() == b"adam"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["optimizer.bin"]
    assert (elsewhere / "optimizer.bin").read_bytes() == b"theirs"


def test_a_link_named_like_a_checkpoint_is_neither_listed_nor_rotated(tmp_path):
    out, elsewhere = tmp_path / "out", _elsewhere(tmp_path)
    make_checkpoint(out, 2)
    (elsewhere / "random_states_0.pkl").write_bytes(b"planted")
    (out / "checkpoints" / "checkpoint-1").symlink_to(elsewhere)
    (out / "checkpoints" / ".checkpoint-1.deleting").symlink_to(elsewhere)
    assert [p.name for p in ck.list_checkpoints(out)] == ["checkpoint-2"]
    with pytest.raises(TrainingInputError):
        ck.resolve_checkpoint(tmp_path / "empty", "latest")
    assert ck.resolve_checkpoint(out, "latest").name == "checkpoint-2"
    make_checkpoint(out, 3)
    assert [p.name for p in ck.prune_checkpoints(out, out / "checkpoints" / "checkpoint-3", 1)] == [
        "checkpoint-2"
    ]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["optimizer.bin", "random_states_0.pkl"]


def test_rotation_removes_a_link_at_the_aside_name_not_its_target(tmp_path):
    out, elsewhere = tmp_path / "out", _elsewhere(tmp_path)
    for step in (1, 2):
        make_checkpoint(out, step)
    (out / "checkpoints" / ".checkpoint-1.deleting").symlink_to(elsewhere)
    ck.prune_checkpoints(out, out / "checkpoints" / "checkpoint-2", 1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert (elsewhere / "optimizer.bin").read_bytes() == b"theirs"

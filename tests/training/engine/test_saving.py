"""helpers.training.engine.saving: what a run writes besides checkpoints (the learned embeddings,
JSON records, the full pipeline's copied parts), each complete or absent, and a full disk as one line."""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from helpers.core import files
from helpers.training.engine import TrainingInputError, saving
from helpers.training.engine.folder import inspect_output_dir

FIX = (
    "Fix: free space there (or choose an output_dir on another disk), then resume with "
    "--resume_from_checkpoint latest (the last complete checkpoint is kept)."
)


# --- a full disk ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("err", "storage"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
        (OSError(errno.ENOENT, "No space left"), False),  # an OSError is judged by its errno only
        (PermissionError(errno.EACCES, "Permission denied"), False),
        (
            RuntimeError("Error while serializing: IoError(Os { code: 28 }) (os error 28)"),
            True,
        ),  # safetensors
        (RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64"), True),  # torch.save
        (RuntimeError("PytorchStreamWriter failed writing file data/0"), True),
        (ValueError("Out of range float values are not JSON compliant"), False),
    ],
)
def test_a_full_or_failing_disk_is_told_from_a_bug(err, storage):
    assert saving.is_storage_error(err) is storage


@pytest.mark.parametrize(
    ("free", "text"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1536, "1.5 KiB"),
        (5 * 2**20, "5.0 MiB"),
        (3 * 2**30, "3.0 GiB"),
        (2**41, "2048.0 GiB"),
    ],
)
def test_free_space_is_read_on_the_nearest_existing_folder(free, text, tmp_path, monkeypatch):
    asked = []

    def disk_usage(path):
        asked.append(Path(path))
        return SimpleNamespace(free=free)

    monkeypatch.setattr(saving.shutil, "disk_usage", disk_usage)
    assert saving.free_space(tmp_path / "not" / "yet") == text
    assert asked == [tmp_path]


def test_a_full_disk_is_one_storage_error_and_the_temporary_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(saving, "free_space", lambda path: "12.0 KiB")
    target, tmp = tmp_path / "checkpoint-2", tmp_path / ".checkpoint-2.tmp"
    tmp.mkdir()
    (tmp / "half.bin").write_bytes(b"ha")
    with pytest.raises(saving.StorageError) as err:
        with saving.storage_errors(target, "checkpoint checkpoint-2", discard=tmp):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert isinstance(err.value, TrainingInputError)  # the command's one-line error, exit 2
    assert str(err.value) == (
        f"saving checkpoint checkpoint-2 to {target} failed: No space left on device; 12.0 KiB free on that "
        f"disk. {FIX}"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained traceback
    assert not tmp.exists()
    with pytest.raises(
        saving.StorageError, match=r"failed: Error while serializing \(os error 28\); 12.0 KiB free"
    ):
        with saving.storage_errors(target, "learned_embeds.safetensors"):
            raise RuntimeError("Error while serializing (os error 28)\nsecond line")


def test_any_other_error_passes_through_unchanged_but_still_removes_the_temporary(tmp_path):
    tmp = tmp_path / ".checkpoint-2.tmp"
    tmp.mkdir()
    bug = ValueError("shape mismatch")
    with pytest.raises(ValueError) as err:
        with saving.storage_errors(tmp_path / "checkpoint-2", "checkpoint checkpoint-2", discard=tmp):
            raise bug
    assert err.value is bug and not tmp.exists()


# --- learned embeddings and records ------------------------------------------------------------------


def test_learned_embeds_are_one_float32_tensor_under_the_placeholder_token(tmp_path):
    trained = torch.tensor([[1.5, 0.0], [-2.0, 3.0], [0.25, -1.0]], dtype=torch.bfloat16, requires_grad=True)
    vectors = trained.t()  # bf16, with a gradient, and not contiguous: safetensors takes none of these
    assert not vectors.is_contiguous()
    path = saving.save_learned_embeds(tmp_path / "learned_embeds.safetensors", "<cat>", vectors)
    assert path == tmp_path / "learned_embeds.safetensors"
    saved = load_file(path)
    assert list(saved) == ["<cat>"] and saved["<cat>"].dtype == torch.float32
    assert saved["<cat>"].tolist() == [[1.5, -2.0, 0.25], [0.0, 3.0, -1.0]]
    assert [p.name for p in tmp_path.iterdir()] == ["learned_embeds.safetensors"]  # no temporary left


def test_learned_embeds_are_written_under_a_hidden_name_and_a_failed_write_keeps_the_old_file(
    tmp_path, monkeypatch
):
    path = tmp_path / "learned_embeds.safetensors"
    saving.save_learned_embeds(path, "<cat>", torch.ones(1, 4))
    before = path.read_bytes()
    written = []

    def full_disk(state, filename):
        written.append(Path(filename))
        Path(filename).write_bytes(b"half a tensor")
        raise RuntimeError("Error while serializing (os error 28)")

    monkeypatch.setattr(saving, "save_file", full_disk)
    with pytest.raises(RuntimeError):
        saving.save_learned_embeds(path, "<cat>", torch.zeros(1, 4))
    assert re.fullmatch(
        rf"\.learned_embeds\.[0-9a-f]{{8}}-{os.getpid()}-[0-9a-f]{{8}}\.tmp\.safetensors", written[0].name
    )
    assert written[0].parent == tmp_path and not written[0].exists()
    assert path.read_bytes() == before and load_file(path)["<cat>"].tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_json_records_are_indented_and_a_non_finite_value_keeps_the_previous_file(tmp_path):
    path = tmp_path / "run_summary.json"
    saving.write_json(path, {"steps": 4, "final_loss": None, "losses": [0.5, 0.25]})
    assert (
        path.read_text()
        == '{\n  "steps": 4,\n  "final_loss": null,\n  "losses": [\n    0.5,\n    0.25\n  ]\n}'
    )
    with pytest.raises(ValueError, match="not JSON compliant"):
        saving.write_json(path, {"steps": 5, "final_loss": float("inf")})
    assert json.loads(path.read_text())["steps"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["run_summary.json"]


# --- the full pipeline ---------------------------------------------------------------------------------


def _base_model(root: Path, vae_weights: bool) -> Path:
    """A base model folder with the UNet's two files, and the VAE's if ``vae_weights``."""
    for part, weights in (("unet", True), ("vae", vae_weights)):
        (root / part).mkdir(parents=True)
        (root / part / "config.json").write_text(json.dumps({"part": part}))
        if weights:
            (root / part / "diffusion_pytorch_model.safetensors").write_bytes(part.encode() * 1000)
    return root


def test_the_base_parts_are_copied_byte_for_byte_into_a_hidden_folder_of_the_run(tmp_path):
    base, out = _base_model(tmp_path / "base", vae_weights=False), tmp_path / "out"
    copy = saving.PipelineCopy(base, out)
    try:
        assert re.fullmatch(rf"\.pipeline\.{os.getpid()}-[0-9a-f]{{8}}\.tmp", copy.folder.name)
        assert copy.folder.parent == out
        assert copy.wait() == ["unet"]  # the VAE lacks its weights file: pipeline saving writes it instead
        for name in ("config.json", "diffusion_pytorch_model.safetensors"):
            assert (copy.folder / "unet" / name).read_bytes() == (base / "unet" / name).read_bytes()
        assert not (copy.folder / "vae").exists()
        # a process killed now leaves it behind: the next run finds it as a leftover
        assert inspect_output_dir(out).leftovers == [copy.folder]
    finally:
        copy.discard()
    assert not copy.folder.exists()


def test_a_part_saved_in_shards_is_copied_with_its_index_and_a_shard_outside_its_folder_is_not(tmp_path):
    """diffusers saves a part over 10 GB in shards named by an index (SDXL's fp32 UNet): they are
    copied too, else the save would load and write the whole UNet after the last step. An index
    naming a file outside its folder, or not an index at all, disqualifies the part (saved from the
    model instead)."""
    base, out = _base_model(tmp_path / "base", vae_weights=False), tmp_path / "out"
    unet = base / "unet"
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    shards = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for i, name in enumerate(shards):
        (unet / name).write_bytes(bytes([i]) * 100)
    index = {
        "metadata": {},
        "weight_map": {"a.weight": shards[1], "b.weight": shards[0], "c.weight": shards[1]},
    }
    (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    copy = saving.PipelineCopy(base, out)
    try:
        assert copy.wait() == ["unet"]
        names = ["config.json", "diffusion_pytorch_model.safetensors.index.json", *shards]
        assert sorted(p.name for p in (copy.folder / "unet").iterdir()) == sorted(names)
        assert all((copy.folder / "unet" / n).read_bytes() == (unet / n).read_bytes() for n in names)
    finally:
        copy.discard()

    (tmp_path / "secret").write_bytes(b"not a shard")
    index["weight_map"]["d.weight"] = "../../secret"
    (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    assert saving.saved_files(unet) == []
    for broken in ({"weight_map": {"a": 1, "b": shards[0]}}, {"weight_map": [shards[0]]}, ["x"]):
        (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(broken))
        assert saving.saved_files(unet) == []
    hostile = saving.PipelineCopy(base, tmp_path / "out2")
    try:
        assert hostile.wait() == []
    finally:
        hostile.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "out", "out2", "secret"]


def test_a_failed_copy_is_raised_by_wait_and_a_slow_one_times_out(tmp_path, monkeypatch):
    base = _base_model(tmp_path / "base", vae_weights=True)

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(files, "copy_file_uncached", full)
    failed = saving.PipelineCopy(base, tmp_path / "a")
    with pytest.raises(OSError) as err:
        failed.wait()
    assert err.value.errno == errno.ENOSPC
    failed.discard()

    release = threading.Event()
    monkeypatch.setattr(files, "copy_file_uncached", lambda src, dst: release.wait(30))
    slow = saving.PipelineCopy(base, tmp_path / "b")
    try:
        with pytest.raises(TimeoutError) as err:
            slow.wait(limit=-1)
        assert str(err.value) == (
            f"copying the base model's unet and vae into {slow.folder} took over -1 s; check that disk, or "
            f"train without --save_as_full_pipeline"
        )
    finally:
        release.set()
        slow.discard()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == []


def test_removing_a_pipeline_removes_its_index_and_parts_and_keeps_the_run(tmp_path):
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "config.json").write_text("{}")
    for name in ("model_index.json", "learned_embeds.safetensors", "train_config.yaml"):
        (tmp_path / name).write_text("x")
    saving.remove_full_pipeline(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["learned_embeds.safetensors", "train_config.yaml"]

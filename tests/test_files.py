"""Atomic writes of files and folders: a crash at any point leaves the old content whole."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from helpers import files
from helpers.files import (
    move_dir_into_place,
    replace_dir_atomic,
    save_image_atomic,
    write_bytes_atomic,
    write_file_atomic,
    write_path_atomic,
    write_text_atomic,
)


class Crash(Exception):
    """Stands for anything that stops a writer half-way (an error, Ctrl-C, a full disk)."""


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_writes_creates_parents_and_replaces(tmp_path):
    path = tmp_path / "a" / "b" / "state.json"
    assert write_text_atomic(path, "one") == path and path.read_text() == "one"
    write_text_atomic(path, "two")
    assert path.read_text() == "two"
    assert names(path.parent) == ["state.json"]


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text_atomic(path, "old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "bad \ud800 surrogate")
    assert path.read_text() == "old"
    assert names(tmp_path) == ["f.txt"]


def test_a_writer_that_crashes_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.bin"
    write_bytes_atomic(path, b"old content")

    def half_then_crash(fh):
        fh.write(b"new co")
        fh.flush()
        raise Crash

    with pytest.raises(Crash):
        write_file_atomic(path, half_then_crash)
    assert path.read_bytes() == b"old content"
    assert names(tmp_path) == ["f.bin"]


def test_path_writers_get_a_temporary_with_the_same_suffix(tmp_path):
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text("x")

    path = write_path_atomic(tmp_path / "run.ipynb", write)
    assert seen[0].suffix == ".ipynb" and seen[0].parent == tmp_path and seen[0].name.startswith(".")
    assert path.read_text() == "x" and names(tmp_path) == ["run.ipynb"]


def test_save_image_atomic_writes_the_format_asked_for(tmp_path):
    image = Image.new("RGB", (4, 3), (10, 200, 30))
    path = save_image_atomic(tmp_path / "a.png", image)
    with Image.open(path) as back:
        assert back.format == "PNG" and back.size == (4, 3) and back.getpixel((0, 0)) == (10, 200, 30)
    assert names(tmp_path) == ["a.png"]


def fill_with(content: dict[str, str]):
    def fill(folder):
        for name, text in content.items():
            (folder / name).write_text(text)

    return fill


def test_replace_dir_creates_then_replaces_a_folder(tmp_path):
    dest = tmp_path / "out" / "pipeline"
    assert replace_dir_atomic(dest, fill_with({"a": "1", "b": "2"})) == dest
    assert names(dest) == ["a", "b"]
    replace_dir_atomic(dest, fill_with({"c": "3"}))
    assert names(dest) == ["c"] and (dest / "c").read_text() == "3"
    assert names(dest.parent) == ["pipeline"]  # no temporary or old copy left
    (tmp_path / "plain").mkdir()
    assert dest.stat().st_mode == (tmp_path / "plain").stat().st_mode  # the umask's, not mkdtemp's 0700


def test_a_crash_while_filling_leaves_the_old_folder_whole(tmp_path):
    dest = tmp_path / "pipeline"
    replace_dir_atomic(dest, fill_with({"a": "old a", "b": "old b"}))

    def half_then_crash(folder):
        (folder / "a").write_text("new a")
        raise Crash

    with pytest.raises(Crash):
        replace_dir_atomic(dest, half_then_crash)
    assert {p.name: p.read_text() for p in dest.iterdir()} == {"a": "old a", "b": "old b"}
    assert names(tmp_path) == ["pipeline"]


def test_a_failing_final_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    dest = tmp_path / "pipeline"
    replace_dir_atomic(dest, fill_with({"a": "old a", "b": "old b"}))
    real_rename = os.rename

    def rename(src, dst):
        if os.fspath(dst) == os.fspath(dest) and ".tmp" in os.fspath(src):
            raise OSError("simulated failure of the final rename")
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        replace_dir_atomic(dest, fill_with({"a": "new a"}))
    assert {p.name: p.read_text() for p in dest.iterdir()} == {"a": "old a", "b": "old b"}
    assert names(tmp_path) == ["pipeline"]


def test_keep_existing_keeps_a_folder_another_builder_finished_first(tmp_path):
    dest = tmp_path / "cache"

    def build_while_another_finishes(folder):
        (folder / "mine").write_text("mine")
        replace_dir_atomic(dest, fill_with({"theirs": "theirs"}))  # the other builder wins the race

    assert replace_dir_atomic(dest, build_while_another_finishes, keep_existing=True) == dest
    assert names(dest) == ["theirs"] and names(tmp_path) == ["cache"]
    replace_dir_atomic(tmp_path / "new", fill_with({"a": "1"}), keep_existing=True)
    assert names(tmp_path / "new") == ["a"]


def test_move_dir_into_place_swaps_a_folder_filled_by_name(tmp_path):
    dest, shared = tmp_path / "checkpoint-4", tmp_path / ".checkpoint-4.tmp"  # a name every rank knows
    replace_dir_atomic(dest, fill_with({"old": "1"}))
    shared.mkdir()
    (shared / "new").write_text("2")
    assert move_dir_into_place(shared, dest) == dest
    assert names(dest) == ["new"] and names(tmp_path) == ["checkpoint-4"]

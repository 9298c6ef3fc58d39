"""Atomic file writes."""

from __future__ import annotations

import pytest

from helpers.files import write_text_atomic


def test_writes_creates_parents_and_replaces(tmp_path):
    path = tmp_path / "a" / "b" / "state.json"
    assert write_text_atomic(path, "one") == path and path.read_text() == "one"
    write_text_atomic(path, "two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text_atomic(path, "old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "bad \ud800 surrogate")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]

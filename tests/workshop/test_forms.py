"""The notebooks' forms without a browser: the upload form's checks with real bytes, one line per bad file."""

from __future__ import annotations

import datetime
import io

import pytest
from PIL import Image

from helpers.workshop import forms


def _png(size: int, colour=(20, 160, 150)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


GOOD = _png(80)
UPLOADS = [
    ("duck.png", GOOD),
    ("notes.txt", b"these are my pictures\n"),
    ("small.png", _png(16)),
    ("broken.png", GOOD[: len(GOOD) // 2]),  # a picture cut off half-way
    ("empty.jpg", b""),
]


def test_good_pictures_are_kept_and_each_bad_file_is_one_line_and_not_kept(tmp_path):
    folder = tmp_path / "my_pictures"
    saved, refused = forms.save_pictures(UPLOADS, folder, min_size=64)
    assert saved == [folder / "duck.png"] and (folder / "duck.png").read_bytes() == GOOD
    assert sorted(p.name for p in folder.iterdir()) == ["duck.png"]  # nothing of a bad file, no temporary
    assert len(refused) == 4 and all("\n" not in line for line in refused)
    notes, small, broken, empty = refused
    assert notes == "notes.txt: not a picture (PNG, JPEG, WebP, BMP, GIF, TIFF, ...)"
    assert small == "small.png: 16x16 px is smaller than the training resolution 64 px: use a larger picture"
    assert broken.startswith("broken.png: corrupt or truncated image")
    assert empty.startswith("empty.jpg: ") and "empty" in empty.split(": ", 1)[1]


def test_a_path_in_the_file_name_cannot_escape_the_folder(tmp_path):
    saved, refused = forms.save_pictures(
        [("../../duck.png", GOOD), (".hidden.png", GOOD)], tmp_path / "in", 64
    )
    assert saved == [tmp_path / "in" / "duck.png"] and refused == [".hidden.png: a hidden file name"]


def test_the_form_keeps_what_is_uploaded_into_the_concept_folder(tmp_path, monkeypatch):
    pytest.importorskip("ipywidgets")
    monkeypatch.chdir(tmp_path)
    form = forms.upload_form("my_pictures", resolution=64)
    upload = form.children[0]
    upload.value = tuple(
        {"name": name, "type": "image/png", "size": len(content), "content": memoryview(content),
         "last_modified": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)}
        for name, content in UPLOADS
    )  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "my_pictures").iterdir()) == ["duck.png"]

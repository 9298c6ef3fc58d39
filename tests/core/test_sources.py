"""helpers.core.sources (local path or Hub id?) and helpers.core.outputs (the names of a run's files)."""

from __future__ import annotations

import pytest

from helpers.core.errors import InputError
from helpers.core.outputs import placeholder_tokens_for
from helpers.core.sources import classify_source


@pytest.mark.parametrize(
    "name, kind",
    [
        ("stable-diffusion-v1-5/stable-diffusion-v1-5", "hub_id"),
        ("sd-concepts-library/dicoo", "hub_id"),
        ("./out/pipeline", "missing_path"),
        ("/no/such/folder", "missing_path"),
        ("~/no-such-folder-xyz", "missing_path"),
        ("outptus", "unknown"),  # a typo of a folder name: neither a path nor a Hub id
        ("a/b/c", "unknown"),  # the Hub has no nested ids
    ],
)
def test_classify_source_by_spelling(name, kind):
    assert classify_source(name) == kind


def test_an_existing_folder_wins_over_a_hub_shaped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert classify_source("out/pipeline") == "hub_id"
    (tmp_path / "out" / "pipeline").mkdir(parents=True)
    assert classify_source("out/pipeline") == "folder"
    assert classify_source(tmp_path / "out") == "folder"


def test_placeholder_tokens_follow_diffusers_naming():
    assert placeholder_tokens_for("<pip>", 1) == ["<pip>"]
    assert placeholder_tokens_for("<pip>", 3) == ["<pip>", "<pip>_1", "<pip>_2"]
    with pytest.raises(InputError, match="num_vectors=0: must be at least 1"):
        placeholder_tokens_for("<pip>", 0)

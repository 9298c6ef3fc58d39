"""Shared fixtures: the offline tiny model, a scratch copy of the sample images, notebook runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network: the Hub is offline here and az must not phone home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AZURE_CORE_COLLECT_TELEMETRY", "false")


@pytest.fixture(scope="session")
def notebook_run_dir(tmp_path_factory) -> Path:
    """The one folder all notebooks run in, in order, so 05 finds what 02 trained."""
    return tmp_path_factory.mktemp("notebooks")


@pytest.fixture(scope="session")
def notebook_records(notebook_run_dir):
    """``notebook_records(stem)`` runs the notebooks in order up to ``stem`` (once each) on the
    tiny profile and returns that notebook's records."""
    from helpers import notebooks

    done: dict[str, dict] = {}

    def run_up_to(stem: str) -> dict:
        for nb in notebooks.notebook_paths():
            if nb.stem not in done:
                out = notebook_run_dir / nb.name
                done[nb.stem] = notebooks.run_notebook(
                    nb, out, notebooks.tiny_profile(nb), cwd=notebook_run_dir
                )
            if nb.stem == stem:
                return done[stem]
        raise KeyError(f"no notebook named {stem!r} in {notebooks.NOTEBOOK_DIR}")

    return run_up_to

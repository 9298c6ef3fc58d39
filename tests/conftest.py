"""Shared fixtures: the offline tiny model, a scratch copy of the sample images, notebook runs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

# Tests never reach the network: the Hub is offline here and az must not phone home.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("AZURE_CORE_COLLECT_TELEMETRY", "false")

FAKE_SSH = """#!/bin/sh
# Stand-in for ssh: drop the options, note the host, run the remote command on this machine.
while [ $# -gt 0 ]; do case "$1" in -o|-p|-l|-i|-F) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
echo "$host" >> "$(dirname "$0")/ssh_hosts.log"
# Each real host has its own /tmp; sharing one makes Open MPI's daemons race for a session folder.
export TMPDIR="$(dirname "$0")/tmp-$host"; mkdir -p "$TMPDIR"
FAKE_HOST=$host exec sh -c "$*"
"""


@pytest.fixture(autouse=True)
def latent_cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own empty latent cache (helpers.training.engine.latents), never the user's: every run in
    a test (and every process it starts) encodes its latents as a first run does."""
    folder = tmp_path_factory.mktemp("latent-cache")
    monkeypatch.setenv("WORKSHOP_LATENT_CACHE", str(folder))
    return folder


@pytest.fixture
def fake_ssh(tmp_path) -> Path:
    """An ssh program that runs the remote command here, with ``$FAKE_HOST`` set to the host it
    was asked for; every host contacted is appended to ``ssh_hosts.log`` next to it."""
    path = tmp_path / "fake_ssh"
    path.write_text(FAKE_SSH)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture(scope="session")
def notebook_run_dir(tmp_path_factory) -> Path:
    """The one folder all notebooks run in, in order, so 05 finds what 02 trained."""
    return tmp_path_factory.mktemp("notebooks")


@pytest.fixture(scope="session")
def notebook_records(notebook_run_dir):
    """``notebook_records(stem)`` runs the notebooks in order up to ``stem`` (once each) on the
    tiny profile and returns that notebook's records."""
    from helpers.workshop import notebooks

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

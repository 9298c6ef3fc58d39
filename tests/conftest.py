"""Shared fixtures: the offline tiny model, a scratch copy of the sample images, notebook runs."""

from __future__ import annotations

import gc
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.core import cpu

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


def pytest_configure(config):
    """A TERM (CI's timeout, a kill) ends the session as Ctrl-C does, through the fixtures' teardown:
    the JupyterLab server and the browser that the notebook tests start in sessions of their own
    end with it instead of outliving it."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def session_latent_cache(tmp_path_factory):
    """The session's own latent cache, for what module- and session-scoped fixtures train (the
    per-test one below does not reach them): never the user's, so a second session on a machine
    encodes as the first did."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORKSHOP_LATENT_CACHE", str(tmp_path_factory.mktemp("session-latent-cache")))
        yield


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
    """The one folder all notebooks run in, in order, so 05 finds what 02 trained. Under two test
    workers it is shared by both (their temporary roots' parent), so each notebook runs once."""
    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / "notebooks"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def notebook_records(notebook_run_dir, tmp_path_factory):
    """``notebook_records(stem)`` runs the notebooks in order up to ``stem`` (once each, whichever
    worker asks first; the other waits for it) on the offline profile and returns that notebook's records.

    They run in JupyterLab in headless Chromium, as attendees run them (tests/workshop/lab.py): each is
    saved executed where it ran, beside its report ``<stem>.lab.json`` of what JupyterLab showed. Where
    Chromium or JupyterLab is missing, papermill runs them, as ``make demo`` does."""
    from filelock import FileLock
    from workshop import lab  # tests/ is on sys.path

    from helpers.workshop import notebooks

    runner = None if lab.MISSING else lab.LabRunner(notebook_run_dir, tmp_path_factory.mktemp("lab-work"))

    def execute(nb: Path) -> None:
        if runner is None:
            notebooks.run_notebook(
                nb, notebook_run_dir / nb.name, notebooks.tiny_profile(nb), cwd=notebook_run_dir
            )
            return
        report = runner.run(nb)
        if report["cells_run"] < report["code_cells"] or not report["code_cells"]:
            raise notebooks.NotebookError(
                f"{nb.name} in JupyterLab: {report['cells_run']} of {report['code_cells']} code cells ran:\n  - "
                + "\n  - ".join(report["findings"])
            )

    def run_up_to(stem: str) -> dict:
        with FileLock(notebook_run_dir / "running.lock"):
            for nb in notebooks.notebook_paths():
                done, failed = notebook_run_dir / f"{nb.stem}.done", notebook_run_dir / f"{nb.stem}.failed"
                if failed.exists():  # the other worker ran it: the same failure, without running it again
                    raise notebooks.NotebookError(failed.read_text())
                if not done.exists():
                    try:
                        execute(nb)
                    except Exception as error:
                        failed.write_text(
                            str(error) if isinstance(error, notebooks.NotebookError) else repr(error)
                        )
                        raise
                    done.touch()
                if nb.stem == stem:
                    return notebooks.read_records(notebook_run_dir / nb.name)
        raise KeyError(f"no notebook named {stem!r} in {notebooks.NOTEBOOK_DIR}")

    try:
        yield run_up_to
    finally:
        if runner is not None:
            runner.close()


# --- two workers (`make test` runs pytest-xdist with --dist loadscope: a module's tests on one worker) ----
# Every process a test starts (Ray's daemons and workers included) inherits this worker's name, so a
# test counting "Ray processes left" sees its own worker's only; Ray's folders go to the worker's own root.
WORKER = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
os.environ["WORKSHOP_TEST_WORKER"] = WORKER
os.environ["RAY_TMPDIR"] = f"/tmp/r{os.environ.get('PYTEST_XDIST_WORKER', '')}"  # short: Ray's socket paths
Path(os.environ["RAY_TMPDIR"]).mkdir(exist_ok=True)
# Each worker computes on its share of the cores, and so does every process it starts (they inherit
# OMP_NUM_THREADS; helpers' runs read it through cpu.set_threads). Oversubscribed, OpenMP's threads wait
# for each other at every operator: measured on a 2-core machine beside a busy 2-thread process, eight
# toy-world pictures took 60 s on 2 threads and 2.3 s on 1. Launchers still give their ranks their own
# OMP_NUM_THREADS (ClusterLayout.threads_per_process).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = cpu.physical_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# --- full garbage collections walk what this module made, not the libraries ---------------------------
@pytest.fixture(autouse=True, scope="module")
def _collector_walks_this_modules_objects():
    """Collect, then :func:`gc.freeze` what is alive, as each test module starts.

    A test process holds torch's, diffusers', transformers' and optimum's objects (about 600,000),
    and every automatic full collection walked them all: measured over tests/training,
    tests/dreambooth and tests/toyworld (not slow), 98 s of 562 s went to about 160 such walks. Frozen,
    they are left out; what a module makes is collected as usual, and garbage left from earlier
    modules is collected before each freeze. The commands do the same for their own process
    (:func:`helpers.core.errors.exit_with`); this is the suite's process.
    """
    gc.collect()
    gc.freeze()
    yield


# --- the order modules are handed to the two workers (`--dist loadscope`: a module runs whole on one) ---
def pytest_collection_modifyitems(config, items):
    """The modules with notebook tests first, then those with slow tests, then the rest, each in its
    own order. A worker takes the next module when it finishes one, so the short modules at the end
    fill in around the long ones: before, one core idled for about a minute and a half at the end
    (measured from /proc/stat) while the other finished a long module."""
    ranks: dict[str, int] = {}
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        rank = 0 if "notebooks" in marks else 1 if "slow" in marks else 2
        module = item.nodeid.split("::")[0]
        ranks[module] = min(ranks.get(module, 2), rank)
    items.sort(key=lambda item: ranks[item.nodeid.split("::")[0]])


# --- where the suite's time goes (make test prints it; CI keeps it in its log) ------------------------
# Per test phase: wall seconds, CPU seconds (this worker and every process it started and waited for:
# on 2 cores the suite is CPU-bound, so CPU seconds are what a change saves) and processes started.
_TESTS: dict[str, dict[str, float]] = {}
_started = [0]  # processes started in this worker since its last report
_cpu_at_last_report = [0.0]
_popen_init = subprocess.Popen.__init__


def _counting_popen_init(self, *args, **kwargs):
    """Count every process a test starts directly (a fresh interpreter costs seconds each)."""
    _started[0] += 1
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _counting_popen_init


def pytest_runtest_logstart(nodeid, location):
    _cpu_at_last_report[0] = sum(os.times()[:4])  # not the collection's or the scheduler's CPU


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries its processes and CPU seconds (xdist sends them to the controller)."""
    outcome = yield
    cpu = sum(os.times()[:4])
    outcome.get_result().user_properties += [
        ("processes", _started[0]),
        ("cpu", cpu - _cpu_at_last_report[0]),
    ]
    _started[0], _cpu_at_last_report[0] = 0, cpu


def pytest_runtest_logreport(report):
    row = _TESTS.setdefault(report.nodeid, {"seconds": 0.0, "cpu_seconds": 0.0, "processes": 0})
    props = dict(report.user_properties)
    row["seconds"] += report.duration
    row["cpu_seconds"] += props.get("cpu", 0.0)
    row["processes"] += props.get("processes", 0)


def pytest_terminal_summary(terminalreporter):
    """Wall and CPU seconds and processes started per test module, most CPU first; the same per test
    in ``build/test-times.json`` for the next maintainer (which tests to make cheaper). Another
    environment's run (``make test-ipex``: ``.venv-ipex``) writes ``build/test-times.venv-ipex.json``
    beside it instead of replacing it."""
    if not _TESTS or hasattr(terminalreporter.config, "workerinput"):  # the controller writes it
        return
    modules: dict[str, dict[str, float]] = {}
    for nodeid, row in _TESTS.items():
        total = modules.setdefault(nodeid.split("::")[0], dict.fromkeys(row, 0))
        for key, value in row.items():
            total[key] += value
    terminalreporter.section("wall seconds, CPU seconds and processes started per test module")
    for module, row in _by_cpu(modules).items():
        terminalreporter.write_line(
            f"{row['seconds']:8.1f} s {row['cpu_seconds']:8.1f} s CPU {int(row['processes']):5d} processes  {module}"
        )
    env = Path(sys.prefix).name
    path = (
        Path(__file__).resolve().parents[1]
        / "build"
        / ("test-times.json" if env == ".venv" else f"test-times.{env.lstrip('.')}.json")
    )
    path.parent.mkdir(exist_ok=True)
    rounded = {name: _by_cpu(rows) for name, rows in (("modules", modules), ("tests", _TESTS))}
    path.write_text(json.dumps(rounded, indent=1))


def _by_cpu(rows: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``rows`` most CPU seconds first, each figure to a tenth."""
    ordered = sorted(rows.items(), key=lambda kv: -kv[1]["cpu_seconds"])
    return {key: {field: round(value, 1) for field, value in row.items()} for key, row in ordered}

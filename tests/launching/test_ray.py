"""helpers.launch --launcher ray: the Ray Train driver, its bad input, failures and clean-up.

The equivalence with mpirun and one process is in tests/launching/test_launch.py (the same runs are shared).
Runs with Ray are slow (a private runtime and two workers start in 30-60 s on 2 cores).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from tiny_parts import train_here  # tests/ is on sys.path under pytest

from helpers import launch
from helpers.launching import commands, job, preflight, rank_output, ray_worker, supervise
from helpers.launching import ray_train as ray_launch
from helpers.launching.layout import ClusterLayout, free_port
from helpers.ranks import faults, oneccl, status
from helpers.training.engine import events
from launching.test_launch import (
    AUTO,
    SPLIT_ATOL,
    SPLIT_LOSS_REL,
    history_losses,
    learned,
    train_args,
)  # tests/ is on sys.path under pytest

RAY_PROCESSES = ("raylet", "gcs_server")


def ray_temp_dirs() -> set[str]:
    """Private runtimes' folders (helpers.launching.ray_train makes ``$RAY_TMPDIR/ray-*``; conftest
    gives each test worker its own ``RAY_TMPDIR``)."""
    return {str(p) for p in Path(os.environ["RAY_TMPDIR"]).glob("ray-*")}


def ray_processes() -> set[int]:
    """Pids of Ray's daemons and workers on this machine now, started from this test worker (they
    inherit its ``WORKSHOP_TEST_WORKER``; another worker's Ray is not this test's business)."""
    found = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        text = " ".join([p.info["name"] or "", *(p.info["cmdline"] or [])[:1]])
        if any(n in text for n in RAY_PROCESSES) or text.startswith("ray::"):
            try:
                if p.environ().get("WORKSHOP_TEST_WORKER") == os.environ["WORKSHOP_TEST_WORKER"]:
                    found.add(p.pid)
            except psutil.Error:  # ended meanwhile
                pass
    return found


def run_cli(*flags: str, out: Path, train: list[str] | None = None, timeout: float = 600, **env: str):
    """``python -m helpers.launch --launcher ray <flags> -- <the tiny run's flags> <train>``."""
    argv = [
        sys.executable,
        "-m",
        "helpers.launch",
        "--launcher",
        "ray",
        *flags,
        "--",
        *train_args(out),
        *(train or []),
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
                          cwd=out.parent)  # fmt: skip


# --- without Ray running -------------------------------------------------------------------------


def test_ray_lines_are_sorted_by_rank_through_the_workers_pids():
    stream, log = io.StringIO(), io.StringIO()
    out = rank_output.Output(stream, log)
    cmd = commands.LaunchCommand(argv=("x",), output_tags="ray")
    pieces = [
        ("helpers.launching.ray_train: Ray 2.60.0 started on this machine in 9.0 s", "\n"),
        ("(TrainController pid=11) Attempting to start training worker group of size 2", "\n"),
        (f"(RayTrainWorker pid=22) {rank_output.WORKER_TAG} rank 1 of 2, pid 22, node 10.0.0.5 (b)", "\n"),
        (f"(RayTrainWorker pid=33, ip=10.0.0.4) {rank_output.WORKER_TAG} rank 0 of 2, pid 33, node 10.0.0.4 (a)", "\n"),
        ("(RayTrainWorker pid=33, ip=10.0.0.4) precision: fp32 requested", "\n"),
        ("", "\r"),
        ("bar 50%(RayTrainWorker pid=22) Traceback (most recent call last):", "\n"),  # right after a redraw
        ("(RayTrainWorker pid=22) RuntimeError: boom", "\n"),
        ("(PlacementGroupCleaner pid=44) Failed to query Ray Train Controller actor state.", "\n"),
        ("bar 60%(RayTrainWorker pid=33, ip=10.0.0.4) learned embeddings: out", "\n"),  # rank 0's
    ]  # fmt: skip
    for text, end in pieces:
        out.feed(0, cmd, text, end)
    assert stream.getvalue() == (
        "helpers.launching.ray_train: Ray 2.60.0 started on this machine in 9.0 s\n"
        f"{rank_output.WORKER_TAG} rank 0 of 2, pid 33, node 10.0.0.4 (a)\nprecision: fp32 requested\n"
        "\rbar 50%\r"  # rank 1's line is not shown: the bar goes on redrawing in place
    )  # and once rank 1 has failed (its traceback), nothing more: the log has it
    assert out.quiet and "[0] learned embeddings: out\n" in log.getvalue()
    assert out.ray_ranks == {22: 1, 33: 0}
    assert list(out.tails[1])[1:] == ["Traceback (most recent call last):", "RuntimeError: boom"]
    assert out.errors == {1: ["RuntimeError: boom"]}
    assert "(TrainController) Attempting to start training worker group of size 2\n" in log.getvalue()
    assert "[1] RuntimeError: boom\n" in log.getvalue()


def test_the_drivers_input_error_is_the_jobs_one_message():
    out = rank_output.Output(io.StringIO(), None)
    cmd = commands.LaunchCommand(argv=("x",), output_tags="ray")
    out.feed(0, cmd, "error: --ray_address auto: no Ray cluster runs on this machine", "\n")
    assert (
        out.stream.getvalue() == ""
        and out.input_error == "--ray_address auto: no Ray cluster runs on this machine"
    )
    result = job.JobResult(2, 3.0, input_error=out.input_error)
    assert result.message() == "--ray_address auto: no Ray cluster runs on this machine"


def test_diagnose_names_the_worker_the_driver_reports_first():
    text = (
        f"{rank_output.FAILED_TAG} rank 1 failed on node b (pid 22): WorkerHealthCheckFailedError: A worker health "
        f"check failed.\n{rank_output.FAILED_TAG} rank 0 failed on node a (pid 33): RuntimeError: Connection reset by peer"
    )
    errors = {0: ["RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"]}
    assert rank_output.diagnose(errors, {0: 1.0}, text) == (
        1, "the launcher reports failed on node b (pid 22): WorkerHealthCheckFailedError: A worker health check failed."
    )  # fmt: skip


def test_the_step_reporter_reports_the_first_and_last_step_and_each_interval(monkeypatch):
    """The worker's events listener: a report at the run's first step, its last, and whenever
    REPORT_SECONDS passed; each with the step's exact loss and the mean of the steps since the last."""
    import ray.train

    reports, clock = [], iter([0.0, 0.5, 2.5, 3.0, 3.2])
    monkeypatch.setattr(ray.train, "report", reports.append)
    monkeypatch.setattr(ray_worker.time, "perf_counter", lambda: next(clock))
    reporter = ray_worker.StepReporter(rank=0, started_at=1.0)
    for step, seconds in zip(range(1, 6), [4.0, 1.0, 2.0, 0.5, 1.5], strict=True):
        reporter(
            events.StepEnded(step, 5, loss=1 / step, lr=1e-3, seconds=seconds, images_per_second=2 / seconds)
        )
    reporter(events.Saved(5, "outputs", Path("out")))  # not a step: no report
    assert [(r["step"], r["loss"], r["seconds_per_step"], r["images_per_second"]) for r in reports] == [
        (1, 1.0, 4.0, 0.5),
        (3, 1 / 3, 1.5, 2 / 1.5),  # 2.5 s after the first report
        (5, 0.2, 1.0, 2.0),  # the last step
    ]
    assert {(r["rank"], r["started_at"]) for r in reports} == {(0, 1.0)}


def test_the_workers_show_no_progress_bar_of_their_own(tmp_path, monkeypatch):
    """The driver shows the one bar: it hands the workers TQDM_DISABLE=1, which turns off the bar
    the run loop shows on a local main process (elsewhere it shows)."""
    args = ray_launch.parse_args(["--nproc_per_node", "2", "--threads_per_process", "1", "--work_dir",
                                  str(tmp_path), "--status_dir", str(tmp_path / "s"), "--", *train_args(tmp_path)])  # fmt: skip
    job_spec = ray_launch._job(args, ray_launch.PARSERS[args.module](args.train_args))
    assert job_spec["module"] == "helpers.train" and job_spec["env"]["TQDM_DISABLE"] == "1"
    assert events.ProgressBar("x", 3, 0, show=True).bar.disable is False
    monkeypatch.setenv("TQDM_DISABLE", job_spec["env"]["TQDM_DISABLE"])
    assert events.ProgressBar("x", 3, 0, show=True).bar.disable is True


def test_supervise_finish_reads_as_an_exit_and_later_beats_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(status, "_reporter", None)
    status.start()
    status.beat("training", 5)
    watcher = supervise.Watcher(tmp_path)
    assert watcher.poll(0.0)[3].alive
    status.finish()  # succeeded (the default): reports done, then frees the lock
    assert not watcher.poll(1.0)[3].alive and watcher.first_exit() == (3, 1.0)
    assert watcher.failures() == []
    status.beat("training", 6)  # after finish: no status written
    assert json.loads((tmp_path / "rank3.json").read_text())["state"] == status.DONE


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ray_address", "no-such-head.invalid:6379"], "--ray_address no-such-head.invalid:6379: host "
         "'no-such-head.invalid' does not resolve; pass the head node's private address, e.g. 10.42.1.4:6379"),
        (["--ray_address", "10.42.1.4"], "--ray_address 10.42.1.4: expected auto or HOST:PORT of the head node's "
         "Ray (GCS) port, e.g. 10.42.1.4:6379"),
        (["--nproc_per_node", "3", "--threads_per_process", "1"], "--nproc_per_node 3 x 1 thread(s) needs 3 CPUs, "
         "this machine has {cpus}: pass at most --nproc_per_node {cpus}, or join a bigger cluster with --ray_address"),
        (["--num_nodes", "2"], "--num_nodes 2: without --ray_address Ray runs on this machine only (one node); start "
         "a Ray cluster (`ray start --head` on the head, `ray start --address HEAD:6379` on the others) and pass "
         "--ray_address auto"),
        (["--hostfile", "hosts"], "--hostfile: not used with --launcher ray (Ray finds its nodes and addresses "
         "itself); drop it, and join a cluster with --ray_address"),
    ],
)  # fmt: skip
def test_bad_ray_options_are_one_line_before_anything_starts(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    before = ray_processes()
    start = time.monotonic()
    args = launch.parse_args(["--launcher", "ray", *flags, "--", *train_args(tmp_path / "out")])
    assert launch.main(args) == 2
    assert time.monotonic() - start < 10
    cpus = ray_launch.local_cpus()
    assert capsys.readouterr().err == f"error: {message.format(cpus=cpus)}\n"
    assert not (tmp_path / "out").exists() and ray_processes() <= before


def test_an_address_where_nothing_listens_is_refused_within_seconds(tmp_path, capsys):
    port = free_port()
    start = time.monotonic()
    args = launch.parse_args(
        ["--launcher", "ray", "--ray_address", f"127.0.0.1:{port}", "--", *train_args(tmp_path / "o")]
    )
    assert launch.main(args) == 2 and time.monotonic() - start < 10
    assert capsys.readouterr().err == (
        f"error: --ray_address 127.0.0.1:{port}: nothing answers there (connection refused within 3 s); "
        f"start the head with `ray start --head --port {port}`, or pass the address it printed\n"
    )


def test_ray_options_with_another_launcher_are_refused(capsys, tmp_path):
    args = launch.parse_args(
        ["--launcher", "mpirun", "--ray_address", "auto", "--", *train_args(tmp_path / "o")]
    )
    assert launch.main(args) == 2
    assert capsys.readouterr().err == (
        "error: --ray_address is for --launcher ray only; with mpirun the hostfile lists the nodes\n"
    )


def test_dry_run_prints_the_driver_command(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = ["--launcher", "ray", "--nproc_per_node", "4", "--num_nodes", "3", "--threads_per_process", "2",
             "--ray_address", "auto", "--dry_run", "--", *train_args(tmp_path / "out")]  # fmt: skip
    assert launch.main(launch.parse_args(flags)) == 0
    comment, *variables, command = capsys.readouterr().out.splitlines()
    assert comment == f"# ray, on the head node, from {tmp_path}:"
    # the backend's variables (oneCCL's where it is built), one comment line each: NAME=value: the reason
    assert all(re.fullmatch(r"#   [A-Z_]+=\S*: .+", line) for line in variables), variables
    work = tmp_path / "out" / "launch"
    assert command.startswith(
        f"{sys.executable} -m helpers.launching.ray_train --nproc_per_node 4 --num_nodes 3 --threads_per_process 2 "
        f"--work_dir {work} --status_dir {work / 'status'} --backend {AUTO} --ray_address auto "
        "-- --pretrained_model_name_or_path tiny"
    )
    assert bool(variables) == (AUTO == "ccl")  # gloo needs no variables of its own


def test_nodes_must_match_this_environment_and_hold_the_workers():
    from importlib import metadata

    here = {
        "python": sys.version.split()[0],
        "ray": metadata.version("ray"),
        "torch": metadata.version("torch"),
    }
    nodes = [{"node": "10.0.0.4", "cpus": 8.0, **here}, {"node": "10.0.0.5", "cpus": 4.0, **here}]
    ray_launch.check_nodes(nodes, nproc_per_node=2, num_nodes=2, threads=2)
    with pytest.raises(ray_launch.RayLaunchError) as err:
        ray_launch.check_nodes(nodes, nproc_per_node=2, num_nodes=2, threads=4)
    assert str(err.value) == (
        "--nproc_per_node 2 x 4 thread(s) on --num_nodes 2 needs 2 node(s) with 8 CPUs each; the cluster has 1 "
        "(10.0.0.4: 8, 10.0.0.5: 4 CPUs): pass fewer workers or threads, or add nodes"
    )
    nodes[1]["ray"] = "2.59.0"
    with pytest.raises(ray_launch.RayLaunchError) as err:
        ray_launch.check_nodes(nodes, nproc_per_node=1, num_nodes=1, threads=1)
    assert str(err.value) == (
        f"Ray node 10.0.0.5 runs ray 2.59.0 (here {here['ray']}): every node needs the same versions; run "
        "`make setup` there (requirements.txt pins them) and restart its Ray"
    )


# --- with Ray --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_that_dies_ends_the_run_with_one_message_and_no_ray_left(tmp_path, capsys, monkeypatch):
    """Rank 1 is killed (SIGKILL) while training: the job ends within 60 s, the message names rank 1,
    its node and its last lines; run_summary.json is not written and nothing half-written is left;
    no raylet or gcs_server survives, no worker's shared-memory file (ccl on one node) stays."""
    before, dirs = ray_processes(), ray_temp_dirs()
    out = tmp_path / "out"
    layout = ClusterLayout.local(2, threads_per_process=1)
    commands = job.prepare_job(layout, train_args(out, steps=100_000), "ray")
    status = Path(commands[0].status_dir)
    killed = []

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                report = json.loads((status / "rank1.json").read_text())
            except (OSError, ValueError):
                report = {}
            if report.get("state") == "training":
                running = ray_processes() - before  # the check at the end is not vacuous: it sees these
                os.kill(report["pid"], signal.SIGKILL)
                killed.append((time.monotonic(), report["pid"], report["host"], running))
                return
            time.sleep(0.2)

    threading.Thread(target=kill_rank_1, daemon=True).start()
    result = job.run_job(commands, stream=io.StringIO(), cwd=tmp_path, timeout=600)
    assert killed, "rank 1 never started training"
    assert time.monotonic() - killed[0][0] < 60
    assert result.returncode == 1 and result.failed_rank == 1
    _, pid, host, running = killed[0]
    assert pid in running and len(running) >= 4  # the two workers, the raylet and the GCS at least
    # Two witnesses, whichever is first: rank 1's status (its lock freed without "done": it ended
    # without a word) or the Ray driver's report of the dead actor, naming its node and pid.
    assert result.error == rank_output.SILENT_END or result.error.startswith(
        f"the launcher reports failed on node {host} (pid {pid}): "
    )
    assert result.message() == (
        f"rank 1 failed after {result.seconds:.1f} s: {result.error}; helpers.launch stopped the other "
        f"ranks. Every rank's output, tracebacks included: {out / 'launch' / 'job.log'}"
    )
    log = (out / "launch" / "job.log").read_text()
    assert f"{rank_output.WORKER_TAG} rank 1 of 2, pid {pid}" in log  # the line that says which node
    assert not (out / "run_summary.json").exists()
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]
    assert ray_processes() <= before and ray_temp_dirs() <= dirs
    workers = [json.loads((status / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]
    assert pid in workers and [p for w in workers for p in oneccl.SHM_FOLDER.glob(f"{w}:*")] == []


@pytest.mark.slow
def test_resume_from_the_last_checkpoint(tmp_path):
    """2 steps under mpirun with a checkpoint at each, then Ray workers --resume_from_checkpoint
    latest to 3 steps: the same embedding as one process with batch 2 running 3 steps straight
    (tolerance as in test_launch). The engine's checkpoints do not depend on the launcher that
    wrote them (and the job starts Ray once, not twice). The driver's record (<work_dir>/ray_run.json)
    holds the step reported through ray.train.report with the engine's own loss, the engine's
    exact history and summary, and the start-up times."""
    out = tmp_path / "ray"
    first = subprocess.run([sys.executable, "-m", "helpers.launch", "--launcher", "mpirun", "--nproc_per_node", "2",
                            "--threads_per_process", "1", "--", *train_args(out), "--checkpointing_steps", "1"],
                           capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    second = run_cli("--nproc_per_node", "2", out=out,
                     train=["--max_train_steps", "3", "--resume_from_checkpoint", "latest"])  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    train_here("helpers.train", train_args(tmp_path / "single", steps=3, batch=2))
    summary, history = (json.loads((out / name).read_text()) for name in ("run_summary.json", "history.json"))
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history_losses(out) == pytest.approx(history_losses(tmp_path / "single"), rel=SPLIT_LOSS_REL)
    torch.testing.assert_close(learned(out), learned(tmp_path / "single"), rtol=0, atol=SPLIT_ATOL)
    assert (summary["world_size"], summary["steps"], summary["backend"]) == (2, 3, AUTO)
    assert summary["embeddings_identical_across_ranks"] is True
    assert summary["allreduce_bytes_per_step"] == 32 * 4  # the new row of the tiny text encoder, fp32
    run = json.loads((out / "launch" / "ray_run.json").read_text())
    assert run["history"] == history and run["summary"] == summary
    assert run["world_size"] == 2 and run["threads_per_process"] == 1 and len(run["nodes"]) == 1
    assert [(r["step"], r["loss"]) for r in run["reports"]] == [(3, history[2]["loss"])]  # resumed at 2
    assert run["startup"]["ray_init_seconds"] > 0 and run["startup"]["workers_started_seconds"] > 0


@pytest.mark.slow
def test_auto_address_without_a_cluster_is_one_line_within_seconds(tmp_path):
    before = ray_processes()
    start = time.monotonic()
    done = run_cli("--ray_address", "auto", out=tmp_path / "out", timeout=120, RAY_ADDRESS="")
    assert time.monotonic() - start < 30
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error")]
    assert errors == [
        "error: --ray_address auto: no Ray cluster runs on this machine; start one (`ray start --head`) or pass "
        "HOST:PORT of the head node, or leave the flag out for a private runtime"
    ]
    assert not (tmp_path / "out" / "run_summary.json").exists() and ray_processes() <= before


@pytest.mark.slow
def test_a_rank_that_hangs_after_training_is_stopped_after_the_grace(tmp_path, monkeypatch):
    """Rank 0 writes every output, then hangs; rank 1's training function ends (finish() frees its
    lock). The launcher stops the Ray job after the grace and exits 0: the outputs are complete."""
    monkeypatch.setenv(faults.HANG_RANK, "0")
    before, dirs = ray_processes(), ray_temp_dirs()
    token = Path.home() / ".ray" / "auth_token"
    had_token = token.exists()
    out = tmp_path / "out"
    layout = ClusterLayout.local(2, threads_per_process=1)
    commands = job.prepare_job(layout, train_args(out), "ray")
    result = job.run_job(commands, stream=io.StringIO(), exit_grace_seconds=5, cwd=tmp_path, timeout=600)
    assert result.returncode == 0 and result.killed and result.not_ended == [0] and result.outputs_complete
    assert result.message().splitlines()[0] == (
        "rank 0 did not end within 5 s of rank 1 exiting; helpers.launch stopped it. "
        f"Outputs complete: {out / 'run_summary.json'} was written."
    )
    assert ray_processes() <= before and ray_temp_dirs() <= dirs  # stopped by TERM: cleaned up before KILL
    assert token.exists() == had_token  # the private runtime's token lived in the environment only


# --- a Ray cluster of two nodes (two raylets on this machine) ---------------------------------------------


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    """``ray start --head`` and ``ray start --address`` (1 CPU each), token auth, own temp folder;
    both started with --block so that ending them ends all their processes (no `ray stop`)."""
    import secrets

    ray = str(Path(sys.executable).parent / "ray")
    temp = tempfile_short()
    env = {
        **os.environ,
        **ray_launch.DRIVER_ENV,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    port = free_port()
    head = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                             "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    procs = [head]
    try:
        address = wait_for_head(port)
        worker = subprocess.Popen([ray, "start", "--block", f"--address={address}", "--num-cpus=1"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)  # fmt: skip
        procs.append(worker)
        wait_for_nodes(address, env, 2)
        yield address, env
    finally:
        for p in procs:
            tree = (
                [p.pid, *(c.pid for c in psutil.Process(p.pid).children(recursive=True))]
                if p.poll() is None
                else []
            )
            for pid in tree:
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.wait()
        __import__("shutil").rmtree(temp, ignore_errors=True)


def tempfile_short() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="ray-t-", dir="/tmp")


def wait_for_nodes(address: str, env: dict, count: int, timeout: float = 180) -> None:
    """Until ``count`` nodes are alive in the cluster (a node joins some seconds after its start)."""
    script = (
        "import ray, sys, time\n"
        f"ray.init(address={address!r}, logging_level='ERROR')\n"
        f"deadline = time.monotonic() + {timeout}\n"
        f"while sum(n['Alive'] for n in ray.nodes()) < {count}:\n"
        "    if time.monotonic() > deadline:\n"
        "        sys.exit(f'only {sum(n[\"Alive\"] for n in ray.nodes())} node(s) joined')\n"
        "    time.sleep(0.5)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout + 60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def wait_for_head(port: int, timeout: float = 120) -> str:
    import socket

    deadline = time.monotonic() + timeout
    for host in [socket.gethostbyname(socket.gethostname()), "127.0.0.1"] * 10_000:
        try:
            with socket.create_connection((host, port), timeout=1):
                return f"{host}:{port}"
        except OSError:
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_joining_a_two_node_cluster(two_node_cluster, tmp_path):
    """--ray_address HOST:PORT --num_nodes 2 --nproc_per_node 1: one worker per node, the same engine."""
    address, env = two_node_cluster
    out = tmp_path / "out"
    done = run_cli("--ray_address", address, "--num_nodes", "2", "--nproc_per_node", "1",
                   "--threads_per_process", "1", out=out, **env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((out / "launch" / "ray_run.json").read_text())
    assert run["world_size"] == 2 and len(run["nodes"]) == 2 and run["ray_address"] == address
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["embeddings_identical_across_ranks"] is True


@pytest.mark.slow
def test_a_cluster_without_cpus_for_the_workers_is_one_line(two_node_cluster, tmp_path):
    address, env = two_node_cluster
    done = run_cli("--ray_address", address, "--num_nodes", "2", "--nproc_per_node", "2",
                   "--threads_per_process", "1", out=tmp_path / "out", timeout=120, **env)  # fmt: skip
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: --nproc_per_node 2 x 1 thread(s) on --num_nodes 2 needs 2 node(s) with 2 CPUs each; the cluster has 0 ("
    )


@pytest.mark.slow
def test_a_cluster_of_another_ray_version_is_one_line(two_node_cluster, tmp_path):
    """The cluster's recorded version is changed (as a head started by another Ray would record it):
    Ray's own check refuses the driver, and the launcher says so in one line."""
    address, env = two_node_cluster
    script = (
        "import json, ray\nfrom ray.experimental import internal_kv as kv\n"
        f"ray.init(address={address!r}, logging_level='ERROR')\n"
        "old = kv._internal_kv_get('CLUSTER_METADATA', namespace='cluster')\n"
        "meta = json.loads(old); meta['ray_version'] = '2.59.0'\n"
        "kv._internal_kv_put('CLUSTER_METADATA', json.dumps(meta), overwrite=True, namespace='cluster')\n"
        "print(old.decode())\n"
    )
    fake = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert fake.returncode == 0, fake.stderr[-2000:]
    original = fake.stdout.strip().splitlines()[-1]
    try:
        done = run_cli("--ray_address", address, "--nproc_per_node", "1", "--threads_per_process", "1",
                       out=tmp_path / "out", timeout=120, **env)  # fmt: skip
    finally:
        restore = (
            script.split("old = ")[0]
            + f"kv._internal_kv_put('CLUSTER_METADATA', {original!r}, overwrite=True, namespace='cluster')\n"
        )
        subprocess.run([sys.executable, "-c", restore], capture_output=True, env=env, timeout=120)
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error")]
    python = sys.version.split()[0]
    assert errors == [
        f"error: --ray_address {address}: the cluster runs Ray 2.59.0 / Python {python}, this environment "
        f"Ray {ray_launch.ray_version()} / Python {python}; install the same versions on every node and here "
        "(make setup), then restart Ray"
    ]


# --- the Azure cluster's Ray (rendered; real VMs cannot be tested here) ------------------------------------


def test_cloud_init_starts_ray_on_every_node_bound_to_its_private_address():
    import shlex
    import shutil

    import yaml

    from helpers.cluster import azure
    from helpers.cluster.azure import provision

    spec = azure.ClusterSpec(ssh_source_cidr="203.0.113.7/32", node_count=3)
    ray = "/home/azureuser/workshop/.venv/bin/ray"
    cores = (
        "--num-cpus=$(lscpu -p=Core,Socket | grep -v '^#' | sort -u | wc -l) --disable-usage-stats --block"
    )
    assert provision.ray_start_commands(spec) == {
        "sdw-head": f"{ray} start --head --port=6379 --include-dashboard=false --node-ip-address=10.42.1.4 {cores}",
        "sdw-worker-1": f"{ray} start --address=10.42.1.4:6379 --node-ip-address=10.42.1.5 {cores}",
        "sdw-worker-2": f"{ray} start --address=10.42.1.4:6379 --node-ip-address=10.42.1.6 {cores}",
    }
    # every flag is one Ray's own parser knows
    help_text = subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--help"],
                               capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    for command in provision.ray_start_commands(spec).values():
        for flag in [w.split("=")[0] for w in shlex.split(command.split(" $(")[0]) if w.startswith("--")]:
            assert f"{flag} " in help_text or f"{flag}=" in help_text or f"{flag}\n" in help_text, flag
    config = yaml.safe_load(azure.cloud_init(spec))
    script, unit = (f["content"] for f in config["write_files"])
    assert [f["path"] for f in config["write_files"]] == [
        "/usr/local/bin/workshop-ray-start",
        "/etc/systemd/system/workshop-ray.service",
    ]
    for name, ip in zip(spec.node_names, spec.node_ips, strict=True):
        assert f"  {ip}) exec {provision.ray_start_commands(spec)[name]} ;;\n" in script
    assert "export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled\n" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid bash
    assert "ExecStart=/usr/local/bin/workshop-ray-start\n" in unit
    assert f"ExecStopPost={ray} stop --force\n" in unit and "Restart=on-failure\n" in unit
    assert config["runcmd"][1] == ["systemctl", "enable", "--now", "workshop-ray.service"]
    # the pinned Ray is installed by make setup, from requirements.txt, on every node
    requirements = (Path(__file__).parents[2] / "requirements.txt").read_text().splitlines()
    assert f"ray[train]=={ray_launch.ray_version()}" in requirements
    assert "make -C workshop setup" in config["runcmd"][0][-1]
    # Ray's ports are reachable only inside the subnet: the NSG allows intra-subnet and SSH only
    rules = [c.argv for c in azure.plan(spec) if c.argv[:4] == ("network", "nsg", "rule", "create")]
    allowed = [(a[a.index("--source-address-prefixes") + 1], a[a.index("--destination-port-ranges") + 1])
               for a in rules if a[a.index("--access") + 1] == "Allow"]  # fmt: skip
    assert allowed == [("203.0.113.7/32", "22"), ("10.42.1.0/24", "*")]
    assert shutil.which("bash")


def test_preflight_names_a_node_with_another_ray(tmp_path):
    """Two "nodes" reached through a stand-in for ssh; node1's Python sees a Ray 2.59.0 first."""
    from helpers.training import data

    dist_info = tmp_path / "site" / "ray-2.59.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 2.59.0\n")
    ssh = tmp_path / "ssh"
    ssh.write_text(
        '#!/bin/sh\nwhile [ $# -gt 0 ]; do case "$1" in -o) shift 2;; -*) shift;; *) break;; esac; done\n'
        f'host=$1; shift\n[ "$host" = node1 ] && export PYTHONPATH={tmp_path / "site"}\nexec sh -c "$*"\n'
    )
    ssh.chmod(0o755)
    layout = ClusterLayout(("node0", "node1"), 1, main_process_ip="127.0.0.1", main_process_port=free_port(),
                             threads_per_process=1)  # fmt: skip
    problems = preflight.preflight(layout, data.sample_concept_dir(), ssh=(str(ssh),))
    assert [(p.host, p.check, p.detail) for p in problems] == [
        ("node1", "packages", f"ray 2.59.0, here {ray_launch.ray_version()}")
    ]


def test_bench_launchers_ratios_and_table():
    from bench import launchers

    rows = [
        {"launcher": "mpirun", "status": "ok", "wall_seconds": 20.0, "images_per_second": 30.0},
        {"launcher": "mpirun", "status": "ok", "wall_seconds": 22.0, "images_per_second": 32.0},
        {"launcher": "ray", "status": "ok", "wall_seconds": 60.0, "images_per_second": 24.0,
         "ray_init_seconds": 10.0, "workers_started_seconds": 30.0},
        {"launcher": "ray", "status": "hung", "wall_seconds": 900.0},
    ]  # fmt: skip
    found = launchers.summarise(rows, ["ray", "mpirun"])
    assert found["ray"]["images_per_second_vs_mpirun"] == 0.774  # 24 / 31
    assert (found["ray"]["runs"], found["ray"]["ok"], found["ray"]["wall_seconds_median"]) == (2, 1, 480.0)
    assert found["mpirun"]["images_per_second_range"] == [30.0, 32.0]
    assert launchers.table(found).splitlines()[2:] == [
        "| ray | 24.0 (24.0–24.0) | 0.77x | 480.0 | 10.0; 30.0 |",
        "| mpirun | 31.0 (30.0–32.0) | 1.00x | 21.0 | – |",
    ]


def test_make_setup_checks_the_ray_pin():
    """requirements.txt pins ray[train]; helpers.core.environment (run by make setup) reads the pin
    with its extras and finds that version installed."""
    from helpers.core import environment

    assert environment.pinned_versions()["ray"] == ray_launch.ray_version() == "2.60.0"
    assert not [p for p in environment.problems() if "ray" in p]


def test_importing_ray_compiles_no_grammar():
    """Every Ray worker process imports ray, which imports jsonschema. jsonschema 4.25+ imports
    rfc3987-syntax, which compiles a Lark grammar at import: 2.6 s of CPU per process, nine
    processes per run (measured: a 2-step private run took 96 s, 60 s with the pinned 4.24.1)."""
    from importlib import metadata

    import ray  # noqa: F401 - what a worker imports first

    from helpers.core import environment

    assert [m for m in ("rfc3987_syntax", "lark") if m in sys.modules] == []
    assert environment.pinned_versions()["jsonschema"] == metadata.version("jsonschema") == "4.24.1"


def test_the_launcher_removes_a_private_runtime_folder_its_killed_driver_left(tmp_path, monkeypatch):
    """A driver killed while stopping leaves its ``ray-*`` folder: helpers.launch removes it once the job
    has ended, and nothing else (a note naming a folder elsewhere is only dropped)."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    status_dir = tmp_path / "status"
    status_dir.mkdir()
    left = tmp_path / "ray-abc123"
    (left / "session_x" / "sockets").mkdir(parents=True)
    note = status_dir / ray_launch.PRIVATE_FOLDER_NOTE
    note.write_text(str(left))
    ray_launch.remove_private_folder(status_dir)
    assert not left.exists() and not note.exists()
    elsewhere = tmp_path / "home" / "ray-keep"
    elsewhere.mkdir(parents=True)
    note.write_text(str(elsewhere))
    ray_launch.remove_private_folder(status_dir)
    assert elsewhere.is_dir() and not note.exists()
    ray_launch.remove_private_folder(status_dir)  # no note: nothing to do

"""Ray Train as the third launcher: the unchanged engine in ``TorchTrainer`` CPU workers.

::

    python -m helpers.launch --launcher ray --nproc_per_node N [--num_nodes M] \\
        [--ray_address auto|HOST:PORT] [--module helpers.dreambooth] -- <its flags>

:mod:`helpers.launch` checks the options, then starts this module's **driver**
(``python -m helpers.launching.ray_train``) as one supervised command, exactly as it starts ``mpirun``:
the driver's output is streamed, every worker reports to the status folder, and the launcher's
grace and stall limits stop the driver's whole process tree if anything hangs.

The driver

* starts a private Ray runtime on this machine (no ``--ray_address``: dashboard and usage
  statistics off, its temporary folder a fresh ``/tmp/ray-*`` deleted at the end, token
  authentication with a one-run token kept in the environment, never in ``~/.ray``; Ray binds
  its node to this machine's address, it refuses loopback), or joins the cluster at ``--ray_address``;
* checks, within seconds, what would otherwise hang or fail late: the cluster's Ray version
  against this one (Ray's own check, turned into one line), the Ray, torch and Python versions of
  every node, and enough CPUs for ``N x M`` workers of ``threads_per_process`` CPUs each;
* runs ``TorchTrainer`` with ``N x M`` workers (``resources_per_worker={"CPU": threads}``, gloo:
  Ray's workers call ``init_process_group`` before any code of ours runs in them, so ``ccl`` is not
  registered there yet); each worker runs the engine (:mod:`helpers.launching.ray_worker`);
* on ``--backend ccl`` (or ``auto`` where it is built) the workers get ``WORKSHOP_BACKEND=ccl`` and
  oneCCL's variables, and :func:`helpers.ranks.backend.init_backend` (the engine calls it before
  ``Accelerator()``) replaces Ray's gloo group by a ccl one with the same ranks (tested:
  ``tests/launching/test_launch.py``, the Ray run of ``engine_runs``);
* shows one progress bar fed by ``ray.train.report`` (each worker follows the engine's events and
  reports step, loss and images/s: :mod:`helpers.launching.ray_worker`), and writes what was
  reported, the start-up times and the nodes' versions to ``<work_dir>/ray_run.json``. The
  engine's own outputs, ``history.json`` included, are written once by rank 0, as with the other
  launchers;
* on every path (success, failure, Ctrl-C, SIGTERM from the launcher) calls ``ray.shutdown()``
  and ends what is left of a private runtime (``gcs_server``, ``raylet``, workers).

Not testable here: a Ray cluster of several machines (tests join a two-node cluster whose nodes
are two raylets on this machine), and the Azure nodes' ``ray start`` (rendered and checked as
text by :func:`helpers.cluster.azure.provision.cloud_init`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from helpers.core.errors import DistributedError, InputError
from helpers.core.files import write_text_atomic
from helpers.dreambooth.config import parse_args as parse_dreambooth_args
from helpers.launching import supervise
from helpers.launching.commands import LaunchCommand, backend_notes, backend_variables
from helpers.launching.layout import ClusterLayout
from helpers.launching.rank_output import FAILED_TAG, SECONDARY
from helpers.launching.ray_reports import Reports, first_line, sink_reports
from helpers.ranks import status
from helpers.ranks.backend import BACKEND_ENV, BACKENDS
from helpers.training.config import parse_args as parse_train_args

TRAIN = "helpers.train"
PARSERS = {TRAIN: parse_train_args, "helpers.dreambooth": parse_dreambooth_args}
"""What a worker may run (``--module``), and how the driver reads its flags."""

logger = logging.getLogger(__name__)

RUN_FILE = "ray_run.json"  # in the work folder: what the driver saw (reports, start-up, nodes)
VERSIONS = ("ray", "torch")  # must be the same on every node (and Python)
CONNECT_SECONDS = 3.0  # to decide that nothing answers at --ray_address
SHUTDOWN_SECONDS = 30.0  # for ray.shutdown() before the private runtime is killed
INIT_SECONDS = 180.0  # for ray.init() (many times what a loaded 2-core machine took)

# Set in the driver before Ray is imported; a private runtime's processes inherit them, and the
# RAY_TRAIN_* ones reach the Train controller.
DRIVER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # never phone home
    "RAY_DEDUP_LOGS": "0",  # every worker's lines, each under its own pid (the launcher needs them)
    "RAY_COLOR_PREFIX": "0",  # plain "(RayTrainWorker pid=...)" prefixes
    "RAY_CHDIR_TO_TRIAL_DIR": "0",  # workers keep the job's folder: relative paths mean what they say
    "RAY_TRAIN_V2_ENABLED": "1",  # the Train API this module is written for
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # a cloud spot-instance helper: one actor less
    "RAY_TRAIN_METRICS_ENABLED": "0",  # Prometheus metrics: no dashboard here to read them
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # a worker's print() once, not also through Train's logger
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "1",  # the controller takes reports (and sees deaths) each second
    "PYTHONUNBUFFERED": "1",
}


class RayLaunchError(DistributedError, InputError):
    """A Ray option or cluster that cannot run the job; one line naming it and the fix."""


# --- checks the launcher makes before starting anything -----------------------------------------------


def parse_address(address: str) -> tuple[str, int] | None:
    """``"auto"`` -> None; ``"HOST:PORT"`` -> ``(host, port)``.

    Raises:
        RayLaunchError: neither form.
    """
    if address == "auto":
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayLaunchError(
            f"--ray_address {address}: expected auto or HOST:PORT of the head node's Ray (GCS) port, "
            "e.g. 10.42.1.4:6379"
        )
    return host.strip("[]"), int(port)


def check_address(address: str, timeout: float = CONNECT_SECONDS) -> None:
    """Fail fast when nothing answers at ``address`` (Ray itself would retry for about a minute).

    Raises:
        RayLaunchError: the host does not resolve or its port does not accept a connection.
    """
    parsed = parse_address(address)
    if parsed is None:
        return  # "auto": the driver asks Ray, which answers at once when no cluster runs here
    host, port = parsed
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror:
        raise RayLaunchError(
            f"--ray_address {address}: host {host!r} does not resolve; pass the head node's private "
            "address, e.g. 10.42.1.4:6379"
        ) from None
    except OSError as err:
        why = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err)).lower()
        raise RayLaunchError(
            f"--ray_address {address}: nothing answers there ({why} within {timeout:g} s); start "
            f"the head with `ray start --head --port {port}`, or pass the address it printed"
        ) from None


def local_cpus() -> int:
    """CPUs this process may run on: what a private Ray runtime here offers."""
    return len(os.sched_getaffinity(0))


def check_local_layout(nproc_per_node: int, num_nodes: int, threads_per_process: int) -> None:
    """A private runtime has one node and this machine's CPUs.

    Raises:
        RayLaunchError: several nodes asked for, or more CPUs than this machine has.
    """
    if num_nodes != 1:
        raise RayLaunchError(
            f"--num_nodes {num_nodes}: without --ray_address Ray runs on this machine only (one node); "
            "start a Ray cluster (`ray start --head` on the head, `ray start --address HEAD:6379` on the "
            "others) and pass --ray_address auto"
        )
    need, have = nproc_per_node * threads_per_process, local_cpus()
    if need > have:
        raise RayLaunchError(
            f"--nproc_per_node {nproc_per_node} x {threads_per_process} thread(s) needs {need} CPUs, this "
            f"machine has {have}: pass at most --nproc_per_node {max(1, have // threads_per_process)}"
            f"{' --threads_per_process 1' if threads_per_process > 1 else ''}, or join a bigger cluster "
            "with --ray_address"
        )


def driver_command(
    train_args: Sequence[str],
    *,
    nproc_per_node: int,
    num_nodes: int,
    threads_per_process: int,
    ray_address: str | None,
    work_dir: str | os.PathLike,
    status_dir: str,
    backend: str = "gloo",
    module: str = TRAIN,
) -> LaunchCommand:
    """The one command :func:`helpers.launch.run_job` starts for a Ray job: this module's driver
    (``module``: what every worker runs, ``helpers.train`` or ``helpers.dreambooth``)."""
    argv = [sys.executable, "-m", "helpers.launching.ray_train", "--nproc_per_node", str(nproc_per_node),
            "--num_nodes", str(num_nodes), "--threads_per_process", str(threads_per_process),
            "--work_dir", str(Path(work_dir).resolve()), "--status_dir", status_dir, "--backend", backend]  # fmt: skip
    if ray_address:
        argv += ["--ray_address", ray_address]
    if module != TRAIN:
        argv += ["--module", module]
    notes = backend_notes(worker_backend_variables(nproc_per_node, num_nodes, threads_per_process, backend))
    return LaunchCommand(argv=(*argv, "--", *map(str, train_args)), output_tags="ray", notes=notes)


def worker_backend_variables(
    nproc_per_node: int, num_nodes: int, threads_per_process: int, backend: str
) -> list[tuple[str, str, str]]:
    """The backend's variables every worker sets before the engine starts (nodes like this one)."""
    layout = ClusterLayout.local(nproc_per_node, threads_per_process=threads_per_process)
    return backend_variables(layout, backend, nodes=num_nodes)


# --- the driver ---------------------------------------------------------------------------------------


@dataclass
class _Runtime:
    """The Ray runtime this driver uses, and how to end it."""

    address: str | None
    temp_dir: Path | None = None  # a private runtime's folder
    init_seconds: float = 0.0

    def stop(self, graceful: bool = True) -> None:
        """``ray.shutdown()`` (bounded; skipped when not ``graceful``: helpers.launch sends KILL 5 s
        after TERM), then kill what is left of a private runtime, then remove its folder."""
        import psutil

        # found first: once the raylet is gone, the workers it started are no longer our descendants
        started = psutil.Process().children(recursive=True) if self.address is None else []
        if graceful and "ray" in sys.modules:
            import ray

            done = threading.Event()

            def shutdown() -> None:
                with contextlib.suppress(Exception):
                    ray.shutdown()
                done.set()

            threading.Thread(target=shutdown, daemon=True).start()
            if not done.wait(SHUTDOWN_SECONDS):
                print(f"helpers.launching.ray_train: ray.shutdown() did not return within {SHUTDOWN_SECONDS:g} s; "  # noqa: T201
                      "ending the runtime's processes", flush=True)  # fmt: skip
        if self.address is None:
            kill_processes([*started, *psutil.Process().children(recursive=True)])
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def kill_processes(procs: list, wait: float = 5.0) -> None:
    """SIGKILL ``procs`` (psutil processes; those already gone are skipped) and wait for them."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=wait)


PRIVATE_FOLDER_NOTE = "ray_temp_dir"  # in the status folder: the private runtime's folder


def _runtime(args: argparse.Namespace) -> _Runtime:
    """What this driver will use: ``--ray_address``, or a private runtime in a fresh ``/tmp/ray-*``
    (short: Ray's socket paths must stay under 108 characters; Ray's own ``RAY_TMPDIR`` moves it).
    The folder is noted in the status folder, for :func:`remove_private_folder`."""
    if args.ray_address is None:
        folder = Path(tempfile.mkdtemp(prefix="ray-", dir=os.environ.get("RAY_TMPDIR", "/tmp")))
        write_text_atomic(Path(args.status_dir) / PRIVATE_FOLDER_NOTE, str(folder))
        return _Runtime(None, folder)
    return _Runtime(args.ray_address)


def remove_private_folder(status_dir: str | os.PathLike) -> None:
    """helpers.launch, once every process of the job has ended: remove the private runtime's folder
    if the driver could not (it was killed, e.g. when stopping took longer than the grace)."""
    note = Path(status_dir) / PRIVATE_FOLDER_NOTE
    with contextlib.suppress(OSError):
        folder = Path(note.read_text())
        if folder.name.startswith("ray-") and folder.parent == Path(os.environ.get("RAY_TMPDIR", "/tmp")):
            shutil.rmtree(folder, ignore_errors=True)
        note.unlink()


def _connect(args: argparse.Namespace, runtime: _Runtime) -> None:
    """Start the private runtime or join ``--ray_address``; the version check is Ray's own."""
    import ray

    start = time.monotonic()
    if runtime.temp_dir is not None:
        kwargs = dict(num_cpus=local_cpus(), _temp_dir=str(runtime.temp_dir), object_store_memory=256 * 2**20)
    else:
        kwargs = {"address": args.ray_address}
    try:
        ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True, **kwargs)
    except (ConnectionError, RuntimeError) as err:
        text = " ".join(str(err).split())
        if "Version mismatch" in text:
            raise RayLaunchError(
                f"--ray_address {args.ray_address}: the cluster runs {_cluster_versions(text)}, this environment "
                f"Ray {ray.__version__} / Python {sys.version.split()[0]}; install the same versions on every "
                "node and here (make setup), then restart Ray"
            ) from None
        if args.ray_address == "auto":
            raise RayLaunchError(
                "--ray_address auto: no Ray cluster runs on this machine; start one (`ray start --head`) "
                "or pass HOST:PORT of the head node, or leave the flag out for a private runtime"
            ) from None
        raise
    runtime.init_seconds = time.monotonic() - start
    signal.signal(signal.SIGTERM, supervise.interrupt)  # ray.init put its own (sys.exit) in place of ours


def _cluster_versions(text: str) -> str:
    """``Ray 2.59.0 / Python 3.11.7`` from Ray's "Version mismatch: The cluster was started with: ..." """
    m = re.search(r"cluster was started with: Ray: (\S+) Python: (\S+)", text)
    return f"Ray {m[1]} / Python {m[2]}" if m else "another Ray or Python"


def node_versions(timeout: float = 60.0) -> list[dict]:
    """Ray, torch and Python versions and CPUs of every live node, each asked by a task pinned to it.

    Raises:
        RayLaunchError: a node did not answer within ``timeout`` seconds.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_retries=0)
    def probe() -> dict:
        import platform
        from importlib import metadata

        return {"python": platform.python_version(), **{p: metadata.version(p) for p in VERSIONS}}

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    found = []
    for node, ref in zip(nodes, refs, strict=True):
        if ref not in ready:
            raise RayLaunchError(
                f"Ray node {node['NodeManagerAddress']} did not answer within {timeout:g} s; check it with "
                "`ray status` on the head node, or restart Ray on that node"
            )
        found.append({"node": node["NodeManagerAddress"], "cpus": node["Resources"].get("CPU", 0.0),
                      **ray.get(ref)})  # fmt: skip
    return found


def check_nodes(nodes: list[dict], nproc_per_node: int, num_nodes: int, threads: int) -> None:
    """Same versions as this environment on every node, and enough CPUs for the workers.

    Raises:
        RayLaunchError: the first problem, naming the node and the fix.
    """
    here = {"python": sys.version.split()[0], **{p: metadata.version(p) for p in VERSIONS}}
    for node in nodes:
        wrong = [f"{k} {node[k]} (here {v})" for k, v in here.items() if node[k] != v]
        if wrong:
            raise RayLaunchError(
                f"Ray node {node['node']} runs {', '.join(wrong)}: every node needs the same versions; run "
                "`make setup` there (requirements.txt pins them) and restart its Ray"
            )
    need = nproc_per_node * threads
    fitting = [n for n in nodes if n["cpus"] >= need]
    if len(fitting) < num_nodes:
        cpus = ", ".join(f"{n['node']}: {n['cpus']:g}" for n in nodes)
        raise RayLaunchError(
            f"--nproc_per_node {nproc_per_node} x {threads} thread(s) on --num_nodes {num_nodes} needs "
            f"{num_nodes} node(s) with {need} CPUs each; the cluster has {len(fitting)} ({cpus} CPUs): pass "
            "fewer workers or threads, or add nodes"
        )


def _absolute(config) -> None:
    """Paths relative to the folder the job was started from, as the other launchers read them."""
    folders = ("train_data_dir", "instance_data_dir", "class_data_dir", "output_dir")
    for name in (*folders, "resume_from_checkpoint", "pretrained_model_name_or_path"):
        value = getattr(config, name, None)
        if value and value != "latest" and (name in folders or Path(value).exists()):
            setattr(config, name, str(Path(value).resolve()))


def _status(status_dir: str, rank: int) -> dict:
    try:
        return json.loads((Path(status_dir) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def _job(args: argparse.Namespace, config) -> dict:
    """What every worker is handed: the settings, and the variables to set before the engine starts."""
    threads = args.threads_per_process
    variables = worker_backend_variables(args.nproc_per_node, args.num_nodes, threads, args.backend)
    env = {status.STATUS_DIR_ENV: args.status_dir, "OMP_NUM_THREADS": str(threads), BACKEND_ENV: args.backend,
           "TQDM_DISABLE": "1"}  # fmt: skip  # the driver shows the one bar
    return {"module": args.module, "config": config.to_dict(),
            "env": {**env, **{name: value for name, value, _ in variables}}}  # fmt: skip


def _train(args: argparse.Namespace, runtime: _Runtime) -> int:
    """Run the TorchTrainer, show the progress bar, write ``ray_run.json``; return the exit code."""
    # imported here: ray.train and ray.train.torch cost 3.6 s CPU on top of helpers.launch (measured
    # with time.process_time); only --launcher ray's driver needs them
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from helpers.launching.ray_worker import train_worker  # the engine's events: accelerate, torch

    config = PARSERS[args.module](list(args.train_args))
    _absolute(config)
    threads, world = args.threads_per_process, args.nproc_per_node * args.num_nodes
    nodes = node_versions()
    check_nodes(nodes, args.nproc_per_node, args.num_nodes, threads)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    sink = work_dir / "ray_reports.jsonl"
    sink.unlink(missing_ok=True)
    trainer = TorchTrainer(
        train_worker, train_loop_config=_job(args, config), torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=False, resources_per_worker={"CPU": threads},
                                     placement_strategy="PACK"),
        run_config=RunConfig(name="helpers-ray-launch", storage_path=str(work_dir / "ray_results"),
                             failure_config=FailureConfig(max_failures=0), callbacks=[sink_reports(str(sink))]),
    )  # fmt: skip
    print(f"helpers.launching.ray_train: Ray {ray_version()} {'joined at ' + runtime.address if runtime.address else 'started on this machine'} "  # noqa: T201
          f"in {runtime.init_seconds:.1f} s; {world} worker(s) x {threads} CPU(s), nodes: "
          + ", ".join(f"{n['node']} ({n['cpus']:g} CPUs)" for n in nodes), flush=True)  # fmt: skip
    fit_started = time.time()
    reports = Reports(sink)
    error = _fit(trainer, reports, config.max_train_steps)
    rows = reports.rows
    startup = {
        "ray_init_seconds": round(runtime.init_seconds, 3),
        "workers_started_seconds": round(rows[0]["started_at"] - fit_started, 3) if rows else None,
    }
    record = {"launcher": "ray", "ray_address": runtime.address, "ray_version": ray_version(),
              "world_size": world, "threads_per_process": threads, "nodes": nodes, "startup": startup,
              "reports": [{k: r.get(k) for k in ("step", "loss", "seconds_per_step", "images_per_second")}
                          for r in rows],
              "history": reports.final.get("history"), "summary": reports.final.get("summary"),
              "failures": reports.failures}  # fmt: skip
    write_text_atomic(work_dir / RUN_FILE, json.dumps(record, indent=2, default=repr))
    if error is None:
        print(f"helpers.launching.ray_train: the workers started {startup['workers_started_seconds']} s after the "  # noqa: T201
              f"trainer; {len(rows)} step(s) reported", flush=True)  # fmt: skip
        return 0
    _print_failures(error, args.status_dir)
    return 1


def _fit(trainer, reports: Reports, total: int | None) -> BaseException | None:
    """``trainer.fit()`` in a thread while the main one shows the workers' reports as a progress bar;
    the error ``fit`` raised, if any."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = err

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    bar = tqdm(total=total, desc="training (ray)", unit="step", file=sys.stderr)
    while thread.is_alive():
        thread.join(0.5)
        for row in reports.read():
            bar.update(row["step"] - bar.n)
            shown = {"loss": f"{row['loss']:.4f}" if row.get("loss") is not None else "?"}
            if row.get("images_per_second"):
                shown["img/s"] = f"{row['images_per_second']:.2f}"
            bar.set_postfix(shown)
    reports.read()
    bar.close()
    return outcome.get("error")


def _print_failures(error: BaseException, status_dir: str) -> None:
    """One line per failed worker, the root cause first: helpers.launch names the first worker this prints."""
    failures = getattr(error, "worker_failures", None) or {}
    for rank, err in sorted(failures.items(), key=lambda f: (bool(SECONDARY.search(first_line(f[1]))), f[0])):
        report = _status(status_dir, rank)
        where = f"on node {report.get('host', '?')} (pid {report.get('pid', '?')})"
        print(f"{FAILED_TAG} rank {rank} failed {where}: {first_line(err)}", flush=True)  # noqa: T201
    if not failures:
        print(f"helpers.launching.ray_train: training failed: {first_line(error)}", flush=True)  # noqa: T201


def ray_version() -> str:
    return metadata.version("ray")


def read_run(work_dir: str | os.PathLike) -> dict:
    """What the driver of a finished Ray job recorded (``<work_dir>/ray_run.json``): the reports,
    ``startup`` (``ray_init_seconds``, ``workers_started_seconds``), the nodes, the engine's summary."""
    return json.loads((Path(work_dir) / RUN_FILE).read_text())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The driver's options (set by :func:`driver_command`), then ``--`` and the training flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m helpers.launching.ray_train",
                                     description="The Ray Train driver helpers.launch --launcher ray starts.")  # fmt: skip
    parser.add_argument("--nproc_per_node", type=int, required=True)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--threads_per_process", type=int, required=True)
    parser.add_argument("--ray_address", default=None)
    parser.add_argument("--work_dir", required=True)
    parser.add_argument("--status_dir", required=True)
    parser.add_argument("--backend", choices=BACKENDS, default="gloo")
    parser.add_argument("--module", choices=tuple(PARSERS), default=TRAIN)
    args = parser.parse_args(argv[:split])
    args.train_args = argv[split + 1 :]
    return args


def main(args: argparse.Namespace) -> int:
    """Connect, check, train, and end the runtime whatever happens; return the exit code."""
    os.environ.update(DRIVER_ENV)
    if args.ray_address is None:  # a private runtime: a token for this run only, nothing in ~/.ray
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    signal.signal(signal.SIGTERM, supervise.interrupt)  # helpers.launch stops a job with TERM: clean up first
    runtime, graceful = _runtime(args), True
    # a launcher killed outright: end the runtime from the follower's thread at once (the main thread
    # may wait inside Ray's C++ code, where TERM's Python handler would run only when it returns)
    status.follow_launcher(args.status_dir, gone=lambda: _give_up("helpers.launch is gone", runtime))
    why = f"Ray did not start within {INIT_SECONDS:g} s"
    watchdog = threading.Timer(INIT_SECONDS, _give_up, args=(why, runtime))
    watchdog.daemon = True
    watchdog.start()
    try:
        _connect(args, runtime)
        watchdog.cancel()
        return _train(args, runtime)
    except InputError as err:
        print(f"error: {err}", flush=True)  # noqa: T201 - the launcher reports this one line
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, or TERM from helpers.launch: end everything now
        graceful = False
        print(f"helpers.launching.ray_train: stopped ({stop or 'interrupt'}); ending Ray", flush=True)  # noqa: T201
        return 130
    finally:
        watchdog.cancel()
        runtime.stop(graceful)


def _give_up(why: str, runtime: _Runtime) -> None:
    """From the watchdog thread: say why, end what this process started, exit (no hang)."""
    print(f"helpers.launching.ray_train: {why}; stopping", flush=True)  # noqa: T201
    runtime.stop(graceful=False)
    os._exit(1)


def cli(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return main(parse_args(argv))


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: what Ray pickles by reference must name a module
    # the Train controller and the workers can import.
    from helpers.launching import ray_train as ray_launch

    raise SystemExit(ray_launch.cli())

"""Ray Train as the third launcher: the unchanged engine in ``TorchTrainer`` CPU workers.

::

    python -m helpers.launch --launcher ray --nproc_per_node N [--num_nodes M] \\
        [--ray_address auto|HOST:PORT] -- <helpers.train flags>

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
* runs ``TorchTrainer`` with ``N x M`` workers (``resources_per_worker={"CPU": threads}``,
  gloo: ``TorchConfig(backend="ccl")`` cannot work, Ray's workers call ``init_process_group`` before
  any code of ours runs in them, so ``ccl`` is not registered there yet). Ray sets up the process group and the variables ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and
  ``ACCELERATE_TORCH_DEVICE`` before the worker function runs; accelerate's ``Accelerator(cpu=True)``
  then sees a multi-CPU job whose group already exists and uses it instead of creating one
  (``PartialState`` only calls ``init_process_group`` when ``torch.distributed`` is not
  initialised), so each worker calls the same ``train(TrainConfig)`` as ``helpers.train`` does;
* on ``--backend ccl`` (or ``auto`` where it is built) the workers get ``WORKSHOP_BACKEND=ccl`` and
  oneCCL's variables, and :func:`helpers.ranks.backend.init_backend` (the engine calls it before
  ``Accelerator()``) replaces Ray's gloo group by a ccl one with the same ranks (tested:
  ``tests/launching/test_launch.py``, the Ray run of ``engine_runs``);
* shows one progress bar fed by ``ray.train.report`` (each worker reports step, loss and
  images/s after every optimizer step), and writes what was reported, the start-up times and the
  nodes' versions to ``<work_dir>/ray_run.json``. The engine's own outputs, ``history.json``
  included, are written once by rank 0, as with the other launchers;
* on every path (success, failure, Ctrl-C, SIGTERM from the launcher) calls ``ray.shutdown()``
  and ends what is left of a private runtime (``gcs_server``, ``raylet``, workers).

Where the loss comes from: the engine exposes no per-step callback; it reports each step to
:mod:`helpers.launching.supervise` (step only) and shows the mean loss on rank 0's progress bar. A worker
listens to the beats, reads the loss from that bar (4 decimals, what the bar shows) and sends
the engine's exact history with its last report.

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
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from helpers.core.errors import DistributedError, InputError
from helpers.core.files import write_text_atomic
from helpers.launching import supervise
from helpers.launching.commands import LaunchCommand, backend_notes, backend_variables
from helpers.launching.layout import ClusterLayout
from helpers.launching.rank_output import FAILED_TAG, SECONDARY, WORKER_TAG
from helpers.ranks import faults, status
from helpers.ranks.backend import BACKEND_ENV, BACKENDS
from helpers.training.config import TrainConfig
from helpers.training.config import parse_args as parse_train_args

logger = logging.getLogger(__name__)

RUN_FILE = "ray_run.json"  # in the work folder: what the driver saw (reports, start-up, nodes)
VERSIONS = ("ray", "torch")  # must be the same on every node (and Python)
CONNECT_SECONDS = 3.0  # to decide that nothing answers at --ray_address
SHUTDOWN_SECONDS = 30.0  # for ray.shutdown() before the private runtime is killed
INIT_SECONDS = 180.0  # for ray.init() (many times what a loaded 2-core machine took)
REPORT_SECONDS = 2.0  # at most one report per this many seconds (see _StepReporter)

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
_PREFIX = re.compile(r"\((?P<actor>[A-Za-z_]\w*) pid=(?P<pid>\d+)(?:, ip=[^)]*)?\) ")
"""The prefix Ray puts before each line it forwards from an actor to the driver."""


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
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise RayLaunchError(
            f"--ray_address {address}: host {host!r} does not resolve; pass the head node's private "
            "address, e.g. 10.42.1.4:6379"
        ) from None
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.settimeout(timeout)
        try:
            s.connect(where)
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
) -> LaunchCommand:
    """The one command :func:`helpers.launch.run_job` starts for a Ray job: this module's driver."""
    argv = [sys.executable, "-m", "helpers.launching.ray_train", "--nproc_per_node", str(nproc_per_node),
            "--num_nodes", str(num_nodes), "--threads_per_process", str(threads_per_process),
            "--work_dir", str(Path(work_dir).resolve()), "--status_dir", status_dir, "--backend", backend]  # fmt: skip
    if ray_address:
        argv += ["--ray_address", ray_address]
    notes = backend_notes(worker_backend_variables(nproc_per_node, num_nodes, threads_per_process, backend))
    return LaunchCommand(argv=(*argv, "--", *map(str, train_args)), output_tags="ray", notes=notes)


def worker_backend_variables(
    nproc_per_node: int, num_nodes: int, threads_per_process: int, backend: str
) -> list[tuple[str, str, str]]:
    """The backend's variables every worker sets before the engine starts (nodes like this one)."""
    layout = ClusterLayout.local(nproc_per_node, threads_per_process=threads_per_process)
    return backend_variables(layout, backend, nodes=num_nodes)


# --- the worker: one rank of the engine in a Ray Train worker ---------------------------------------------

_LOSS = re.compile(r"loss=([-+0-9.eE]+|nan|inf)")


class _BarReader:
    """Stands in for the worker's stderr: drops the engine's progress-bar redraws (the driver shows
    the one bar) and keeps the loss the last redraw showed."""

    def __init__(self, stream: TextIO):
        self.stream, self.loss, self._redrawn = stream, None, False

    def write(self, text: str) -> int:
        if "\r" in text:
            found = _LOSS.findall(text)
            self.loss = float(found[-1]) if found else self.loss
            self._redrawn = True
            return len(text)
        if text == "\n" and self._redrawn:  # the bar's closing newline
            self._redrawn = False
            return len(text)
        self._redrawn = False
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding...
        return getattr(self.stream, name)


@dataclass
class _StepReporter:
    """A :mod:`helpers.launching.supervise` listener: ``ray.train.report`` of step, loss and images/s.

    Ray's report is a barrier (every worker must call it equally often) and a worker may be only
    one report ahead of the Train controller, which takes reports once per health check (1 s):
    a report at every 0.1-s step of a small model would hold every step up to a second. So rank 0
    decides after each step whether a report is due (its first step, the last, or
    ``REPORT_SECONDS`` since the last report) and broadcasts the decision (4 bytes over the
    job's process group, after the engine's own all-reduce), and every worker reports at that step.
    Rank 0's loss is read from its progress bar; the seconds per step are averaged since the
    last report.
    """

    rank: int
    images_per_step: int
    max_steps: int | None
    bar: _BarReader
    started_at: float = field(default_factory=time.time)
    _last_report: float | None = None
    _last_step: int | None = None

    def __call__(self, state: str, step: int | None) -> None:
        if state != "training" or step is None:
            return
        import ray.train
        import torch
        import torch.distributed as dist

        now = time.perf_counter()
        if self._last_report is None:  # the first step of this run: time from here on
            self._last_report, self._last_step = now, step
            due = True
        else:
            due = step == self.max_steps or now - self._last_report >= REPORT_SECONDS
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(due)], dtype=torch.int32)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        if not due:
            return
        steps = step - self._last_step
        seconds = (now - self._last_report) / steps if steps else None
        self._last_report, self._last_step = now, step
        ray.train.report({
            "step": step, "loss": self.bar.loss, "seconds_per_step": seconds, "rank": self.rank,
            "images_per_second": self.images_per_step / seconds if seconds else None,
            "started_at": self.started_at,
        })  # fmt: skip


def train_worker(job: dict) -> None:
    """The function every Ray Train worker runs: the engine's ``train(TrainConfig)``, unchanged.

    Args:
        job: ``config`` (``TrainConfig.to_dict()``), ``env`` (variables to set first: the status
            folder, ``OMP_NUM_THREADS``), ``images_per_step``.
    """
    started_at = time.time()
    # imported here: ray.train costs 3.3 s CPU and the engine (diffusers, accelerate) 3.0 s on top of
    # helpers.launch (measured with time.process_time); only the Ray workers run this, not the launcher
    import ray.train

    from helpers.training.textual_inversion import train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    os.environ.update(job["env"])
    node = ray.util.get_node_ip_address()
    print(
        f"{WORKER_TAG} rank {rank} of {world}, pid {os.getpid()}, node {node} ({socket.gethostname()})",
        flush=True,
    )  # noqa: T201 - the launcher maps this pid to the rank
    _quiet()
    status.start()
    bar = _BarReader(sys.stderr)
    reporter = _StepReporter(rank, job["images_per_step"], job["config"]["max_train_steps"], bar, started_at)
    status.add_listener(reporter)
    sys.stderr = bar  # tqdm takes sys.stderr when the engine creates its bar
    try:
        result = train(TrainConfig.from_dict(job["config"]))
    finally:
        sys.stderr = bar.stream
        status.remove_listener(reporter)
    print(f"learned embeddings: {result.learned_embeds_path}", flush=True)  # noqa: T201
    faults.hang_after_training(rank)  # test-only
    status.finish()  # this rank has ended; the actor's process lives on until Ray stops it
    final = {"final": True, "rank": rank}
    if rank == 0:
        final.update(history=result.history, summary=result.summary)
    ray.train.report(final)


def _quiet() -> None:
    """A line per checkpoint file (accelerate) and per report (Ray Train) is noise here."""
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    with contextlib.suppress(ImportError):  # Ray Train names this module's logger by its file
        from ray.train.v2._internal.execution import context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)


# --- the driver ---------------------------------------------------------------------------------------


def _sink_reports(path: str):
    """A ``ray.train.UserCallback`` (it runs in the Train controller, on the driver's node) that
    appends every report and worker failure to ``path`` as JSON lines, for the driver to read."""
    from ray.train import UserCallback

    class ReportSink(UserCallback):
        def __init__(self, path: str):
            self.path = path

        def _append(self, record: dict) -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=repr) + "\n")

        def after_report(self, run_context, metrics, checkpoint) -> None:
            self._append({"reports": metrics})

        def after_exception(self, run_context, worker_exceptions) -> None:
            self._append({"failures": {str(r): _first_line(e) for r, e in worker_exceptions.items()}})

    return ReportSink(path)


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class _Reports:
    """Reads the report sink's new complete lines."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows, self.failures = path, 0, [], {}
        self.final: dict = {}

    def read(self) -> list[dict]:
        """New per-step rows of rank 0 since the last call."""
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        new = []
        for line in complete.splitlines():
            record = json.loads(line)
            self.failures.update(record.get("failures", {}))
            reports = record.get("reports") or []
            first = reports[0] if reports else {}
            if first.get("final"):
                self.final = first
            elif first:
                new.append(first)
        self.rows += new
        return new


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


def _runtime(args: argparse.Namespace) -> _Runtime:
    """What this driver will use: ``--ray_address``, or a private runtime in a fresh ``/tmp/ray-*``
    (short: Ray's socket paths must stay under 108 characters)."""
    if args.ray_address is None:
        return _Runtime(None, Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp")))
    return _Runtime(args.ray_address)


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
    for name in ("train_data_dir", "output_dir", "resume_from_checkpoint", "pretrained_model_name_or_path"):
        value = getattr(config, name)
        if value and value != "latest" and (name in ("train_data_dir", "output_dir") or Path(value).exists()):
            setattr(config, name, str(Path(value).resolve()))


def _status(status_dir: str, rank: int) -> dict:
    try:
        return json.loads((Path(status_dir) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def _train(args: argparse.Namespace, runtime: _Runtime) -> int:
    """Run the TorchTrainer, show the progress bar, write ``ray_run.json``; return the exit code."""
    # imported here: ray.train and ray.train.torch cost 3.6 s CPU on top of helpers.launch (measured
    # with time.process_time); only --launcher ray's driver needs them
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = parse_train_args(list(args.train_args))
    _absolute(config)
    threads, world = args.threads_per_process, args.nproc_per_node * args.num_nodes
    nodes = node_versions()
    check_nodes(nodes, args.nproc_per_node, args.num_nodes, threads)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    sink = work_dir / "ray_reports.jsonl"
    sink.unlink(missing_ok=True)
    variables = worker_backend_variables(args.nproc_per_node, args.num_nodes, threads, args.backend)
    env = {status.STATUS_DIR_ENV: args.status_dir, "OMP_NUM_THREADS": str(threads), BACKEND_ENV: args.backend}
    job = {
        "config": config.to_dict(),
        "env": {**env, **{name: value for name, value, _ in variables}},
        "images_per_step": config.train_batch_size * config.gradient_accumulation_steps * world,
    }
    trainer = TorchTrainer(
        train_worker, train_loop_config=job, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=False, resources_per_worker={"CPU": threads},
                                     placement_strategy="PACK"),
        run_config=RunConfig(name="helpers-ray-launch", storage_path=str(work_dir / "ray_results"),
                             failure_config=FailureConfig(max_failures=0), callbacks=[_sink_reports(str(sink))]),
    )  # fmt: skip
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = err

    print(f"helpers.launching.ray_train: Ray {ray_version()} {'joined at ' + runtime.address if runtime.address else 'started on this machine'} "  # noqa: T201
          f"in {runtime.init_seconds:.1f} s; {world} worker(s) x {threads} CPU(s), nodes: "
          + ", ".join(f"{n['node']} ({n['cpus']:g} CPUs)" for n in nodes), flush=True)  # fmt: skip
    fit_started = time.time()
    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    reports = _Reports(sink)
    bar = tqdm(total=config.max_train_steps, desc="textual inversion (ray)", unit="step", file=sys.stderr)
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
    error = outcome.get("error")
    if error is None:
        print(f"helpers.launching.ray_train: the workers started {startup['workers_started_seconds']} s after the "  # noqa: T201
              f"trainer; {len(rows)} step(s) reported", flush=True)  # fmt: skip
        return 0

    failures = getattr(error, "worker_failures", None) or {}
    # The root cause first: helpers.launch names the first worker this prints.
    for rank, err in sorted(
        failures.items(), key=lambda f: (bool(SECONDARY.search(_first_line(f[1]))), f[0])
    ):
        report = _status(args.status_dir, rank)
        where = f"on node {report.get('host', '?')} (pid {report.get('pid', '?')})"
        print(f"{FAILED_TAG} rank {rank} failed {where}: {_first_line(err)}", flush=True)  # noqa: T201
    if not failures:
        print(f"helpers.launching.ray_train: training failed: {_first_line(error)}", flush=True)  # noqa: T201
    return 1


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
    args = parser.parse_args(argv[:split])
    args.train_args = argv[split + 1 :]
    return args


def main(args: argparse.Namespace) -> int:
    """Connect, check, train, and end the runtime whatever happens; return the exit code."""
    for name, value in DRIVER_ENV.items():
        os.environ[name] = value
    if args.ray_address is None:  # a private runtime: a token for this run only, nothing in ~/.ray
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    signal.signal(signal.SIGTERM, supervise.interrupt)  # helpers.launch stops a job with TERM: clean up first
    status.follow_launcher(args.status_dir)  # a launcher killed outright: TERM, so the same clean-up
    runtime, graceful = _runtime(args), True
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
    # Run the module's own copy: Ray pickles train_worker and the report sink by reference to
    # helpers.launching.ray_train, which every worker imports, not by value from __main__.
    from helpers.launching import ray_train as ray_launch

    raise SystemExit(ray_launch.cli())

"""Before a job starts: can every node be reached, does it have the packages, files and a free port;
does this node have the memory its processes need."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from helpers.core.errors import DistributedError
from helpers.launching.layout import ClusterLayout, is_local_host

PREFLIGHT_PACKAGES = (
    "torch",
    "ray",  # --launcher ray: every node must run the driver's Ray (and torch)
    "accelerate",
    "diffusers",
    "transformers",
    "safetensors",
    "sd-cpu-workshop-helpers",
)


_PROBE = r"""
import json, os, socket, sys
from importlib import metadata
req = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0], "packages": {}, "paths": {}, "port_free": None}
for p in req["packages"]:
    try:
        out["packages"][p] = metadata.version(p)
    except metadata.PackageNotFoundError:
        out["packages"][p] = None
for p in req["paths"]:
    out["paths"][p] = os.path.exists(p)
if req["port"]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", req["port"]))
        out["port_free"] = True
    except OSError:
        out["port_free"] = False
    s.close()
print("PROBE " + json.dumps(out))
"""


_SSH_FIX = (
    "make `ssh -o BatchMode=yes HOST true` work without a prompt: notebook 01's ssh config and key "
    "(ssh-copy-id), the right host name, the node running"
)


_PORT_FIX = "stop the process holding it (an earlier run?) or pick another main_process_port"


@dataclass(frozen=True)
class PreflightProblem:
    """Something that would stop or silently spoil a multi-node run, on one host, with the fix."""

    host: str
    check: str
    detail: str
    fix: str


def _probe(host: str, request: dict, ssh: Sequence[str], timeout: float) -> tuple[dict | None, str, int]:
    """Run the probe on ``host``; return (answer or None, last error line, exit code)."""
    cmd = [sys.executable, "-c", _PROBE, json.dumps(request)]
    if not is_local_host(host):
        cmd = [*ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}", host, shlex.join(cmd)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)
    except FileNotFoundError:
        return None, f"{cmd[0]} not found", 255
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout + 20:.0f} s", 255
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :]), "", 0
    return None, (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1], out.returncode


def check_port(layout: ClusterLayout, ssh: Sequence[str] = ("ssh",), timeout: float = 10.0) -> None:
    """Refuse a rendezvous port that is in use on the main host, before any rank starts.

    Without this check a busy port fails the job a minute later in every rank's tracebacks. The
    main host is this machine (a bind, as rank 0 will) or another reached over ssh (the probe of
    :func:`preflight`; a host that cannot be reached is :func:`preflight`'s to report).

    Raises:
        DistributedError: the port is in use; one line naming it and the fix.
    """
    head = layout.main_process_ip if layout.main_process_ip in layout.hosts else layout.hosts[0]
    port = int(layout.main_process_port)
    if layout.main_process_ip in ("127.0.0.1", "localhost") or is_local_host(head):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                return
            except OSError:
                where = "this machine"
    else:
        got, _, _ = _probe(head, {"packages": [], "paths": [], "port": port}, ssh, timeout)
        if got is None or got["port_free"] is not False:
            return
        where = head
    raise DistributedError(
        f"--main_process_port {port} is in use on {where} (another job?): pass another free port, or leave "
        "the flag out on one machine (a free port is then picked)"
    )


def preflight(
    layout: ClusterLayout,
    data_dir: str | os.PathLike,
    *,
    paths: Sequence[str | os.PathLike] = (),
    packages: Sequence[str] = PREFLIGHT_PACKAGES,
    ssh: Sequence[str] = ("ssh",),
    timeout: float = 10.0,
) -> list[PreflightProblem]:
    """Check every node before a multi-node run; return what is wrong (empty: all good).

    Per host: reachable over ssh without a password prompt (``BatchMode``), this interpreter at
    the same path, the same Python and package versions as this machine, ``data_dir`` and
    ``paths`` present; on the head node: ``main_process_port`` free. Hosts that name this
    machine are checked without ssh.

    Args:
        layout: the cluster.
        data_dir: the concept images (relative paths are taken from the current folder).
        paths: more files every node needs (e.g. the accelerate config).
        packages: distributions whose versions must match.
        ssh: the ssh command, e.g. ``("ssh", "-F", "cluster/ssh_config")``.
        timeout: seconds to wait for each ssh connection.
    """
    wanted = [os.path.abspath(p) for p in (data_dir, *paths)]
    head = layout.main_process_ip if layout.main_process_ip in layout.hosts else layout.hosts[0]
    request = {"packages": list(packages), "paths": wanted, "port": 0}
    reference, err, _ = _probe("localhost", request, ssh, timeout)
    if reference is None:
        raise RuntimeError(f"cannot probe this machine itself: {err}")
    env_fix = f"install the same environment at {sys.executable} on every node (make setup)"
    problems: list[PreflightProblem] = []
    for host in layout.hosts:
        request["port"] = int(layout.main_process_port) if host == head else 0
        got, err, code = _probe(host, request, ssh, timeout)
        found: list[tuple[str, str, str]] = []  # (check, detail, fix)
        if got is None and code == 255:  # ssh's own failures exit 255
            found.append(("ssh", err, _SSH_FIX))
        elif got is None:
            found.append(("python", f"{sys.executable} did not run: {err}", env_fix))
        else:
            if got["python"] != reference["python"]:
                found.append(("python", f"Python {got['python']}, here {reference['python']}", env_fix))
            ref = reference["packages"]
            found += [
                ("packages", f"{p} {v}, here {ref[p]}", env_fix)
                for p, v in got["packages"].items()
                if v != ref[p]
            ]
            fix = "copy it to every node at the same path: rsync -a {0} {1}:{0}"
            found += [
                ("files", f"{f} is missing", fix.format(f, host)) for f, ok in got["paths"].items() if not ok
            ]
            if got["port_free"] is False:
                found.append(("port", f"port {layout.main_process_port} is in use", _PORT_FIX))
        problems += [PreflightProblem(host, *f) for f in found]
    return problems


# --- memory ---------------------------------------------------------------------------------
# Kept here, below helpers.cluster (which may not be imported from here): helpers.launch warns with
# them before a job starts, and helpers.cluster.estimates sizes a cluster's nodes with the same rows.


@dataclass(frozen=True)
class PeakMemory:
    """One measured whole-process peak RSS of the engine training a model of ``shape``'s layer sizes
    (``"sd15"``: Stable Diffusion v1.5's; ``"sdxl"``: SDXL base 1.0's)."""

    resolution: int
    precision: str  # "bf16" or "no" (fp32)
    prepack: bool  # prepack_convs or prepack_linears on (the default: below 512 px, where the copies fit), else both off
    peak_mib: float
    source: str  # the bench/results file it comes from (bench.train_step or bench.end_to_end)
    shape: str = "sd15"


_XEON = "bench/results/xeon-avx512/"
# fp32 from the 2-core Xeon, the engine as it is. bf16 from the EPYC (emulated bf16 is far too slow
# to measure on a CPU without it), measured before the input gradient's copies were made in the
# forward; its frozen weights are casts, not file pages, so handing pages back does not change it.
MEASURED_MEMORY: tuple[PeakMemory, ...] = (
    PeakMemory(256, "no", True, 8532.4, _XEON + "train_memory-sd15-shape-256px.json"),
    PeakMemory(256, "no", False, 5143.9, _XEON + "train_memory-sd15-shape-256px.json"),
    PeakMemory(512, "no", True, 9917.1, _XEON + "train_memory-sd15-shape-512px.json"),
    PeakMemory(512, "no", False, 6497.9, _XEON + "train_memory-sd15-shape-512px.json"),
    PeakMemory(256, "bf16", True, 5495.4, "bench/results/train_step-sd15-shape-256px-bf16.json"),
    # SDXL: the whole command in bench.end_to_end on the EPYC (AVX512-BF16), its first run (the VAE
    # encodes the pictures) and its save (the pipeline's parts copied, not rewritten) included.
    PeakMemory(512, "bf16", False, 14980.9, "bench/results/end_to_end-sdxl-shape-512px-6steps-bf16.json", "sdxl"),
    # fp32 does not fit 23.5 GiB at 512 px: measured at 256 px with --no-prepack (the default from 512 px)
    PeakMemory(256, "no", False, 15111.9, "bench/results/end_to_end-sdxl-shape-256px-3steps-fp32-unpacked.json", "sdxl"),
)  # fmt: skip
# Resident weights (GiB) of the SD v1.5 shape's UNet and text encoder, counted from its modules:
# UNet 3.20 GiB in fp32 (convolutions 2.19, linear layers 1.01), text encoder 0.46 (linear 0.32).
# Prepacked, each packed weight adds one weight's worth (two copies, the dense weight freed); in
# bf16 the UNet is bf16 and the fp32 text encoder keeps its weights beside two bf16 copies.
# SDXL's (counted the same way): UNet 9.56 GiB in fp32 (convolutions 1.24, linear layers 8.32), the two
# text encoders 3.04, kept in fp32 (linear layers 2.67); with bf16 the UNet is bf16. Its prepacked
# copies depend on the CPU (bf16 linear layouts need AMX) and are not measured: no figure for them.
RESIDENT_WEIGHTS_GIB = {
    ("sd15", "no", False): 3.66, ("sd15", "no", True): 7.18, ("sd15", "bf16", False): 2.06,
    ("sd15", "bf16", True): 3.98, ("sdxl", "no", False): 12.61, ("sdxl", "bf16", False): 7.83,
}  # fmt: skip


def memory_per_process(resolution: int, precision: str, prepack: bool = True, shape: str = "sd15") -> int:
    """Bytes one training process needs at its peak: the measured peak of :data:`MEASURED_MEMORY`
    for ``shape`` at the nearest resolution; at another one, the part above the resident weights
    (:data:`RESIDENT_WEIGHTS_GIB`: activations, libraries) scaled with the pixels (stated by
    :func:`memory_basis`). Without a measurement unpacked, the prepacked one less the copies.

    Raises:
        ValueError: nothing measured for this shape, precision and prepacking.
    """
    basis, derived = _memory_row(resolution, precision, prepack, shape)
    weights = RESIDENT_WEIGHTS_GIB[(shape, basis.precision, basis.prepack)] * 2**30
    rest = basis.peak_mib * 2**20 - weights
    if derived:
        weights = RESIDENT_WEIGHTS_GIB[(shape, precision, prepack)] * 2**30
    return int(weights + rest * (resolution / basis.resolution) ** 2)


def _memory_row(resolution: int, precision: str, prepack: bool, shape: str) -> tuple[PeakMemory, bool]:
    """The measured row of ``shape`` nearest in pixels to ``resolution`` with this precision and
    prepacking (else with the other prepacking, where the weights of both are known), and whether
    it is the other."""
    rows = [m for m in MEASURED_MEMORY if m.precision == precision and m.shape == shape]
    if not rows:
        measured = sorted({m.precision for m in MEASURED_MEMORY if m.shape == shape})
        raise ValueError(
            f"precision={precision!r}: no memory measured for the {shape} shape (measured: {measured})"
        )
    same = [m for m in rows if m.prepack == prepack]
    if not same and (shape, precision, prepack) not in RESIDENT_WEIGHTS_GIB:
        raise ValueError(f"{shape}, {precision}, prepack={prepack}: no memory measured nor derivable")
    return min(same or rows, key=lambda m: abs(m.resolution**2 - resolution**2)), not same


def memory_basis(resolution: int, precision: str, prepack: bool = True, shape: str = "sd15") -> str:
    """Where :func:`memory_per_process` takes its number from, in one sentence."""
    basis, derived = _memory_row(resolution, precision, prepack, shape)
    notes = [f"{basis.peak_mib / 1024:.1f} GiB measured at {basis.resolution} px ({basis.source})"]
    if derived:
        notes.append("less the prepacked copies (not measured unpacked)")
    if resolution != basis.resolution:
        notes.append(
            f"the part above the weights scaled by the pixels (x{(resolution / basis.resolution) ** 2:g})"
        )
    return "; ".join(notes)


# What a rank holds before any model loads: the trainer's Python with torch, diffusers, transformers
# and accelerate imported, 0.49 GiB measured (torch 2.13, diffusers 0.39), and under mpirun and
# torchrun accelerate's own launcher process besides it (0.22 GiB more). Fewer bytes per rank than
# this and the ranks cannot even start.
RANK_START_BYTES = 2**29


def check_ranks_fit(nproc_per_node: int, nodes_here: int = 1, node_bytes: int | None = None) -> None:
    """Refuse a job whose ranks on this machine cannot all start in its memory, whatever the model.

    A rank count typed wrong (``--nproc_per_node 200`` for threads) would otherwise start that many
    Python processes and push the machine into swap or the out-of-memory killer before anything
    else could fail. :func:`memory_warning` warns about the models whose training memory is measured.

    Raises:
        DistributedError: one line with the most ranks that fit.
    """
    have = local_memory_bytes() if node_bytes is None else node_bytes
    processes = nproc_per_node * nodes_here
    if processes * RANK_START_BYTES <= have:
        return
    gib = 2**30
    raise DistributedError(
        f"--nproc_per_node {nproc_per_node}: {processes} ranks on this machine cannot start, each takes "
        f"~{RANK_START_BYTES / gib:.1f} GiB before any model loads (Python with torch and diffusers) and this "
        f"machine has {have / gib:.1f} GiB; pass at most --nproc_per_node {max(1, have // RANK_START_BYTES // nodes_here)}"
    )


def local_memory_bytes() -> int:
    """This machine's total memory (``MemTotal`` of ``/proc/meminfo``, through psutil)."""
    return psutil.virtual_memory().total


def memory_warning(
    nproc_per_node: int,
    resolution: int,
    precision: str,
    prepack: bool = True,
    *,
    shape: str = "sd15",
    nodes_here: int = 1,
    node_bytes: int | None = None,
) -> str | None:
    """The one-line warning when the processes this node would run need more than its memory, else None.

    The need is :func:`memory_per_process` (the engine training a model of ``shape``) times
    the processes; the memory is this machine's total (:func:`local_memory_bytes`). Only this node
    can be checked here: the memory of other nodes (a hostfile's remote hosts, the nodes of a Ray
    cluster) is not known to the launcher, so they are not checked.

    Args:
        nproc_per_node: processes per node.
        resolution, precision, prepack: the run's pixels, ``"no"`` (fp32) or ``"bf16"`` as resolved
            for this CPU, and whether the frozen weights are prepacked.
        shape: the model's layer sizes, ``"sd15"`` or ``"sdxl"``.
        nodes_here: nodes of the job that are this machine (tests run several "nodes" on one).
        node_bytes: this node's memory (default: :func:`local_memory_bytes`).
    """
    need = memory_per_process(resolution, precision, prepack, shape)
    have = local_memory_bytes() if node_bytes is None else node_bytes
    processes = nproc_per_node * nodes_here
    if processes * need <= have:
        return None
    gib = 2**30
    who = f"{processes} process{'es' if processes > 1 else ''} {'per node' if nodes_here == 1 else 'on this machine'}"
    fit = have // need // nodes_here
    fix = (
        f"pass --nproc_per_node {fit}"
        if fit
        else "not even one process per node fits: use a node with more memory"
    )
    return (
        f"warning: {who} × ~{need / gib:.1f} GiB each ({'SDXL, ' if shape == 'sdxl' else ''}"
        f"{'fp32' if precision == 'no' else precision}, "
        f"{resolution} px) need {processes * need / gib:.1f} GiB; this node has {have / gib:.1f} GiB — "
        f"expect swapping or an out-of-memory kill; {fix}"
    )

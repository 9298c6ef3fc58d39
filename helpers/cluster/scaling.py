"""How training scales over nodes and processes: a small model, ours against the full-matrix reference.

A data-parallel step is compute, then one all-reduce of the trainable gradient (the learned rows
are the last gradient the backward produces, so nothing overlaps it)::

    seconds per step = compute per process + all-reduce
    images per second = nodes x processes per node x batch / seconds per step

* **Compute** is a measured step (:mod:`helpers.cluster.estimates`: ``bench/results/**/train_step-*.json``),
  scaled to the resolution and batch and to the cores each process gets, linearly (optimistic),
  from the row of the machine's CPU family (AMX or not). The reference's step is ours times the
  reference/ours ratio measured beside it in the same file.
* **All-reduce** is a ring over ``p = nodes x processes per node`` ranks, placed node by node:
  ``2 (p - 1)`` steps, each moving ``bytes / p`` over every hop at once, so a step lasts as long as
  its slowest hop: ``latency + bytes / p / bandwidth``. Hops inside a node use :data:`LOOPBACK`
  (gloo over TCP on 127.0.0.1, fitted by ``bench/scaling.py``); hops between nodes use the VM size's
  published network bandwidth (:func:`helpers.cluster.prices.network_gbps`) and the loopback latency
  plus :data:`NETWORK_LATENCY_S`. ``backend="ccl"`` uses :data:`CCL_LOOPBACK` instead (oneCCL over
  shared memory, fitted by ``bench/scaling.py --backend ccl``; None where no fit is committed).
* **Bytes**: ours all-reduces ``num_vectors x 768`` fp32 values (3,072 bytes for one vector), the
  reference the whole 49,409 x 768 matrix (151,784,448 bytes), whatever the precision of the step.

Where it is wrong: cores do not scale linearly (a process with 28 threads is slower than 14 times
one with 2); the loopback link is measured on a 2-core machine where both ranks share the cores,
so a big VM's loopback is faster; the published bandwidth is an upper limit that one gloo TCP
stream does not reach; oneCCL and MPI may use other algorithms than a ring; start-up, data
loading and checkpoints are not counted. :func:`guide_check` compares the model with the one
published measurement we know of.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from helpers.cluster import estimates
from helpers.cluster import prices as azure_data
from helpers.core.errors import InputError

HIDDEN = 768  # SD v1.5's text-embedding width
VOCABULARY = 49_409  # SD v1.5's tokenizer (49,408) plus one placeholder
FP32 = 4


def allreduced_bytes(mode: str, num_vectors: int = 1) -> int:
    """Bytes one step all-reduces on SD v1.5: ``"ours"`` (the learned rows) or ``"reference"`` (the matrix)."""
    if mode == "ours":
        return num_vectors * HIDDEN * FP32
    if mode == "reference":
        return (VOCABULARY + num_vectors - 1) * HIDDEN * FP32
    raise InputError(f"mode={mode!r}: use 'ours' or 'reference'")


@dataclass(frozen=True)
class Link:
    """One hop of a ring all-reduce: a fixed cost per ring step and a bandwidth."""

    latency_s: float
    bytes_per_s: float


# Fitted by bench/scaling.py (bench/results/scaling-loopback.json): gloo, 2 processes x 1 thread, on
# the 2-core AMD EPYC the other benchmarks ran on. A test keeps these equal to the file's fit.
LOOPBACK = Link(latency_s=144e-6, bytes_per_s=1.78e9)
LOOPBACK_SOURCE = "bench/results/scaling-loopback.json"
# The ccl backend's link inside a node (helpers.ranks.oneccl: oneCCL over libfabric's shared memory),
# fitted by `python -m bench.scaling --backend ccl` into CCL_LOOPBACK_SOURCE, on a 2-core Xeon: not the
# machine LOOPBACK comes from. The same Xeon's gloo fit (xeon-avx512/scaling-loopback.json) is the
# like-for-like comparison; tests/cluster/test_scaling.py keeps this equal to its source.
CCL_LOOPBACK: Link | None = Link(latency_s=31e-6, bytes_per_s=3.85e9)
CCL_LOOPBACK_SOURCE = "bench/results/xeon-avx512/scaling-loopback-ccl.json"
# Added to the loopback latency between VMs. Not measured (no second machine here): an assumed
# one-way TCP latency inside an Azure region with accelerated networking.
NETWORK_LATENCY_S = 50e-6


def fit_link(sizes: Sequence[int], seconds: Sequence[float], processes: int) -> Link:
    """Fit :func:`ring_allreduce_seconds` to measured all-reduce times.

    Least squares on the relative error, so the few-byte sizes (latency) count as much as the large
    ones (bandwidth).

    Args:
        sizes: bytes all-reduced, one per measurement.
        seconds: the measured time of each.
        processes: ranks of the measured all-reduce (at least 2).

    Returns:
        The :class:`Link` whose ring time is closest to the measurements.
    """
    import numpy as np

    if processes < 2 or len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fit_link needs at least 2 processes and 2 (size, seconds) pairs of equal length")
    steps = 2 * (processes - 1)
    t = np.asarray(seconds, dtype=float)
    # t = steps * latency + steps / processes * bytes * (1 / bandwidth): linear in (latency, 1/bandwidth)
    design = np.stack([np.full_like(t, steps), steps / processes * np.asarray(sizes, dtype=float)], axis=1)
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(design / t[:, None], np.ones_like(t), rcond=None)
    if inverse_bandwidth <= 0:
        raise ValueError("the measured times do not grow with the size: measure larger sizes")
    return Link(latency_s=max(0.0, float(latency)), bytes_per_s=float(1 / inverse_bandwidth))


def ring_allreduce_seconds(nbytes: float, processes: int, link: Link) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``processes`` ranks whose every hop is ``link``."""
    if processes < 2 or nbytes <= 0:
        return 0.0
    return 2 * (processes - 1) * (link.latency_s + nbytes / processes / link.bytes_per_s)


def allreduce_seconds(
    nbytes: float, nodes: int, nproc_per_node: int, network: Link | None, local: Link = LOOPBACK
) -> float:
    """A ring over ``nodes x nproc_per_node`` ranks placed node by node: each ring step lasts as long
    as its slowest hop (``local`` inside a node, ``network`` between nodes; each node sends on one
    network hop at a time, so it gets the VM's whole bandwidth)."""
    processes = nodes * nproc_per_node
    if processes < 2 or nbytes <= 0:
        return 0.0
    chunk = nbytes / processes
    hops = []
    if nproc_per_node > 1:
        hops.append(local.latency_s + chunk / local.bytes_per_s)
    if nodes > 1:
        if network is None:
            raise ValueError("allreduce_seconds over several nodes needs the network link")
        hops.append(network.latency_s + chunk / network.bytes_per_s)
    return 2 * (processes - 1) * max(hops)


def local_link(backend: str = "gloo") -> Link:
    """The link between two ranks on one node for ``backend`` (``"gloo"`` or ``"ccl"``)."""
    if backend == "gloo":
        return LOOPBACK
    if backend != "ccl":
        raise InputError(f"backend={backend!r}: use 'gloo' or 'ccl'")
    if CCL_LOOPBACK is None:
        raise InputError(
            "backend='ccl': the scaling model has no ccl link yet; run `python -m bench.scaling --backend ccl` "
            f"and put its fit ({CCL_LOOPBACK_SOURCE}) into helpers.cluster.scaling.CCL_LOOPBACK"
        )
    return CCL_LOOPBACK


def network_link(gbps: float, backend: str = "gloo") -> Link:
    """The link between two VMs with ``gbps`` Gbit/s of network bandwidth."""
    return Link(local_link(backend).latency_s + NETWORK_LATENCY_S, gbps * 1e9 / 8)


@dataclass(frozen=True)
class Machine:
    """One node of a cluster, as the model sees it."""

    name: str
    physical_cores: int
    network_gbps: float  # to the other nodes
    precision: str  # "bf16" or "no" (fp32): the measured step it is scaled from
    native_bf16: bool | None = None
    amx: bool | None = None  # picks the measured row of its CPU family (helpers.cluster.estimates)


def azure_machine(vm_size: str) -> Machine:
    """An Azure VM of ``vm_size``: half its vCPUs are cores, its published network bandwidth, bf16
    where the size guarantees native bf16 (else fp32, what ``auto`` picks on a mixed fleet's slower host)."""
    vcpus, row = azure_data.vcpus(vm_size), azure_data.size_series(vm_size)
    gbps = azure_data.network_gbps(vm_size)
    if vcpus is None or row is None or gbps is None:
        raise InputError(
            f"vm_size={vm_size!r}: not in helpers.cluster.prices's size and network tables; use a Dv5, Ev5, "
            "Dsv6 or Esv6 size, or describe the node with scaling.Machine(...)"
        )
    precision = "bf16" if row.native_bf16 else "no"
    return Machine(vm_size, max(1, vcpus // 2), gbps, precision, row.native_bf16, row.amx)


@dataclass(frozen=True)
class Prediction:
    """Predicted speed of one layout in one mode."""

    mode: str
    nodes: int
    nproc_per_node: int
    train_batch_size: int
    compute_s: float
    allreduce_s: float

    @property
    def processes(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def seconds_per_step(self) -> float:
        return self.compute_s + self.allreduce_s

    @property
    def images_per_second(self) -> float:
        return self.processes * self.train_batch_size / self.seconds_per_step


def predict(
    mode: str,
    machine: Machine | str,
    nodes: int,
    nproc_per_node: int,
    resolution: int = 512,
    train_batch_size: int = 1,
    num_vectors: int = 1,
    backend: str = "gloo",
) -> Prediction:
    """Seconds per step and images per second of ``nodes`` machines whose cores are split over
    ``nproc_per_node`` processes each.

    Args:
        mode: ``"ours"`` or ``"reference"`` (the whole matrix trainable and all-reduced).
        machine: a :class:`Machine` or an Azure size name (:func:`azure_machine`).
        nodes: machines (1-16 in the workshop's figure).
        nproc_per_node: processes per machine; they split its cores.
        resolution, train_batch_size, num_vectors: the training settings.
        backend: the process group's backend, whose fitted link the all-reduce uses (:func:`local_link`).

    Returns:
        The :class:`Prediction`, compute and all-reduce apart.
    """
    if isinstance(machine, str):
        machine = azure_machine(machine)
    if nodes < 1 or nproc_per_node < 1:
        raise InputError(f"nodes={nodes}, nproc_per_node={nproc_per_node}: both must be at least 1")
    compute = estimates.training_time(
        1, resolution, train_batch_size, machine.precision, machine.physical_cores, nproc_per_node,
        machine.native_bf16, amx=machine.amx,
    )  # fmt: skip
    step = compute.seconds_per_step
    if mode == "reference":
        step *= compute.basis.reference_seconds_per_step / compute.basis.seconds_per_step
    network = network_link(machine.network_gbps, backend)
    comm = allreduce_seconds(
        allreduced_bytes(mode, num_vectors), nodes, nproc_per_node, network, local_link(backend)
    )
    return Prediction(mode, nodes, nproc_per_node, train_batch_size, step, comm)


# --- the published point --------------------------------------------------------------------------

# The Intel / Hugging Face guide "Fine-tuning Stable Diffusion Models on Intel CPUs" (Hugging Face
# blog, July 2023): 4 servers, each 2 x Xeon Platinum 8480+ (Sapphire Rapids, 56 cores each, AMX),
# diffusers' textual_inversion.py (v0.17.1, with IPEX) under `mpirun -n 16 -ppn 4`, 512 px, batch 1
# per process, bf16; "200 steps should run in about 5 minutes" and 3,000 steps in "about an hour".
# The guide does not give the network between the servers: 25 Gbit/s is an assumption (it hardly
# matters: above ~14 Gbit/s the loopback hops inside a node are the ring's slowest).
GUIDE_MACHINE = Machine("2 x Xeon Platinum 8480+ (guide)", 112, 25.0, "bf16", True, True)
GUIDE = {
    "nodes": 4,
    "nproc_per_node": 4,
    "resolution": 512,
    "train_batch_size": 1,
    "steps": 200,
    "published_seconds": 5 * 60,
    "long_steps": 3000,
    "long_published_seconds": 60 * 60,
}


@dataclass(frozen=True)
class GuideCheck:
    """The model on the guide's setting against the guide's published times."""

    reference: Prediction  # what the guide ran
    ours: Prediction  # the same cluster with our engine
    predicted_seconds: float  # the reference, GUIDE["steps"] steps, start-up not counted
    published_seconds: float
    published_seconds_per_step: float  # from the 3,000-step hour, where start-up matters least

    @property
    def published_images_per_second(self) -> float:
        return self.reference.processes * self.reference.train_batch_size / self.published_seconds_per_step

    def describe(self) -> str:
        """One sentence: the guide's setting, its published times, the model's prediction."""
        g, r = GUIDE, self.reference
        return (
            f"The guide's run ({g['nodes']} nodes x {g['nproc_per_node']} processes, {g['resolution']} px, "
            f"batch {g['train_batch_size']}, bf16): {g['steps']} steps in about "
            f"{self.published_seconds / 60:.0f} min, 3,000 in about an hour "
            f"({self.published_seconds_per_step:.2f} s per step). The model, for the reference it ran: "
            f"{r.compute_s:.2f} s compute + {r.allreduce_s:.2f} s all-reduce = {r.seconds_per_step:.2f} s "
            f"per step, {self.predicted_seconds / 60:.1f} min for {g['steps']} steps "
            f"({self.predicted_seconds / self.published_seconds:.2f} of the published time, start-up not "
            f"counted). Ours on that cluster: {self.ours.seconds_per_step:.2f} s per step."
        )


def guide_check(machine: Machine = GUIDE_MACHINE) -> GuideCheck:
    """Predict the guide's published run (:data:`GUIDE` on :data:`GUIDE_MACHINE`) from our measurements.

    The bf16 step is the row measured on a Xeon with AMX, the guide's CPU family (2 vCPUs of a
    cloud VM), scaled linearly from 2 to 28 cores per process. 28 threads are less than 14x as
    fast as 2, so the model predicts too little time; the guide also ran older libraries (torch 2.0,
    IPEX, diffusers 0.17) than the reference measured here.
    """
    g = GUIDE
    settings = dict(nodes=g["nodes"], nproc_per_node=g["nproc_per_node"], resolution=g["resolution"],
                    train_batch_size=g["train_batch_size"])  # fmt: skip
    reference, ours = predict("reference", machine, **settings), predict("ours", machine, **settings)
    return GuideCheck(
        reference=reference,
        ours=ours,
        predicted_seconds=g["steps"] * reference.seconds_per_step,
        published_seconds=g["published_seconds"],
        published_seconds_per_step=g["long_published_seconds"] / g["long_steps"],
    )


# --- the backend's effect on a measured step ---------------------------------------------------------

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True)
class BackendEffect:
    """The same 2-process training job measured on gloo and on ccl (``bench.allreduce --backends gloo ccl``)."""

    source: str  # the result file, relative to the repository
    model: str
    seconds_per_step: dict[str, float]  # median per backend
    cpu: str
    load_average: float  # the machine's 1-minute load when the bench started

    def describe(self) -> str:
        gloo, ccl = self.seconds_per_step["gloo"], self.seconds_per_step["ccl"]
        return (
            f"The same 2-process step ({self.model}, one machine) took {gloo:.3f} s on gloo and {ccl:.3f} s "
            f"on ccl ({gloo / ccl:.2f}x), measured by bench.allreduce on {self.cpu} under a load average of "
            f"{self.load_average:.1f} ({self.source}; figures from a shared machine are noisy)."
        )


def backend_effect(results: Path = RESULTS) -> BackendEffect | None:
    """The first ``allreduce_backends-*.json`` under ``results`` (path order) that holds a training
    step on both backends; None where no such file is committed."""
    for path in sorted(results.glob("**/allreduce_backends-*.json")):
        report = json.loads(path.read_text())
        step = report.get("train_step") or {}
        seconds = step.get("median_seconds_per_step") or {}
        if {"gloo", "ccl"} <= set(seconds):
            machine = report["machine"]
            source = str(path.relative_to(results.parents[1])) if results == RESULTS else str(path)
            return BackendEffect(source, step["model"], seconds, machine["cpu"], machine["load_average"][0])
    return None


# --- the figure -----------------------------------------------------------------------------------

# (machine, processes per node): notebook 01's default size, a large AMX size, the guide's servers.
FIGURE_LAYOUTS: tuple[tuple[Machine | str, int], ...] = (
    ("Standard_D8_v5", 2),
    ("Standard_D96s_v6", 4),
    (GUIDE_MACHINE, 4),
)


def curves(
    layouts: Sequence[tuple[Machine | str, int]] = FIGURE_LAYOUTS, max_nodes: int = 16, **settings
) -> dict[tuple[str, str], tuple[list[int], list[float]]]:
    """Predicted images/s against processes for 1..``max_nodes`` nodes of each (machine, processes
    per node), ours and the reference: ``{(layout label, mode): (processes, images/s)}``."""
    out = {}
    for machine, nproc in layouts:
        machine = azure_machine(machine) if isinstance(machine, str) else machine
        label = f"{machine.name}, {nproc} per node"
        for mode in ("ours", "reference"):
            preds = [predict(mode, machine, n, nproc, **settings) for n in range(1, max_nodes + 1)]
            out[(label, mode)] = ([p.processes for p in preds], [p.images_per_second for p in preds])
    return out

"""How long the real workshop's training takes: expected wall time from measured step times.

The notebooks run offline on a toy model in minutes; their real defaults (Stable Diffusion v1.5,
512 px, 1000 steps) take hours on a small machine. :data:`MEASURED` holds step times measured by
``bench.train_step`` (each row names its result file in ``bench/results``); :func:`training_time`
scales the nearest one to a run's settings and a machine's cores, and says how it did. Notebook 02
shows the estimate for this machine, notebook 01 turns it into the cluster's hours and cost, and
notebook 07 prices SDXL runs per Azure size (:func:`cluster_run`: the processes that fit a node's
memory, their hours, the VMs' list price).

The scaling is stated, not hidden: time per step grows with images per process and with pixels
(from the nearest measured resolution), and shrinks with physical cores per process (linear, which
is optimistic). Rows are kept per CPU family (native bf16 or not, AMX or not): a machine takes the
row of its own family where there is one, else the slowest row of the same precision, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.cluster import prices as azure_data
from helpers.launching.preflight import (  # noqa: F401 - MEASURED_MEMORY, PeakMemory... are read from here too
    MEASURED_MEMORY,
    RESIDENT_WEIGHTS_GIB,
    PeakMemory,
    memory_basis,
    memory_per_process,
)

# The real defaults of notebook 02 (its parameters cell; a test keeps the two equal).
WORKSHOP_DEFAULTS = {"max_train_steps": 1000, "resolution": 512, "train_batch_size": 1}


@dataclass(frozen=True)
class StepTime:
    """One measured training step of the engine on a model's shape (SD v1.5's unless ``shape`` says)."""

    cpu: str
    native_bf16: bool
    amx: bool
    physical_cores: int
    resolution: int
    batch: int
    precision: str  # "bf16" or "no" (fp32)
    seconds_per_step: float
    reference_seconds_per_step: float  # diffusers' full-matrix step, measured beside it
    source: str  # the bench/results file it comes from
    shape: str = "sd15"  # "sd15" (bench.train_step) or "sdxl" (bench.end_to_end: whole commands)


EPYC = "AMD EPYC (AVX-512, AVX512-BF16)"
XEON_AMX = "Intel Xeon (AMX, AVX512-BF16)"
XEON_BF16 = "Intel Xeon (AVX512-BF16, no AMX)"
MEASURED: tuple[StepTime, ...] = (
    StepTime(EPYC, True, False, 2, 256, 1, "bf16", 1.42, 2.87, "bench/results/train_step-sd15-shape-256px-bf16.json"),
    StepTime(EPYC, True, False, 2, 256, 1, "no", 2.31, 4.45, "bench/results/train_step-sd15-shape-256px.json"),
    StepTime(XEON_AMX, True, True, 2, 256, 1, "bf16", 0.72, 1.92,
             "bench/results/xeon-amx/train_step-sd15-shape-256px-bf16.json"),
    StepTime(XEON_AMX, True, True, 2, 256, 1, "no", 1.97, 3.51,
             "bench/results/xeon-amx/train_step-sd15-shape-256px.json"),
    StepTime(XEON_BF16, True, False, 2, 512, 1, "bf16", 29.05, 42.78,
             "bench/results/xeon-avx512-bf16/end_to_end-sdxl-shape-512px-3steps-bf16.json", "sdxl"),
    StepTime(XEON_BF16, True, False, 2, 256, 1, "no", 9.06, 10.82,
             "bench/results/xeon-avx512-bf16/end_to_end-sdxl-shape-256px-3steps-fp32-unpacked.json", "sdxl"),
    StepTime(XEON_AMX, True, True, 2, 512, 1, "bf16", 4.89, 9.28,
             "bench/results/xeon-amx/end_to_end-sdxl-shape-512px-6steps-bf16.json", "sdxl"),
)  # fmt: skip


@dataclass(frozen=True)
class TrainingTime:
    """Expected wall time of a training run, with the measurement it is scaled from."""

    seconds: float
    seconds_per_step: float
    basis: StepTime
    scaling: str

    @property
    def hours(self) -> float:
        return self.seconds / 3600

    def describe(self) -> str:
        """One sentence for a person: the estimate, then where it comes from."""
        b = self.basis
        return (
            f"about {_duration(self.seconds)} ({self.seconds_per_step:.3g} s per step), scaled from "
            f"{b.seconds_per_step:g} s per step measured at {b.resolution} px, batch {b.batch}, "
            f"{'bf16' if b.precision == 'bf16' else 'fp32'}, on {b.physical_cores} cores of {b.cpu} "
            f"({b.source}); {self.scaling}"
        )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def training_time(
    max_train_steps: int,
    resolution: int,
    train_batch_size: int,
    precision: str,
    physical_cores: int,
    processes: int = 1,
    native_bf16: bool | None = None,
    cpu: str | None = None,
    amx: bool | None = None,
    shape: str = "sd15",
) -> TrainingTime:
    """Expected wall time of ``max_train_steps`` optimizer steps.

    Args:
        max_train_steps: optimizer steps (each is one batch on every process).
        resolution: training pixels.
        train_batch_size: images per process per step.
        precision: ``"bf16"`` or ``"no"`` (fp32), as resolved for the machine.
        physical_cores: physical cores of one node (hyper-threads do not count).
        processes: training processes per node; they split the node's cores.
        native_bf16: whether the CPU computes bf16 natively (None: unknown); picks the row.
        cpu: the CPU's name, to say when the measurement comes from another CPU.
        amx: whether the CPU has AMX (None: unknown); picks the row. Where the family is not
            known, the slowest candidate is the estimate.
        shape: the model's shape, ``"sd15"`` or ``"sdxl"``: only its own rows are a basis.

    Raises:
        ValueError: no step of ``shape`` is measured.
    """
    shaped = [m for m in MEASURED if m.shape == shape]
    if not shaped:
        raise ValueError(
            f"shape={shape!r}: no step time measured (measured: {sorted({m.shape for m in MEASURED})})"
        )
    rows = [m for m in shaped if m.precision == precision] or shaped
    same_family = [m for m in rows if native_bf16 in (None, m.native_bf16) and amx in (None, m.amx)]
    basis = min(same_family or rows, key=lambda m: (abs(m.resolution - resolution), -m.seconds_per_step))
    cores_per_process = max(1, physical_cores // max(1, processes))
    per_step = (
        basis.seconds_per_step
        * (train_batch_size / basis.batch)
        * (resolution / basis.resolution) ** 2
        * (basis.physical_cores / cores_per_process)
    )
    notes = []
    if resolution != basis.resolution:
        notes.append(f"pixels x{(resolution / basis.resolution) ** 2:g}")
    if cores_per_process != basis.physical_cores:
        notes.append(f"{cores_per_process} cores per process, assumed to scale linearly (optimistic)")
    if precision != basis.precision:
        notes.append("no measurement in this precision yet")
    if not same_family or (cpu and basis.cpu.split(" (")[0].split()[-1] not in cpu):  # EPYC, Xeon
        notes.append(f"measured on another CPU than {cpu or 'this one'}: its own speed may differ a lot")
    scaling = "; ".join(notes) or "measured as is"
    return TrainingTime(per_step * max_train_steps, per_step, basis, scaling)


def workshop_time(report) -> TrainingTime:
    """The real defaults of notebook 02 (:data:`WORKSHOP_DEFAULTS`) on the machine of ``report``
    (a :func:`helpers.core.cpu.report`)."""
    return training_time(**WORKSHOP_DEFAULTS, precision=report.precision, physical_cores=report.physical_cores,
                         native_bf16=report.native_bf16, cpu=report.model_name,
                         amx=bool(report.isa_flags.get("amx_bf16")))  # fmt: skip


def cluster_time(
    vm_size: str,
    node_count: int,
    nproc_per_node: int = 2,
    images: int = WORKSHOP_DEFAULTS["max_train_steps"] * WORKSHOP_DEFAULTS["train_batch_size"],
    resolution: int = WORKSHOP_DEFAULTS["resolution"],
    shape: str = "sd15",
) -> TrainingTime:
    """``images`` spread over a cluster of ``vm_size`` nodes (notebooks 01, 03-04 and 07).

    By default the cluster trains on as many images as notebook 02 does on one machine (1000 steps
    of one image). Each process takes one image per step: ``ceil(images / world size)`` steps.
    Hyper-threads do not count (an Azure vCPU is half a core). Mixed fleets (Dv5: Ice Lake or
    Sapphire Rapids) are estimated in the precision ``auto`` picks on the slower host (:func:`vm_precision`).
    """
    vcpus = azure_data.vcpus(vm_size)
    if vcpus is None:
        raise ValueError(f"vm_size={vm_size!r}: not an Azure size name such as Standard_D8_v5")
    row = azure_data.size_series(vm_size)
    world = node_count * nproc_per_node
    return training_time(-(-images // world), resolution, 1, vm_precision(vm_size), max(1, vcpus // 2),
                         nproc_per_node, row.native_bf16 if row else None, row.cpu if row else vm_size,
                         row.amx if row else None, shape)  # fmt: skip


def vm_precision(vm_size: str) -> str:
    """``"bf16"`` where every host of ``vm_size`` computes bf16 natively, else ``"no"`` (fp32)."""
    row = azure_data.size_series(vm_size)
    return "bf16" if row and row.native_bf16 else "no"


@dataclass(frozen=True)
class ClusterRun:
    """One training run on ``node_count`` nodes of ``vm_size``: processes that fit, hours, dollars."""

    vm_size: str
    node_count: int
    resolution: int
    precision: str
    processes_per_node: int  # 0: one process does not fit a node's memory
    time: TrainingTime | None  # None where nothing fits
    usd_per_node_hour: float | None  # None: the size has no price in helpers.cluster.prices

    @property
    def usd(self) -> float | None:
        """The nodes' list price over the training hours (not the set-up, disks or network)."""
        if self.time is None or self.usd_per_node_hour is None:
            return None
        return round(self.time.hours * self.node_count * self.usd_per_node_hour, 2)

    def row(self) -> dict:
        """The run as a table row for a notebook."""
        return {
            "VM size": self.vm_size, "px": self.resolution, "precision": "bf16" if self.precision == "bf16" else "fp32",
            "processes per node": self.processes_per_node,
            "hours": round(self.time.hours, 1) if self.time else None, "USD (VMs, training only)": self.usd,
        }  # fmt: skip


def cluster_run(
    vm_size: str,
    node_count: int,
    images: int,
    resolution: int,
    shape: str = "sd15",
    max_processes_per_node: int = 4,
) -> ClusterRun:
    """``images`` of ``resolution`` px on ``node_count`` nodes of ``vm_size``, each running as many
    processes as fit its memory (unpacked weights, the default from 512 px), at most
    ``max_processes_per_node``; :func:`cluster_time` for the hours and the price table for the dollars."""
    precision = vm_precision(vm_size)
    fit = min(max_processes_per_node, processes_that_fit(vm_size, resolution, precision, False, shape))
    time = cluster_time(vm_size, node_count, fit, images, resolution, shape) if fit else None
    return ClusterRun(
        vm_size, node_count, resolution, precision, fit, time, azure_data.vm_usd_per_hour(vm_size)
    )


# --- memory ---------------------------------------------------------------------------------


# One process's peak memory (PeakMemory rows, memory_per_process, memory_basis) lives in
# helpers.launching.preflight, below this layer, where helpers.launch warns with it before a job starts.

# Azure's documented memory per vCPU of the series in helpers.cluster.prices (D: 4 GiB, E: 8 GiB;
# the series pages in prices.SIZES_SOURCES), and what a node keeps for its OS and daemons.
GIB_PER_VCPU = {"D": 4, "E": 8}
OS_RESERVE_GIB = 2.0


def node_memory_bytes(vm_size: str) -> int:
    """Memory of one ``vm_size`` node (e.g. 32 GiB for ``Standard_D8_v5``)."""
    vcpus, row = azure_data.vcpus(vm_size), azure_data.size_series(vm_size)
    if vcpus is None or row is None:
        raise ValueError(
            f"vm_size={vm_size!r}: not a size of {', '.join(r.series for r in azure_data.SIZE_SERIES)}"
        )
    return vcpus * GIB_PER_VCPU[row.series[0]] * 2**30


def processes_that_fit(
    vm_size: str, resolution: int, precision: str, prepack: bool = True, shape: str = "sd15"
) -> int:
    """How many training processes of a ``shape`` model fit one ``vm_size`` node: its memory less
    :data:`OS_RESERVE_GIB`, over :func:`memory_per_process` (0 if not even one fits)."""
    usable = node_memory_bytes(vm_size) - OS_RESERVE_GIB * 2**30
    return max(0, int(usable // memory_per_process(resolution, precision, prepack, shape)))


def time_box(report) -> str:
    """Markdown for notebook 02: how long the real run takes on this machine (``report``: cpu.report())."""
    real = workshop_time(report)
    d = WORKSHOP_DEFAULTS
    return (
        f"> **Time.** The workshop's real run (Stable Diffusion v1.5, {d['max_train_steps']} steps at "
        f"{d['resolution']} px, batch {d['train_batch_size']}) takes on this machine {real.describe()}. "
        "Notebook 01 turns the same measurements into the cluster's hours and cost."
    )

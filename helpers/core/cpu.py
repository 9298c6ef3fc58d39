"""What this CPU can do, and the precision and thread settings that follow from it.

bf16 is only fast where the CPU has it natively (AVX512-BF16 or AMX). Elsewhere PyTorch emulates
it and a Stable Diffusion training step becomes many times slower than in fp32 (docs/architecture.md;
no result file in bench/results measures it: they were all taken on CPUs with native bf16), so
``auto`` picks bf16 only where it is native. Native is not always faster either: with AVX512-BF16
and no AMX, one Xeon multiplies bf16 matrices at half its fp32 speed (its bf16 step is 1.5 times
slower than fp32) and an AMD EPYC at 2.3 times (its bf16 step 1.7 times faster), so there ``auto``
measures this CPU's matrix products before choosing (:func:`bf16_gemm_speedup`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# CPU flags (as in /proc/cpuinfo) that matter for deep learning on the CPU.
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class PrecisionChoice:
    """The mixed-precision mode to train with, and why."""

    mixed_precision: str  # "no" or "bf16" (accelerate's names)
    reason: str
    warning: str | None = None


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype the frozen models compute in for accelerate's ``mixed_precision`` ("no" or "bf16")."""
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


@dataclass
class CPUReport:
    """Cores, ISA flags and the precision this machine should train with."""

    model_name: str
    physical_cores: int
    logical_cores: int
    isa_flags: dict[str, bool] = field(default_factory=dict)
    native_bf16: bool = False
    precision: str = "no"
    reason: str = ""
    torch_threads: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


@cache
def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty on systems without /proc/cpuinfo, or without "flags" in it)."""
    return frozenset(cpuinfo_field("flags", cpuinfo).split())


def cpuinfo_field(key: str, cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The first CPU's ``key`` in /proc/cpuinfo (``"model name"``, ``"cpu family"``...), "" if absent."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return ""


def _model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    return cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads do not speed up GEMMs)."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:  # pragma: no cover - psutil is in the pinned set
        cores = os.cpu_count() or 1
    return max(1, min(cores, len(os.sched_getaffinity(0))))


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True where the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def can_lay_out_bf16_weights(flags: frozenset[str] | None = None) -> bool:
    """True where oneDNN can lay out a bf16 weight for its linear kernels (``mkldnn_reorder_linear_weight``
    refuses elsewhere): AVX512-BW with VL and DQ, or AVX-NE-CONVERT. An AVX2-only CPU computes bf16
    (slowly, emulated) but cannot prepack it."""
    flags = cpu_flags() if flags is None else flags
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


# ``auto`` on AVX512-BF16 without AMX picks bf16 where its matrix products are at least this many
# times as fast as fp32's. Measured (bench/results, 256 px SD v1.5-shaped step): EPYC, GEMMs 2.3x,
# step 1.7x faster in bf16; Xeon, GEMMs 0.5x, step 0.68x. Autocast's casts and element-wise work
# take back part of a GEMM gain, hence a margin above 1.
BF16_GEMM_SPEEDUP_NEEDED = 1.3


@cache
def bf16_gemm_speedup(size: int = 512, repeats: int = 5) -> float:
    """How many times as fast this CPU multiplies two ``size`` x ``size`` matrices in bf16 as in fp32.

    One thread (the ratio is the core's, whatever the threads a run uses), the best of ``repeats``
    after a warm-up: about 0.05 s, once per process. A Xeon with AVX512-BF16 and no AMX measured
    0.7 here, so :func:`choose_precision` keeps fp32 there.
    """

    def best_seconds(dtype: torch.dtype) -> float:
        a, b = (torch.randn(size, size, generator=torch.Generator().manual_seed(i)).to(dtype) for i in (0, 1))
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        return min(times)

    with torch_threads(1):
        return best_seconds(torch.float32) / best_seconds(torch.bfloat16)


def choose_precision(
    requested: str = "auto", flags: frozenset[str] | None = None, bf16_speedup: float | None = None
) -> PrecisionChoice:
    """Pick the training precision for this CPU.

    Args:
        requested: ``"auto"``, ``"no"`` (fp32) or ``"bf16"``.
        flags: CPU flags to decide on (default: this machine's).
        bf16_speedup: for ``auto`` on AVX512-BF16 without AMX, bf16's matrix-product speed over
            fp32's (default: :func:`bf16_gemm_speedup` measures this machine's).

    Returns:
        The accelerate mixed-precision mode, the reason, and a warning where the choice is slow.
    """
    flags = cpu_flags() if flags is None else flags
    native = has_native_bf16(flags)
    names = ", ".join(f for f in NATIVE_BF16_FLAGS if f in flags)
    if requested == "auto":
        if not native:
            return PrecisionChoice("no", "auto: the CPU has no native bf16 (no AVX512-BF16, no AMX), so fp32")
        if "amx_bf16" in flags:
            return PrecisionChoice("bf16", f"auto: the CPU has native bf16 ({names}), so bf16 autocast")
        speedup = bf16_gemm_speedup() if bf16_speedup is None else bf16_speedup
        measured = f"the CPU has native bf16 ({names}, no AMX) and multiplies matrices {speedup:.1f}x as fast in bf16"
        if speedup >= BF16_GEMM_SPEEDUP_NEEDED:
            return PrecisionChoice("bf16", f"auto: {measured}, so bf16 autocast")
        return PrecisionChoice(
            "no", f"auto: {measured} (bf16 pays from {BF16_GEMM_SPEEDUP_NEEDED}x), so fp32"
        )
    if requested == "bf16":
        if native:
            chosen = PrecisionChoice("bf16", f"bf16 requested and the CPU has it natively ({names})")
            if "amx_bf16" in flags:
                return chosen
            speedup = bf16_gemm_speedup() if bf16_speedup is None else bf16_speedup
            if speedup >= 1:
                return chosen
            return replace(
                chosen,
                warning=(
                    f"this CPU multiplies matrices {speedup:.1f}x as fast in bf16 as in fp32: "
                    "mixed_precision='auto' (fp32 here) trains faster"
                ),
            )
        return PrecisionChoice(
            "bf16",
            "bf16 requested although the CPU has no native bf16",
            warning=(
                "mixed_precision='bf16' on a CPU without AVX512-BF16 or AMX is emulated and many "
                "times slower than fp32 here; use mixed_precision='auto' (fp32 on this CPU)"
            ),
        )
    if requested == "no":
        return PrecisionChoice("no", "fp32 requested")
    raise ValueError(f"mixed_precision={requested!r}: must be 'auto', 'no' or 'bf16'")


def report(requested: str = "auto") -> CPUReport:
    """Describe this CPU: cores, ISA flags, native bf16, and the precision ``auto`` chooses."""
    flags = cpu_flags()
    choice = choose_precision(requested, flags)
    return CPUReport(
        model_name=_model_name(),
        physical_cores=physical_cores(),
        logical_cores=os.cpu_count() or 1,
        isa_flags={f: f in flags for f in ISA_FLAGS},
        native_bf16=has_native_bf16(flags),
        precision=choice.mixed_precision,
        reason=choice.reason if not choice.warning else f"{choice.reason}. WARNING: {choice.warning}",
        torch_threads=torch.get_num_threads(),
    )


def local_processes() -> int:
    """The processes of this job on this node (``LOCAL_WORLD_SIZE``, set by torchrun and accelerate), at least 1."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def available_memory(file_bytes: int = 0, status: str | os.PathLike = "/proc/self/status") -> int:
    """Bytes this node can still give without pushing out what this process uses: ``MemAvailable``
    less this process's resident file pages (``RssFile`` of ``status``), or less ``file_bytes`` if
    more (the weights it has mapped from files: :func:`file_backed_bytes`, read yet or not).

    The kernel counts clean file pages as available, because it may drop them, and pages of a file
    not read yet not at all. A model loaded from safetensors is such pages: its weights are views
    into the file's mapping, read on first use, then in every step. A budget that counted them free
    pushed out the weights it was made beside: SDXL in fp32 at 256 px on 23.5 GiB laid out 9.4 GiB
    of copies from "20 GiB available" before its first step read the 12.6 GiB of weights, and that
    step stalled with 0.2 GiB left.
    """
    import psutil

    held = file_bytes
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith("RssFile:"):
                held = max(held, int(line.split()[1]) * 1024)
    except OSError:  # not Linux
        pass
    return max(0, psutil.virtual_memory().available - held)


def file_backed_bytes(modules: Iterable[torch.nn.Module], mapped: list[tuple[int, int]] | None = None) -> int:
    """Bytes of the ``modules``' parameters and buffers that are views into a file mapping
    (safetensors weights as diffusers and transformers load them), resident or not; ``mapped``:
    :func:`file_mappings`, read once for many calls. Not Linux: 0 (no mappings to read)."""
    mapped = file_mappings() if mapped is None else mapped
    seen, total = set(), 0
    for tensor in (t for m in modules for t in (*m.parameters(), *m.buffers())):
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if size and start not in seen and _inside(start, start + size, mapped):
            seen.add(start)
            total += size
    return total


def set_threads(num_threads: int | None = None) -> int:
    """Set PyTorch's intra-op threads.

    Default: ``OMP_NUM_THREADS`` if set, else the physical cores shared among the processes of
    this node (``LOCAL_WORLD_SIZE``, set by torchrun and accelerate).
    """
    if num_threads is None:
        env = os.environ.get("OMP_NUM_THREADS")
        if env and env.isdigit() and int(env) > 0:
            num_threads = int(env)
        else:
            num_threads = max(1, physical_cores() // local_processes())
    torch.set_num_threads(num_threads)
    return num_threads


def process_age() -> float:
    """Seconds since this process started, to about 10 ms.

    ``time.time() - psutil.Process().create_time()`` can be up to a second long: psutil adds the
    start time to a boot time that ``/proc/stat`` gives in whole seconds (on one VM a command
    seemed to reach its first step later than it ended). On Linux both ends are read on the
    kernel's boot-time clock instead: the start in ``/proc/self/stat`` (clock ticks) and
    ``CLOCK_BOOTTIME``. Elsewhere, psutil's reading.
    """
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (name)"
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, or no CLOCK_BOOTTIME
        import psutil

        return time.time() - psutil.Process().create_time()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_GLIBC_DEFAULT_TRIM_THRESHOLD, _GLIBC_DEFAULT_MMAP_MAX = 128 * 1024, 65536


@cache
def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_MADV_DONTNEED = 4  # sys/mman.h


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges this process has mapped from files (``/proc/self/maps``)."""
    ranges = []
    with suppress(OSError), open("/proc/self/maps") as maps:  # not Linux: none
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def _inside(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether the addresses ``[start, end)`` lie inside one of ``ranges`` (:func:`file_mappings`)."""
    return any(a <= start and end <= b for a, b in ranges)


def _whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """The first and the end address of the whole pages inside ``tensor``'s bytes (end <= first: none)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-tensor.data_ptr() // page) * page
    return first, (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page


def drop_file_pages(tensor: torch.Tensor, mapped: list[tuple[int, int]] | None = None) -> int:
    """Hand the kernel back the memory of ``tensor``, which the caller is about to drop; return the
    bytes handed back (0 if none).

    diffusers and transformers load safetensors weights as views into one private mapping of the
    file. The mapping, with every page read so far, lives as long as the process, so dropping one
    weight frees nothing: its pages stay resident. A frozen layer that computes with its own copy
    (:mod:`helpers.training.engine.prepack`) would keep its whole weight resident beside the copy.
    This tells the kernel the pages are not needed (``madvise(MADV_DONTNEED)``).

    Only the whole pages inside the tensor, and only when no other tensor shares its storage (pass
    the tensor itself, e.g. a module's ``Parameter``, not a ``.data`` or ``.detach()`` of it): they
    hold nothing but its bytes, which nobody reads again. With ``mapped`` (:func:`file_mappings`),
    only pages inside a file mapping, which read again come back from the file: a tensor that is
    kept stays valid (:func:`drop_module_file_pages`). Not Linux with glibc: nothing.
    """
    libc = _glibc()
    # the tensor's own reference and the one untyped_storage() makes here
    if (
        libc is None
        or tensor.device.type != "cpu"
        or torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) > 2
    ):
        return 0
    first, end = _whole_pages(tensor)
    if end <= first or (mapped is not None and not _inside(first, end, mapped)):
        return 0
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED) != 0:
        return 0
    return end - first


def drop_module_file_pages(module: torch.nn.Module, mapped: list[tuple[int, int]] | None = None) -> int:
    """Hand back the pages of every parameter and buffer of ``module`` that lie in a file mapping
    (:func:`drop_file_pages`), for a frozen model that has done its part, kept or not; return the
    bytes handed back. Its weights stay valid: read again, their pages come back from the file.
    Weights in anonymous memory (cast, built in memory) are left alone. ``mapped``: :func:`file_mappings`."""
    if _glibc() is None:
        return 0
    mapped = file_mappings() if mapped is None else mapped
    return sum(drop_file_pages(t, mapped) for t in [*module.parameters(), *module.buffers()])


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``num_threads`` within the block, and restored on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


MALLOC_DEFAULTS_ENV = "WORKSHOP_MALLOC_DEFAULTS"


@contextmanager
def keep_freed_memory() -> Iterator[bool]:
    """Within the block, glibc keeps freed memory for reuse instead of returning it to the OS.

    A training run allocates and frees gigabytes: the VAE's activations while it encodes the
    pictures, then in every step activations and oneDNN's per-call copies of the convolution
    weights (up to 118 MB each). By default glibc serves blocks above 32 MiB with fresh ``mmap``
    pages and trims the heap, so every VAE call and every step page-faults the same memory in
    again. Serving every block from the heap and never trimming it removes the faults, for a
    little more resident memory (the measured speed-up and memory: the ``keep_freed_memory`` row of
    the options table in docs/performance.md). The same effect as preloading tcmalloc,
    without installing it.
    On exit the defaults come back and the heap is trimmed. Does nothing where glibc is absent,
    or with ``WORKSHOP_MALLOC_DEFAULTS=1`` (``bench/`` measures a run with glibc's defaults so).

    Yields:
        True if the setting was applied (Linux with glibc).
    """
    libc = None if os.environ.get(MALLOC_DEFAULTS_ENV) == "1" else _glibc()
    if libc is None:
        yield False
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _GLIBC_DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)


IPEX_DISTRIBUTION = "intel-extension-for-pytorch"
IPEX_FIX = "create its environment with `make setup-ipex` and run with .venv-ipex/bin/python"
# Seen in backward once IPEX is imported: it registers CPU kernels for these composite ops, and
# torch warns that none is registered for autograd. The gradients are right (tests/test_ipex.py
# compares them with plain PyTorch's), so the warning is filtered where IPEX is applied.
_IPEX_AUTOGRAD_WARNING = r"aten::(group_norm|layer_norm): an autograd kernel was not registered"


def ipex_version() -> str | None:
    """The installed Intel Extension for PyTorch's version, or None; read without importing it."""
    from importlib import metadata

    try:
        return metadata.version(IPEX_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def ipex_problem() -> str | None:
    """Why Intel Extension for PyTorch cannot be used in this environment, or None if it can.

    Reads the installed versions only: importing IPEX registers its kernels process-wide, and an
    IPEX built for another torch fails at import. IPEX is discontinued; its last CPU release, 2.8,
    needs torch 2.8 (docs/architecture.md, "IPEX").
    """
    version = ipex_version()
    if version is None:
        return f"intel_extension_for_pytorch is not installed in this environment (torch {torch.__version__})"
    needs = ".".join(version.split(".")[:2])
    if needs != ".".join(torch.__version__.split(".")[:2]):
        return (
            f"intel_extension_for_pytorch {version} needs torch {needs}, "
            f"and this environment has torch {torch.__version__}"
        )
    return None


def ipex_available() -> bool:
    """Whether Intel Extension for PyTorch is installed for this torch (see :func:`ipex_problem`)."""
    return ipex_problem() is None


def apply_ipex(unet: torch.nn.Module, dtype: torch.dtype) -> None:
    """Optimise the frozen UNet with IPEX, as the engine does when ``use_ipex`` is on.

    Two of IPEX's defaults break training through a frozen model (tests/test_ipex.py shows both),
    so both are off:

    - weight prepacking: prepacked linear layers have no autograd kernel, so the gradient reaching
      the placeholder only flows around them (silently wrong) or is ``None``; prepacked
      convolutions make group norm's backward fail ("Expected memory formats of X and dY are same");
    - the automatic channels-last layout of convolution weights: the same group-norm failure.

    What remains is IPEX's operator kernels (registered when it is imported) and, for bf16, its
    cast of the UNet's weights. The text encoder, which carries the learned rows, is left alone.
    The engine checks after the first step that the placeholder gradient is non-zero.

    Raises:
        RuntimeError: IPEX is not usable here (callers check :func:`ipex_problem` before loading).
    """
    problem = ipex_problem()
    if problem:
        raise RuntimeError(f"use_ipex: {problem}. Fix: {IPEX_FIX}.")
    import warnings

    import intel_extension_for_pytorch as ipex

    warnings.filterwarnings("ignore", message=_IPEX_AUTOGRAD_WARNING, category=UserWarning)
    ipex.disable_auto_channels_last()
    training = unet.training
    unet.eval()  # IPEX's training mode wants the optimizer of the weights it would prepack
    ipex.optimize(
        unet,
        dtype=dtype,
        inplace=True,
        weights_prepack=False,
        auto_kernel_selection=False,
        conv_bn_folding=False,  # no batch norm in a UNet; folding would trace the model for nothing
        linear_bn_folding=False,
        replace_dropout_with_identity=False,  # the model stays as loaded
    )
    unet.train(training)

"""A ``ccl`` backend for ``torch.distributed`` on CPU tensors, built here over oneCCL from PyPI.

Intel's ``oneccl_bindings_for_pytorch`` registers ``ccl`` but is not installable with this torch.
This package compiles its own small backend instead (``process_group_ccl.cpp``, a ``c10d::Backend``
over oneCCL's C++ API from the ``oneccl-cpu`` / ``oneccl-cpu-devel`` wheels) and registers it::

    from helpers.ranks import oneccl

    ok, reason = oneccl.available()  # (False, "... run `make setup`") when it cannot be used
    oneccl.load()  # registers "ccl" with torch.distributed (idempotent)
    env = {name: value for name, value, _ in oneccl.environment(2, 1, 2, 1)}  # before init, every rank
    torch.distributed.init_process_group("ccl", ...)

Where the official ``oneccl_bindings_for_pytorch`` imports, :func:`load` imports it and uses its
``ccl`` backend instead of building ours (it ships its own oneCCL and libfabric, so
:func:`environment` then leaves the libfabric pins out).

``make setup`` runs ``python -m helpers.ranks.oneccl build``: the extension goes into
``<venv>/share/workshop-ccl/<hash>/`` (``make distclean`` removes it), the hash covering the C++
source, torch's version and oneCCL's version, so any of them changing builds afresh
(about a minute).

Tested here: every collective against gloo on 2 and 3 processes, a rank that never joins, a killed
rank (``tests/ranks/test_oneccl.py``); the engine on ccl under mpirun (Intel MPI), torchrun and Ray,
and across two network namespaces over tcp; a ccl group under Intel MPI, MPICH, Open MPI and
torchrun (``tests/launching``): oneCCL bootstraps through the c10d store, so no MPI variable
(``CCL_PROCESS_LAUNCHER``) is needed. Not tested: oneCCL's ``mpi`` transport, separate machines.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

BACKEND = "ccl"
SOURCE = Path(__file__).with_name("process_group_ccl.cpp")
CACHE = Path(sys.prefix) / "share" / "workshop-ccl"
OFFICIAL = "oneccl_bindings_for_pytorch"
FIX = "run `make setup`"

# oneccl-cpu's libccl.so.1 lists libccl.so.2 as a dependency, and no oneccl-cpu wheel ships it. The
# only symbols libccl.so.1 needs from it are four of Intel's compiler runtime (_intel_fast_memcpy,
# _intel_fast_memset, __intel_cpu_feature_indicator_x, __intel_cpu_features_init_x), which
# libintlc.so.5 of the intel-cmplr-lib-rt wheel defines. The mend is an empty shared library whose
# soname is libccl.so.2 and which depends on libintlc.so.5 (found through its own RUNPATH): once it
# is loaded (load() preloads it by path, RTLD_GLOBAL, before libccl.so.1), the dynamic loader
# matches libccl.so.1's "libccl.so.2" to it by soname and resolves the four symbols through its
# dependency. A symlink libccl.so.2 -> libintlc.so.5 does not do: preloaded by path, the object
# keeps its own soname (libintlc.so.5), so "libccl.so.2" still goes unmatched.
MEND_SOURCE = """\
/* libccl.so.2 for oneccl-cpu's libccl.so.1: no code of its own; it depends on libintlc.so.5, which
   defines the four symbols libccl.so.1 expects from libccl.so.2 (helpers/launching/oneccl). */
int workshop_libccl_mend = 2;
"""


class CclUnavailable(RuntimeError):
    """The ``ccl`` backend cannot be used here; the message says why and how to fix it."""


class OneCCLMissing(CclUnavailable):
    """A oneCCL wheel (or a file of one) is not installed."""


@dataclass(frozen=True)
class OneCCL:
    """Where the installed oneCCL wheels put their files."""

    version: str
    lib: Path  # libccl.so.1
    include: Path  # the folder holding oneapi/ccl.hpp
    intlc: Path  # libintlc.so.5 (intel-cmplr-lib-rt)
    fabric: Path | None  # impi-rt's libfabric.so.1
    providers: Path | None  # the folder of impi-rt's libfabric providers (lib*-fi.so)


def _dist_file(dist: str, name: str) -> tuple[str, Path]:
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise OneCCLMissing(f"the {dist} wheel is not installed: {FIX}") from None
    for f in d.files or []:
        if f.name == name:
            return d.version, Path(d.locate_file(f)).resolve()
    raise OneCCLMissing(f"the {dist} wheel has no {name}: reinstall it ({FIX})")


def find() -> OneCCL:
    """The installed oneCCL (``oneccl-cpu``, ``oneccl-cpu-devel``, ``intel-cmplr-lib-rt``, ``impi-rt``).

    Raises:
        CclUnavailable: a wheel or file is missing.
    """
    version, lib = _dist_file("oneccl-cpu", "libccl.so.1")
    _, header = _dist_file("oneccl-cpu-devel", "ccl.hpp")
    _, intlc = _dist_file("intel-cmplr-lib-rt", "libintlc.so.5")
    try:
        _, fabric = _dist_file("impi-rt", "libfabric.so.1")
        _, tcp = _dist_file("impi-rt", "libtcp-fi.so")
        providers = tcp.parent
    except CclUnavailable:
        fabric = providers = None
    return OneCCL(version, lib, header.parent.parent, intlc, fabric, providers)


def _key(ccl: OneCCL) -> str:
    import torch

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), MEND_SOURCE.encode(), torch.__version__.encode(), ccl.version.encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def cache_dir(ccl: OneCCL | None = None) -> Path:
    """The folder of this source, torch and oneCCL's build: ``<venv>/share/workshop-ccl/<hash>``."""
    return CACHE / _key(ccl or find())


def _module_name(folder: Path) -> str:
    return f"workshop_ccl_{folder.name}"


def mend_libccl(ccl: OneCCL, folder: Path) -> Path:
    """Build ``folder/libccl.so.2``, the stand-in for the library oneccl-cpu forgot (see MEND_SOURCE).

    Raises:
        CclUnavailable: no C compiler, or it failed.
    """
    out = folder / "libccl.so.2"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise CclUnavailable("no C compiler (cc) to build the libccl.so.2 mend: install gcc")
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "libccl_mend.c"
    src.write_text(MEND_SOURCE)
    tmp = folder / f"libccl.so.2.{os.getpid()}.tmp"
    argv = [cc, "-shared", "-fPIC", "-o", str(tmp), str(src), "-Wl,-soname,libccl.so.2"]
    argv += [
        "-Wl,--no-as-needed",
        f"-L{ccl.intlc.parent}",
        "-l:libintlc.so.5",
        f"-Wl,-rpath,{ccl.intlc.parent}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode:
        err = " ".join(done.stderr.split())[-300:] or "no message"
        raise CclUnavailable(
            f"building the libccl.so.2 mend with {cc} failed (exit {done.returncode}: {err}): "
            f"check the C compiler, then {FIX}"
        )
    tmp.replace(out)
    return out


def _preload(ccl: OneCCL, folder: Path) -> None:
    """Load the mend, then libccl.so.1 itself, by path and globally, before the extension."""
    for lib in (ccl.intlc, folder / "libccl.so.2", ccl.lib):
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def build(verbose: bool = False) -> Path:
    """Compile the backend into :func:`cache_dir` unless it is there already; the module's path.

    Raises:
        CclUnavailable: oneCCL is not installed or the build failed.
    """
    ccl = find()
    folder = cache_dir(ccl)
    name = _module_name(folder)
    built = _built(folder, name)
    if built:
        return built
    mend_libccl(ccl, folder)
    _preload(ccl, folder)
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            build_directory=str(folder),
            extra_include_paths=[str(ccl.include)],
            extra_cflags=["-O2"],
            extra_ldflags=[f"-L{ccl.lib.parent}", "-l:libccl.so.1", f"-Wl,-rpath,{ccl.lib.parent}"],
            verbose=verbose,
        )
    except Exception as err:  # noqa: BLE001 - any compiler or loader failure is reported the same way
        text = " ".join(str(err).split())
        raise CclUnavailable(f"building the ccl extension failed ({text[-300:]}): {FIX}") from err
    built = _built(folder, name)
    if not built:
        raise CclUnavailable(f"the ccl extension was built but no {name}.so is in {folder}")
    for old in CACHE.iterdir():  # builds for an earlier source, torch or oneCCL
        if old.is_dir() and old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return built


def _built(folder: Path, name: str) -> Path | None:
    path = folder / f"{name}.so"
    return path if path.exists() and (folder / "libccl.so.2").exists() else None


_lock = threading.Lock()
_loaded: str | None = None
_module: ModuleType | None = None


def _import_official() -> bool:
    if importlib.util.find_spec(OFFICIAL) is None:
        return False
    try:
        importlib.import_module(OFFICIAL)  # registers "ccl" with torch.distributed itself
    except Exception:  # noqa: BLE001 - a broken install: fall back to ours
        return False
    return True


def _import_ours(build_if_missing: bool) -> ModuleType:
    ccl = find()
    folder = cache_dir(ccl)
    name = _module_name(folder)
    path = _built(folder, name) or (build() if build_if_missing else None)
    if path is None:
        raise CclUnavailable(f"the ccl extension is not built for this torch and oneCCL: {FIX}")
    if name in sys.modules:
        return sys.modules[name]
    import torch.distributed  # noqa: F401  # c10d's Backend and Store types, which the module extends

    _preload(ccl, folder)
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _create(opts, backend_options=None):
    """The creator ``torch.distributed`` calls for each ``ccl`` process group (extended API)."""
    global _started
    assert _module is not None
    if _started:
        return _module.create(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id)
    _started = True
    with _without_log_level_notice():  # the first group starts oneCCL, which reads its variables
        return _module.create(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id)


_started = False
_LOG_LEVEL_NOTICE = b"|CCL_WARN| value of CCL_LOG_LEVEL changed to be error "


@contextlib.contextmanager
def _without_log_level_notice() -> Iterator[None]:
    """Standard output through a pipe while oneCCL starts: every line goes on except its notice of
    ``CCL_LOG_LEVEL=error`` itself.

    :func:`environment` sets that level so that no rank prints a warning per variable; oneCCL reads
    it while its level is still ``warn`` and so announces it, on every rank, on every run, to
    standard output. Nothing else is held back: a thread forwards each line as it comes (the
    creation releases the GIL), and a level set otherwise is shown as oneCCL prints it.
    """
    if os.environ.get("CCL_LOG_LEVEL") != "error":
        yield
        return
    sys.stdout.flush()
    read_end, write_end = os.pipe()
    saved = os.dup(1)
    os.dup2(write_end, 1)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if _LOG_LEVEL_NOTICE not in line:
                    os.write(saved, line)

    thread = threading.Thread(target=forward, name="ccl-stdout", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)  # the pipe's last writer closes: the thread reads to its end and stops
        thread.join(timeout=5.0)
        if not thread.is_alive():  # else a process started meanwhile holds the pipe: keep forwarding
            os.close(saved)


def load(build_if_missing: bool = False) -> str:
    """Register the ``ccl`` backend with ``torch.distributed``; idempotent.

    Uses ``oneccl_bindings_for_pytorch`` where it imports, else this package's extension (built by
    ``make setup``; ``build_if_missing`` builds it now, about a minute). Sets
    ``CCL_OFI_LIBRARY_PATH`` and ``FI_PROVIDER_PATH`` to impi-rt's libfabric when they are unset
    (else Debian's libfabric may load).

    Returns:
        Which implementation provides ``ccl``: ``"oneccl_bindings_for_pytorch"`` or ``"helpers.ranks.oneccl"``.

    Raises:
        CclUnavailable: neither can be used (the message says why and how to fix it).
    """
    global _loaded, _module
    with _lock:
        if _loaded:
            return _loaded
        import torch.distributed as dist

        if _import_official():
            _loaded = OFFICIAL
            return _loaded
        module = _import_ours(build_if_missing)
        for name, value, _ in _fabric_pins(find()):
            os.environ.setdefault(name, value)
        _module = module
        if getattr(dist.Backend, BACKEND.upper(), None) is None:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        _loaded = __name__
        return _loaded


def available() -> tuple[bool, str]:
    """Whether ``ccl`` can be used here, and one line saying why (with the fix when it cannot)."""
    try:
        which = load()
    except CclUnavailable as err:
        return False, str(err)
    except OSError as err:  # a library that does not load
        return False, f"the ccl backend's libraries do not load ({err}): {FIX}"
    if which == OFFICIAL:
        return True, f"ccl from {OFFICIAL}"
    return True, f"ccl from this workshop's extension over oneCCL {find().version}"


def oneccl_version() -> str:
    """oneCCL's own version string (after :func:`load`), else the wheel's version."""
    if _module is not None:
        return _module.oneccl_version()
    return find().version


def _fabric_pins(ccl: OneCCL) -> list[tuple[str, str, str]]:
    if ccl.fabric is None or ccl.providers is None:
        return []
    return [
        (
            "CCL_OFI_LIBRARY_PATH",
            str(ccl.fabric),
            "impi-rt's libfabric 2.4, which oneCCL needs; otherwise Debian's libfabric1 1.17 loads silently",
        ),
        ("FI_PROVIDER_PATH", str(ccl.providers), "the libfabric providers (lib*-fi.so) that come with it"),
    ]


def environment(
    local_world_size: int,
    nodes: int,
    cores: int,
    threads_per_process: int,
    interface: str | None = None,
) -> list[tuple[str, str, str]]:
    """The variables every rank of a ``ccl`` job needs, as ``(name, value, one-line reason)``.

    Args:
        local_world_size: ranks per node.
        nodes: nodes in the job.
        cores: physical cores per node.
        threads_per_process: compute threads of each rank (``OMP_NUM_THREADS``).
        interface: the network interface between nodes (``FI_TCP_IFACE``, ``CCL_KVS_IFACE``).
    """
    env = [
        (
            "CCL_ATL_TRANSPORT",
            "ofi",
            "oneCCL over libfabric (its mpi transport needs Intel MPI's mpirun around every rank)",
        ),
        ("CCL_WORKER_COUNT", "1", "one oneCCL progress thread per rank"),
        (
            "CCL_LOG_LEVEL",
            "error",
            "errors only: otherwise every rank prints a CCL_WARN line per variable set here (and oneCCL's "
            "notice of this one is held back: helpers.ranks.oneccl)",
        ),
    ]
    if nodes <= 1:
        env += [
            ("CCL_ATL_SHM", "1", "one node: ranks exchange data through shared memory (fastest here)"),
            (
                "FI_PROVIDER",
                "shm",
                "libfabric's shared-memory provider (needs CCL_ATL_SHM=1; alone it aborts)",
            ),
        ]
    else:
        env.append(("FI_PROVIDER", "tcp", "several nodes: libfabric's tcp provider"))
        if interface:
            env += [
                ("FI_TCP_IFACE", interface, "libfabric's tcp provider uses the interface between the nodes"),
                ("CCL_KVS_IFACE", interface, "oneCCL's bootstrap store listens on that interface too"),
            ]
    # Each rank runs its compute threads plus one oneCCL worker that spins while it waits.
    busy = local_world_size * (threads_per_process + 1)
    if busy > cores:
        env += [
            (
                "CCL_YIELD",
                "sched_yield",
                f"{local_world_size} ranks x ({threads_per_process} threads + 1 oneCCL worker) exceed {cores} cores: "
                "waiting workers yield (spinning ones starved each other: "
                "a 3 KB all-reduce many times slower on 2 cores)",
            ),
            ("CCL_SPIN_COUNT", "1", "and spin once before yielding"),
        ]
    if not _official_importable():
        with contextlib.suppress(CclUnavailable):
            env += _fabric_pins(find())
    return env


# libfabric's shm provider (one node: FI_PROVIDER=shm) maps each rank's endpoint to a file here,
# named "<pid>:<uid>:<endpoint>" (sometimes with one more number): 64 MiB, in RAM as it is used.
SHM_FOLDER = Path("/dev/shm")
# At start-up each rank's provider wants this much free there per CPU of the machine, or oneCCL
# fails with "failed to initialize ATL" (measured with impi-rt's libfabric 2.4 on 2 CPUs: 3 ranks
# start with 160 MiB, 2 with 129 MiB, not with 127).
SHM_BYTES_PER_CPU = 64 * 2**20


def shared_memory_shortfall(cpus: int | None = None) -> str | None:
    """Why ccl's ranks on this machine could not start their shared-memory transport, or None.

    A container's ``/dev/shm`` is often small (Docker's default: 64 MB); libfabric's shm provider
    refuses to start with less free than :data:`SHM_BYTES_PER_CPU` per CPU (``cpus``, default this
    machine's), and oneCCL then fails in every rank after the models have loaded.
    """
    cpus = cpus or os.cpu_count() or 1
    need = cpus * SHM_BYTES_PER_CPU
    try:
        info = os.statvfs(SHM_FOLDER)
    except OSError as err:
        return f"{SHM_FOLDER} cannot be read ({err.strerror}), and ranks on one machine talk through it"
    free = info.f_bavail * info.f_frsize
    if free >= need:
        return None
    return (
        f"{SHM_FOLDER} has {free // 2**20} MiB free, and oneCCL's shared-memory transport needs "
        f"{need // 2**20} MiB on this machine ({SHM_BYTES_PER_CPU // 2**20} MiB per CPU, {cpus} CPUs): "
        f"give it more (a container: docker run --shm-size={-(-need // 2**30)}g ...) or free some"
    )


def remove_regions(pids: Iterable[int]) -> list[str]:
    """Remove the shared-memory files that the ranks ``pids`` of this machine, which have ended, left.

    A rank removes its own file when it ends, TERM included; one killed outright (the out-of-memory
    killer, a SIGKILL from its launcher's parent) cannot, and the file holds its pages of RAM until
    the machine restarts. Give only pids of processes that are gone (a live rank still uses its
    file); only regular files of this user with libfabric's names are removed. Returns their names.
    """
    uid, removed = os.getuid(), []
    for pid in sorted(set(pids)):
        for path in sorted(SHM_FOLDER.glob(f"{pid}:{uid}:*")):
            with contextlib.suppress(OSError):  # removed meanwhile, or not this user's to remove
                info = path.lstat()
                ours = stat.S_ISREG(info.st_mode) and info.st_uid == uid
                if ours and re.fullmatch(rf"{pid}:{uid}(:\d+)+", path.name):
                    path.unlink()
                    removed.append(path.name)
    return removed


def _official_importable() -> bool:
    return _loaded == OFFICIAL or importlib.util.find_spec(OFFICIAL) is not None

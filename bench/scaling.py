"""Calibrate the scaling model: all-reduce on loopback for sizes from 4 bytes to the full matrix.

    python -m bench.scaling                           # measure, fit, write bench/results/scaling-loopback.json
    python -m bench.scaling --backend ccl             # the same on ccl: bench/results/scaling-loopback-ccl.json
    python -m bench.scaling --figure docs/scaling.png # only draw the model's figure (no measurement)

Starts ``--world_size`` processes (gloo over 127.0.0.1, one thread each) that all-reduce fp32
buffers of each size in turn; rank 0's median per size is kept. The sizes include the two that
matter: our 3,072 bytes per step and the reference's 151,784,448 (SD v1.5's whole token-embedding
matrix). ``helpers.cluster.scaling.fit_link`` then fits the ring model
``2 (p - 1) x (latency + bytes / p / bandwidth)`` to the medians; ``helpers.cluster.scaling.LOOPBACK``
holds the fit (a test keeps the two equal). With ``--backend ccl`` the ranks start the
``ccl`` group as the trainers do (:func:`helpers.ranks.backend.init_backend`, oneCCL's variables
from :func:`helpers.ranks.oneccl.environment`: shared memory, yielding workers), and the fit
belongs in ``helpers.cluster.scaling.CCL_LOOPBACK``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from helpers.cluster import scaling
from helpers.ranks import oneccl
from helpers.ranks.backend import init_backend

FULL_MATRIX_BYTES = 49_409 * 768 * 4  # SD v1.5's token-embedding matrix, fp32
OURS_BYTES = 768 * 4  # one learned vector, fp32
SIZES = sorted({4, 64, 1024, OURS_BYTES, 16_384, 262_144, 2**20, 2**22, 2**24, 2**26, FULL_MATRIX_BYTES})
TIMEOUT_S = 300


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=2, help="processes on this machine")
    parser.add_argument(
        "--backend", choices=("gloo", "ccl"), default="gloo", help="the process group's backend"
    )
    parser.add_argument("--repeats", type=int, default=25, help="timed all-reduces per size (5 above 16 MB)")
    parser.add_argument(
        "--out", default=None, help="JSON results file (default bench/results/scaling-loopback.json)"
    )
    parser.add_argument("--figure", default=None, help="only draw the model's figure to this PNG and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON: result file, repeats
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.worker is not None:
        return _worker(json.loads(args.worker))
    # imported here: helpers.workshop.plots brings matplotlib, 0.5 s CPU on top of this module
    # (measured with time.process_time), and every --worker process imports this module
    from helpers.workshop import plots

    if args.figure:
        path = plots.save_figure(plots.scaling_figure(), args.figure)
        print(f"wrote {path}")
        return {"figure": str(path)}
    ccl_env = []
    if args.backend == "ccl":
        ok, reason = oneccl.available()
        if not ok:
            raise SystemExit(f"error: --backend ccl: {reason}")
        ccl_env = oneccl.environment(args.world_size, 1, common.machine()["physical_cores"], 1)
    seconds = _launch(args.world_size, args.repeats, args.backend, {n: v for n, v, _ in ccl_env})
    link = scaling.fit_link(SIZES, [seconds[str(n)] for n in SIZES], args.world_size)
    report: dict[str, Any] = {
        "benchmark": "scaling",
        "transport": "gloo, TCP over 127.0.0.1"
        if args.backend == "gloo"
        else "ccl, oneCCL over shared memory",
        "backend": args.backend,
        "ccl_environment": {n: v for n, v, _ in ccl_env},
        "world_size": args.world_size,
        "threads_per_process": 1,
        "machine": common.machine(),
        "bytes": SIZES,
        "median_seconds": [seconds[str(n)] for n in SIZES],
        "fit": {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s},
        "fit_seconds": [scaling.ring_allreduce_seconds(n, args.world_size, link) for n in SIZES],
    }
    default = "scaling-loopback.json" if args.backend == "gloo" else "scaling-loopback-ccl.json"
    out = common.results_path(default, args.out)
    common.write_json(out, report)
    print(format_report(report))
    print(f"wrote {out}")
    return report


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"{r.get('backend', 'gloo')} all-reduce on loopback, {r['world_size']} processes x 1 thread (medians)",
        f"{'bytes':>14}{'measured s':>14}{'model s':>14}",
    ]
    for n, got, fit in zip(r["bytes"], r["median_seconds"], r["fit_seconds"], strict=True):
        lines.append(f"{n:>14,}{got:>14.6f}{fit:>14.6f}")
    f = r["fit"]
    lines.append(
        f"fit: {f['latency_s'] * 1e6:.0f} us per ring step, {f['bytes_per_s'] / 1e9:.2f} GB/s per link"
    )
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    world: int, repeats: int, backend: str = "gloo", extra_env: dict[str, str] | None = None
) -> dict[str, float]:
    """Start ``world`` workers; return rank 0's median seconds per size (keys: sizes as strings)."""
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as work:
        result_file = Path(work) / "result.json"
        spec = json.dumps({"result": str(result_file), "repeats": repeats, "backend": backend})
        port = str(_free_port())
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
                **(extra_env or {}),
            }
            cmd = [sys.executable, "-m", "bench.scaling", "--worker", spec]
            procs.append(
                common.popen(
                    cmd, cwd=common.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        errors = []
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                _, err = p.communicate()
                err = f"timed out after {TIMEOUT_S} s\n{err}"
            if p.returncode:
                errors.append((rank, err))
        if errors:
            raise RuntimeError(f"rank {errors[0][0]} failed:\n{errors[0][1][-3000:]}")
        return json.loads(result_file.read_text())


def _worker(spec: dict[str, Any]) -> dict[str, float]:
    """One rank: all-reduce each size ``repeats`` times after a warm-up, ranks aligned by a barrier."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init_backend(spec.get("backend", "gloo")) == "gloo":  # ccl: init_backend started the group
        dist.init_process_group("gloo")
    medians: dict[str, float] = {}
    try:
        for nbytes in SIZES:
            buffer = torch.ones(max(1, nbytes // 4))
            repeats = spec["repeats"] if nbytes <= 2**24 else 5
            times = []
            for k in range(repeats + 2):  # two warm-up calls
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(buffer)
                if k >= 2:
                    times.append(time.perf_counter() - start)
            medians[str(nbytes)] = common.summarize(times)["median"]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        common.write_json(spec["result"], medians)
    return medians


if __name__ == "__main__":
    main(parse_args())

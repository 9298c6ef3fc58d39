"""Data-parallel communication: bytes all-reduced and seconds per step, ours against full-matrix gradients.

    python -m bench.allreduce --model sd15-shape --resolution 256 --steps 3

Starts ``--world_size`` processes (gloo, localhost, ``cores / world_size`` threads each). In each,
both modes run interleaved under ``DistributedDataParallel``: ``ours`` wraps only the learned rows
(what the engine does), ``reference`` wraps the text encoder with its whole token-embedding matrix
trainable (what diffusers' example does). A DDP communication hook (the engine's
``AllreduceCounter``) counts the bytes each step all-reduces; ``allreduce_seconds`` is the time
of all-reducing that many bytes alone, ``allreduce_wait_seconds`` the time from the hook's call to
the result inside the step (it includes waiting for the slower rank).

``--split_rounds`` then compares the ways to use one node's cores for the same global batch:
``world_size`` processes x ``cores / world_size`` threads against 1 process x ``cores`` threads,
our step only, in alternating fresh launches.

``--backends gloo ccl`` measures instead the latency of one all-reduce per backend, gloo against
the ``ccl`` backend of :mod:`helpers.ranks.oneccl`, both in the same 2 processes (1 thread
each, oneCCL's variables from ``oneccl.environment``), sizes interleaved and each round
alternating the order: 3 KB (textual inversion's vector), 3.2 MB (the DreamBooth LoRA), 4 MB and
64 MB of fp32::

    python -m bench.allreduce --backends gloo ccl [--rounds 5 --iters 50] [--step_rounds 1 --step_model toyworld]

Then the effect on training: the same 2-process job (``helpers.launch --launcher mpirun
--nproc_per_node 2``, ``--step_model`` at 64 px, ``--step_steps`` steps, fp32) on each backend,
backends alternating over ``--step_rounds`` rounds (0: skip); ``train_step`` holds each run's
``seconds_per_step`` from its ``run_summary.json`` (the first step excluded, as there).

It writes ``allreduce_backends-loopback.json`` into ``bench/results/`` on the machine the other
results come from, else into ``bench/results/<machine>/`` (``xeon-amx``, ``xeon-avx512``, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench import common, jobs
from helpers.core import cpu
from helpers.ranks import oneccl
from helpers.training import textual_inversion as ti


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.allreduce", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, sd15-shape, or a local diffusers folder")
    parser.add_argument(
        "--resolution", type=int, default=None, help="pixels (default 64 tiny, 256 otherwise)"
    )
    parser.add_argument("--batch", type=int, default=1, help="images per process per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world_size", type=int, default=2, help="processes")
    parser.add_argument("--split_rounds", type=int, default=1, help="launches per layout (0: skip the split)")
    parser.add_argument("--out", default=None, help="JSON results file (default bench/results/...)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON: modes, result file
    parser.add_argument(
        "--backends", nargs="+", default=None, help="latency mode: all-reduce latency per backend (gloo ccl)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="latency mode: timed rounds per size and backend"
    )
    parser.add_argument("--iters", type=int, default=50, help="latency mode: all-reduces per round at 3 KB")
    parser.add_argument("--latency_worker", default=None, help=argparse.SUPPRESS)  # JSON spec
    parser.add_argument("--step_rounds", type=int, default=1,
                        help="latency mode: 2-process training runs per backend (0: skip)")  # fmt: skip
    parser.add_argument("--step_model", default="toyworld", help="latency mode: the training runs' model")
    parser.add_argument("--step_steps", type=int, default=6, help="latency mode: steps per training run")
    args = parser.parse_args(argv)
    if args.resolution is None:
        args.resolution = 64 if args.model == "tiny" else 256
    return args


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.latency_worker is not None:
        return _latency_worker(json.loads(args.latency_worker))
    if args.backends:
        return latency(args)
    if args.worker is not None:
        return _worker(args, json.loads(args.worker))
    cores = cpu.physical_cores()
    threads = max(1, cores // args.world_size)
    comm = launch(args, args.world_size, threads, args.batch, ["ours", "reference"])
    ours, ref = comm["modes"]["ours"], comm["modes"]["reference"]
    report: dict[str, Any] = {
        "benchmark": "allreduce",
        "model": args.model,
        "resolution": args.resolution,
        "batch_per_process": args.batch,
        "world_size": args.world_size,
        "threads_per_process": threads,
        "steps": args.steps,
        "machine": common.machine(),
        "modes": comm["modes"],
        "bytes_ratio": ref["allreduce_bytes_per_step"] / ours["allreduce_bytes_per_step"],
        "speedup": ref["seconds_per_step"]["median"] / ours["seconds_per_step"]["median"],
    }
    if args.split_rounds:
        report["split"] = _split(args, cores, threads)
    out = common.results_path(f"allreduce-{args.model}-{args.resolution}px.json", args.out)
    common.write_json(out, report)
    print(format_report(report))
    print(f"wrote {out}")
    return report


def _split(args: argparse.Namespace, cores: int, threads: int) -> dict[str, Any]:
    """``world_size`` x ``threads`` against 1 x ``cores`` for the same images per step, alternating."""
    layouts = {
        f"{args.world_size}x{threads}": (args.world_size, threads, args.batch),
        f"1x{cores}": (1, cores, args.batch * args.world_size),
    }
    runs: dict[str, list[float]] = {name: [] for name in layouts}
    names = list(layouts)
    for r in range(args.split_rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            world, t, batch = layouts[name]
            res = launch(args, world, t, batch, ["ours"])
            runs[name].append(res["modes"]["ours"]["seconds_per_step"]["median"])
    images = args.batch * args.world_size
    out: dict[str, Any] = {"images_per_step": images, "layouts": {}}
    for name, seconds in runs.items():
        s = common.summarize(seconds)["median"]
        out["layouts"][name] = {"seconds_per_step": s, "images_per_second": images / s}
    a, b = (out["layouts"][n]["images_per_second"] for n in names)
    out["speedup_of_processes"] = a / b
    return out


def format_report(r: dict[str, Any]) -> str:
    ours, ref = r["modes"]["ours"], r["modes"]["reference"]
    lines = [
        f"{r['model']} {r['resolution']} px, {r['world_size']} processes x {r['threads_per_process']} threads, "
        f"batch {r['batch_per_process']} per process, {r['steps']} steps/mode (gloo, localhost)",
        f"{'':28}{'ours':>14}{'reference':>14}",
        f"{'bytes all-reduced/step':28}{ours['allreduce_bytes_per_step']:>14,}{ref['allreduce_bytes_per_step']:>14,}",
        f"{'all-reduce s/step':28}{ours['allreduce_seconds']:>14.4f}{ref['allreduce_seconds']:>14.4f}",
        f"{'s/step (median)':28}{ours['seconds_per_step']['median']:>14.3f}{ref['seconds_per_step']['median']:>14.3f}",
        f"bytes: {r['bytes_ratio']:,.0f}x fewer; step: {r['speedup']:.2f}x faster",
    ]
    if "split" in r:
        for name, v in r["split"]["layouts"].items():
            lines.append(
                f"layout {name}: {v['seconds_per_step']:.3f} s/step, {v['images_per_second']:.3f} images/s"
            )
        lines.append(f"processes over threads: {r['split']['speedup_of_processes']:.2f}x images/s")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args: argparse.Namespace, world: int, threads: int, batch: int, modes: list[str]
) -> dict[str, Any]:
    """Start ``world`` worker processes; return rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-") as work:
        result_file = Path(work) / "result.json"
        spec = json.dumps({"modes": modes, "result": str(result_file), "threads": threads})
        port = str(_free_port())
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": str(threads),
            }
            cmd = [sys.executable, "-m", "bench.allreduce", "--worker", spec, "--model", args.model]
            cmd += ["--resolution", str(args.resolution), "--batch", str(batch)]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            procs.append(
                common.popen(
                    cmd, cwd=common.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        outputs = [p.communicate() for p in procs]
        failed = [
            (i, err) for i, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)) if p.returncode
        ]
        if failed:
            raise RuntimeError(f"rank {failed[0][0]} failed:\n{failed[0][1][-3000:]}")
        return json.loads(result_file.read_text())


class _TimedCounter(ti.AllreduceCounter):
    """The engine's byte counter, also timing each all-reduce (hook call to completion)."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0

    def hook(self, state, bucket):
        start = time.perf_counter()
        fut = super().hook(state, bucket)

        def done(f):
            self.seconds += time.perf_counter() - start
            return f.value()[0]

        return fut.then(done)

    def reset(self) -> None:
        self.bytes, self.calls, self.seconds = 0, 0, 0.0


def _worker(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: both modes under DDP, interleaved; rank 0 writes the results."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with common.scratch_dir() as work:
            setup = common.make_setup(args.model, args.resolution, args.batch, work)
            setup.rank, setup.world_size = rank, world
            steps: dict[str, Any] = {}
            counters = {name: _TimedCounter() for name in spec["modes"]}
            if "ours" in spec["modes"]:
                ours = common.OursStep(setup)
                if world > 1:
                    ours.learned = DDP(ours.learned)
                    ours.learned.register_comm_hook(state=None, hook=counters["ours"].hook)
                steps["ours"] = ours
            if "reference" in spec["modes"]:
                ref = common.ReferenceStep(setup)
                with ref.active():  # DDP registers the parameters that require grad at construction
                    if world > 1:
                        ref.text_encoder = DDP(setup.parts.text_encoder)
                        ref.text_encoder.register_comm_hook(state=None, hook=counters["reference"].hook)
                steps["reference"] = ref

            def timed(name):
                def run(i: int) -> dict[str, float]:
                    counters[name].reset()
                    with steps[name].active():
                        start = time.perf_counter()
                        steps[name](i)
                        seconds = time.perf_counter() - start
                    c = counters[name]
                    return {"total": seconds, "bytes": c.bytes, "calls": c.calls, "comm": c.seconds}

                return run

            with cpu.keep_freed_memory():  # as the engine's loop
                results = common.run_interleaved({n: timed(n) for n in steps}, args.steps, args.warmup)
            transfer = {n: _allreduce_seconds(max(r["bytes"] for r in results[n])) for n in steps}
    finally:
        dist.barrier()
        dist.destroy_process_group()
    modes = {}
    for name, runs in results.items():
        modes[name] = {
            "seconds_per_step": common.summarize([r["total"] for r in runs]),
            "allreduce_bytes_per_step": max(r["bytes"] for r in runs),
            "allreduce_seconds": transfer[name],
            "allreduce_wait_seconds": common.summarize([r["comm"] for r in runs])["median"],
            "parameters_all_reduced": sum(p.numel() for p in _trainable(steps[name])),
        }
    out = {"world_size": world, "threads": torch.get_num_threads(), "batch": args.batch, "modes": modes}
    if rank == 0:
        common.write_json(spec["result"], out)
    return out


def _allreduce_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median time of all-reducing ``nbytes`` of fp32 alone (ranks aligned by a barrier first)."""
    if dist.get_world_size() < 2 or nbytes == 0:
        return 0.0
    buffer = torch.zeros(nbytes // 4)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        times.append(time.perf_counter() - start)
    return common.summarize(times)["median"]


def _trainable(step) -> list[torch.nn.Parameter]:
    if isinstance(step, common.OursStep):
        return list(step.learned.parameters())
    return [step.embedding.weight]


# --- latency mode: gloo against ccl --------------------------------------------------------------

LATENCY_SIZES = [3_072, 3_188_736, 2**22, 2**26]  # bytes: TI's vector, the DreamBooth LoRA, 4 MB, 64 MB
LATENCY_WORLD = 2
LATENCY_TIMEOUT = 600.0  # seconds: the whole launch, and each process group's timeout


def latency(args: argparse.Namespace) -> dict[str, Any]:
    """All-reduce latency per backend between 2 processes on this machine; writes the JSON."""
    backends = list(dict.fromkeys(args.backends))
    cores = cpu.physical_cores()
    ccl_env = oneccl.environment(LATENCY_WORLD, 1, cores, 1) if "ccl" in backends else []
    if "ccl" in backends:
        ok, reason = oneccl.available()
        if not ok:
            raise SystemExit(f"ccl: {reason}")
    spec = {"backends": backends, "sizes": LATENCY_SIZES, "rounds": args.rounds, "iters": args.iters}
    with tempfile.TemporaryDirectory(prefix="bench-allreduce-latency-") as work:
        spec["result"] = str(Path(work) / "result.json")
        spec["port"] = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", **{n: v for n, v, _ in ccl_env}}
        procs = []
        try:
            for rank in range(LATENCY_WORLD):
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.allreduce",
                    "--latency_worker",
                    json.dumps({**spec, "rank": rank}),
                ]
                procs.append(
                    common.popen(
                        cmd,
                        cwd=common.ROOT,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            outputs = [p.communicate(timeout=LATENCY_TIMEOUT)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
            if p.returncode:
                raise RuntimeError(f"rank {rank} failed:\n{out[-3000:]}")
        runs = json.loads(Path(spec["result"]).read_text())
    medians = {
        b: {str(n): common.summarize(runs[b][str(n)])["median"] for n in LATENCY_SIZES} for b in backends
    }
    report: dict[str, Any] = {
        "benchmark": "allreduce_backends",
        "world_size": LATENCY_WORLD,
        "threads_per_process": 1,
        "rounds": args.rounds,
        "iters_at_3kb": args.iters,
        "bytes": LATENCY_SIZES,
        "machine": common.machine(),
        "ccl_provider": runs.get("ccl_provider"),
        "ccl_environment": {n: v for n, v, _ in ccl_env},
        "median_seconds": medians,
        "runs_seconds": {b: runs[b] for b in backends},
    }
    if "gloo" in backends and "ccl" in backends:
        report["gloo_over_ccl"] = {k: medians["gloo"][k] / medians["ccl"][k] for k in medians["gloo"]}
    if args.step_rounds:
        report["train_step"] = train_step_effect(backends, args.step_rounds, args.step_model, args.step_steps)
    out = common.results_path("allreduce_backends-loopback.json", args.out, report["machine"])
    common.write_json(out, report)
    print(format_latency(report))
    print(f"wrote {out}")
    return report


STEP_TIMEOUT = 900.0  # seconds: one training run


def train_step_effect(backends: list[str], rounds: int, model: str, steps: int) -> dict[str, Any]:
    """Seconds per step of the same 2-process training job on each backend, backends alternating."""
    runs: dict[str, list[float]] = {b: [] for b in backends}
    for r in range(rounds):
        for b in backends if r % 2 == 0 else backends[::-1]:
            with tempfile.TemporaryDirectory(prefix="bench-allreduce-step-") as work:
                out = Path(work) / "out"
                flags = jobs.tiny_train_args(out, steps)
                flags[flags.index("tiny")] = model
                argv = [sys.executable, "-m", "helpers.launch", "--launcher", "mpirun", "--backend", b,
                        "--nproc_per_node", "2", "--main_process_port", "0", "--", *flags]  # fmt: skip
                proc = common.popen(argv, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)  # fmt: skip
                try:
                    text, _ = proc.communicate(timeout=STEP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    jobs.kill_tree(proc.pid)
                    proc.wait()
                    raise RuntimeError(
                        f"the {b} training run did not end within {STEP_TIMEOUT:g} s"
                    ) from None
                if proc.returncode:
                    raise RuntimeError(f"the {b} training run failed:\n{text[-3000:]}")
                summary = json.loads((out / "run_summary.json").read_text())
                if summary["backend"] != b:
                    raise RuntimeError(f"--backend {b} ran on {summary['backend']}")
                runs[b].append(summary["seconds_per_step"])
    medians = {b: common.summarize(runs[b])["median"] for b in backends}
    effect: dict[str, Any] = {"model": model, "resolution": 64, "steps": steps, "world_size": 2,
                              "median_seconds_per_step": medians, "runs_seconds_per_step": runs}  # fmt: skip
    if "gloo" in medians and "ccl" in medians:
        effect["gloo_over_ccl"] = medians["gloo"] / medians["ccl"]
    return effect


def format_latency(r: dict[str, Any]) -> str:
    backends = list(r["median_seconds"])
    lines = [
        f"all-reduce latency, {r['world_size']} processes x 1 thread on this machine, medians of {r['rounds']} rounds (µs)",
        f"{'bytes':>12}"
        + "".join(f"{b:>12}" for b in backends)
        + ("   gloo/ccl" if "gloo_over_ccl" in r else ""),
    ]
    for n in r["bytes"]:
        row = f"{n:>12,}" + "".join(f"{r['median_seconds'][b][str(n)] * 1e6:>12,.0f}" for b in backends)
        if "gloo_over_ccl" in r:
            row += f"{r['gloo_over_ccl'][str(n)]:>10.1f}x"
        lines.append(row)
    step = r.get("train_step")
    if step:
        shown = ", ".join(f"{b} {s:.3f} s" for b, s in step["median_seconds_per_step"].items())
        lines.append(f"2-process training step ({step['model']}, {step['resolution']} px): {shown}")
    return "\n".join(lines)


def _latency_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: every backend's all-reduce at every size, interleaved; rank 0 writes the times."""
    rank = spec["rank"]
    torch.set_num_threads(1)
    provider = None
    if "ccl" in spec["backends"]:
        provider = oneccl.load()
    timeout = datetime.timedelta(seconds=LATENCY_TIMEOUT)
    store = dist.TCPStore(
        "127.0.0.1", spec["port"], LATENCY_WORLD, rank == 0, timeout=timeout, wait_for_workers=False
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=LATENCY_WORLD, timeout=timeout)
    groups = {
        b: dist.group.WORLD if b == "gloo" else dist.new_group(backend=b, timeout=timeout)
        for b in spec["backends"]
    }
    runs: dict[str, Any] = {b: {} for b in groups}
    try:
        for nbytes in spec["sizes"]:
            buffer = torch.ones(nbytes // 4)
            iters = max(3, min(spec["iters"], spec["iters"] * 3_072 * 64 // nbytes))
            for group in groups.values():  # warm-up: connections, buffers
                for _ in range(2):
                    dist.all_reduce(buffer, group=group)
            for b in groups:
                runs[b][str(nbytes)] = []
            for r in range(spec["rounds"]):
                for b in list(groups) if r % 2 == 0 else list(groups)[::-1]:
                    dist.barrier(group=groups["gloo"] if "gloo" in groups else None)
                    start = time.perf_counter()
                    for _ in range(iters):
                        dist.all_reduce(buffer, group=groups[b])
                    runs[b][str(nbytes)].append((time.perf_counter() - start) / iters)
    finally:
        dist.destroy_process_group()
    runs["ccl_provider"] = provider
    if rank == 0:
        common.write_json(spec["result"], runs)
    return runs


if __name__ == "__main__":
    main(parse_args())

"""Time one textual-inversion training step: the engine against the reference approach, side by side.

    python -m bench.train_step --model sd15-shape --resolution 256 --batch 1 --steps 4

In one process, after warm-up, runs ``--steps`` steps of each mode interleaved (A B, B A, ...):
``ours`` (the engine's own ``helpers.training.textual_inversion.training_step``: only the new rows train,
cached latents) and ``reference`` (diffusers' example: the whole embedding matrix in AdamW with
rows restored, the VAE encoder in every step).
Prints seconds per step, images per second, the ratio, a per-phase breakdown, and the fraction
of the FLOP bound (FLOPs counted by ``torch.utils.flop_counter``, divided by this machine's
fp32 GEMM speed measured in the same run). Peak RSS is measured fairly in two fresh child
processes, one per mode: ``ours`` runs the real ``helpers.training.textual_inversion.train``.

    .venv-ipex/bin/python -m bench.train_step --ipex --model sd15-shape --mixed_precision bf16

``--memory_only`` runs the peak-RSS child processes alone (ours; ours with only its convolutions,
only its linear layers, or nothing prepacked; the reference) and writes ``train_memory-<model>-<px>px[-bf16].json``: peak RSS is valid on a
loaded machine, wall-clock is not, so a loaded machine can still measure memory.
:mod:`helpers.cluster.estimates` reads its peaks (``memory_per_process``).

``--whole_process SHORT LONG`` measures as users run it: whole processes of the guides' command
(:func:`bench.end_to_end.whole_process`), per step = (T(LONG) - T(SHORT)) / (LONG - SHORT), ours on a
warm latent cache, written to ``train_step_whole-<model>-<px>px[-bf16].json``.

``--ipex`` measures something else: the engine with and without Intel Extension for PyTorch, and
in the workshop's own torch, in alternating fresh processes (``bench.optimisations``' ``ipex``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from typing import Any

from bench import common
from helpers.core import cpu

PHASES = (
    "inputs",
    "text_encoder_forward",
    "unet_forward",
    "loss",
    "unet_backward",
    "text_encoder_backward",
    "optimizer",
    "communication",
)
ONEDNN_STEPS = 3  # steps per mode under oneDNN's verbose log; per-kind medians are reported
# Peak-RSS child processes of --memory_only: the engine with these prepack flags, and the reference.
ENGINE_MEMORY_MODES = {
    "ours": {},
    "ours_convs": {"prepack_linears": False},
    "ours_linears": {"prepack_convs": False},
    "ours_unpacked": {"prepack_convs": False, "prepack_linears": False},
}
MEMORY_MODES = (*ENGINE_MEMORY_MODES, "reference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, sd15-shape, or a local diffusers folder")
    parser.add_argument(
        "--resolution", type=int, default=None, help="pixels (default 64 tiny, 256 otherwise)"
    )
    parser.add_argument("--batch", type=int, default=1, help="images per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    parser.add_argument(
        "--mixed_precision",
        choices=("no", "bf16"),
        default="no",
        help="the engine's option, for both modes (bf16: autocast; fast only with native bf16)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS child processes")
    parser.add_argument(
        "--memory_only",
        action="store_true",
        help="only the peak-RSS child processes (ours, ours unpacked, reference): valid under load",
    )
    parser.add_argument("--out", default=None, help="JSON results file (default bench/results/...)")
    parser.add_argument(
        "--ipex",
        action="store_true",
        help="instead: the engine with and without Intel Extension for PyTorch, in alternating fresh "
        "processes (run it from .venv-ipex: make setup-ipex)",
    )
    parser.add_argument(
        "--whole_process",
        nargs=2,
        type=int,
        metavar=("SHORT", "LONG"),
        help="instead: seconds per step of whole processes (the guides' command, bench.end_to_end's "
        "ours on a warm latent cache and reference), (T(LONG) - T(SHORT)) / (LONG - SHORT)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="--whole_process: runs of each length and mode")
    parser.add_argument("--child", choices=MEMORY_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ipex and (problem := cpu.ipex_problem()):
        parser.error(f"--ipex: {problem}. Fix: {cpu.IPEX_FIX}")
    if args.resolution is None:
        args.resolution = 64 if args.model == "tiny" else 256
    if args.whole_process and not 0 < args.whole_process[0] < args.whole_process[1]:
        parser.error(f"--whole_process {' '.join(map(str, args.whole_process))}: needs 0 < SHORT < LONG")
    return args


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; return (and write) the results."""
    if args.ipex:
        return _ipex(args)
    if args.whole_process:
        from bench import end_to_end  # imports diffusers' pipeline classes: only this mode needs them

        short, long = args.whole_process
        return end_to_end.whole_process(
            args.model, args.resolution, args.mixed_precision, short, long, args.rounds, args.out
        )
    threads = cpu.set_threads(args.threads)
    if args.child:
        return _child(args)
    if args.memory_only:
        return _memory_only(args, threads)
    with common.scratch_dir() as work, ExitStack() as stack:
        setup = common.make_setup(args.model, args.resolution, args.batch, work, args.mixed_precision)
        ours, ref = common.OursStep(setup), common.ReferenceStep(setup)
        stack.enter_context(cpu.keep_freed_memory())  # as the engine's loop does, for both modes
        modes = {"ours": ours, "reference": ref}
        timer = common.PhaseTimer(setup.parts.text_encoder, ours.unet)

        def timed(mode):
            def run(step: int) -> dict[str, float]:
                with mode.active():
                    mode(step, timer)
                return timer.phases()

            return run

        for mode in modes.values():  # warm-up, then count FLOPs on a warm step
            with mode.active():
                for w in range(args.warmup):
                    mode(w)
        flops, onednn = {}, {}
        frozen = (setup.parts.unet, setup.parts.text_encoder, setup.parts.vae)
        for name, mode in modes.items():
            with mode.active():
                flops[name] = common.count_flops(lambda m=mode: m(0))
                logs = [common.onednn_seconds(lambda m=mode, i=i: m(i), frozen) for i in range(ONEDNN_STEPS)]
                onednn[name] = {k: statistics.median(g.get(k, 0.0) for g in logs) for k in set().union(*logs)}
        dtype = cpu.compute_dtype(args.mixed_precision)
        gemm = [common.gemm_gflops(dtype=dtype)]
        results = common.run_interleaved(
            {name: timed(mode) for name, mode in modes.items()},
            args.steps,
            warmup=0,
            between=lambda: gemm.append(common.gemm_gflops(dtype=dtype)),
        )
        timer.remove()
    memory = {} if args.no_memory else {name: _run_child(args, name, threads) for name in modes}
    report = _report(args, threads, flops, onednn, max(gemm), results, memory)
    suffix = "-bf16" if args.mixed_precision == "bf16" else ""
    out = common.results_path(
        f"train_step-{args.model}-{args.resolution}px{suffix}.json", args.out, report["machine"]
    )
    common.write_json(out, report)
    print(format_report(report))
    print(f"wrote {out}")
    return report


def _ipex(args: argparse.Namespace) -> dict[str, Any]:
    """The real engine with and without ``use_ipex`` (and in the workshop's torch), as
    :mod:`bench.optimisations` measures process-level options; its results feed the README's table."""
    from bench import optimisations

    suffix = "-bf16" if args.mixed_precision == "bf16" else ""
    out = common.results_path(f"optimisations-{args.model}-{args.resolution}px-ipex{suffix}.json", args.out)
    argv = ["--only", "ipex", "--model", args.model, "--resolution", str(args.resolution)]
    argv += ["--batch", str(args.batch), "--steps", str(args.steps), "--rounds", "3"]
    argv += ["--mixed_precision", args.mixed_precision, "--out", str(out)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return optimisations.main(optimisations.parse_args(argv))


def _report(args, threads, flops, onednn, gemm_peak, results, memory) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for name, steps in results.items():
        seconds = common.summarize([s["total"] for s in steps])
        modes[name] = {
            "seconds_per_step": seconds,
            "images_per_second": args.batch / seconds["median"],
            "breakdown": {p: common.summarize([s[p] for s in steps])["median"] for p in PHASES},
            "flops_per_step": flops[name],
            "onednn_seconds": onednn[name],
            **memory.get(name, {}),
        }
    ours, ref = modes["ours"], modes["reference"]
    bound = flops["ours"] / (gemm_peak * 1e9)
    report = {
        "benchmark": "train_step",
        "model": args.model,
        "resolution": args.resolution,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": threads,
        "mixed_precision": args.mixed_precision,
        "machine": common.machine(),
        "gemm_peak_gflops": gemm_peak,
        "flop_bound_seconds": bound,
        "modes": modes,
        "speedup": ref["seconds_per_step"]["median"] / ours["seconds_per_step"]["median"],
        "fraction_of_flop_bound": bound / ours["seconds_per_step"]["median"],
        "reference_fraction_of_flop_bound": bound / ref["seconds_per_step"]["median"],
    }
    if memory:
        report.update(common.rss_ratios(ours, ref))
    return report


def format_report(r: dict[str, Any]) -> str:
    """A plain-text table of a result."""
    ours, ref = r["modes"]["ours"], r["modes"]["reference"]
    lines = [
        f"{r['model']} {r['resolution']} px, batch {r['batch']}, {r['threads']} threads, "
        f"mixed precision {r.get('mixed_precision', 'no')}, "
        f"{r['steps']} steps/mode after {r['warmup']} warm-up (load {r['machine']['load_average'][0]:.2f})",
        f"{'':28}{'ours':>12}{'reference':>12}",
    ]

    def row(label: str, a: float, b: float, fmt: str = "{:12.3f}") -> None:
        lines.append(common.side_by_side(label, a, b, 28, fmt))

    row("s/step (median)", ours["seconds_per_step"]["median"], ref["seconds_per_step"]["median"])
    row("s/step (min)", ours["seconds_per_step"]["min"], ref["seconds_per_step"]["min"])
    row("images/s", ours["images_per_second"], ref["images_per_second"])
    lines += common.memory_lines(r, 28)
    row("GFLOP/step", ours["flops_per_step"] / 1e9, ref["flops_per_step"] / 1e9, "{:12.1f}")
    for phase in PHASES:
        row(f"  {phase}", ours["breakdown"][phase], ref["breakdown"][phase])
    lines.append(f"oneDNN's log, seconds per step (median of {ONEDNN_STEPS} steps):")
    for kind in sorted(set(ours["onednn_seconds"]) | set(ref["onednn_seconds"])):
        row(f"  {kind}", ours["onednn_seconds"].get(kind, 0.0), ref["onednn_seconds"].get(kind, 0.0))
    lines.append(f"speed-up (reference / ours): {r['speedup']:.2f}x")
    lines.append(
        f"FLOP bound {r['flop_bound_seconds']:.3f} s/step at {r['gemm_peak_gflops']:.0f} GFLOP/s "
        f"{'bf16' if r.get('mixed_precision') == 'bf16' else 'fp32'} GEMM peak: "
        f"ours at {100 * r['fraction_of_flop_bound']:.0f} %, reference at "
        f"{100 * r['reference_fraction_of_flop_bound']:.0f} %"
    )
    lines += common.rss_ratio_line(r)
    return "\n".join(lines)


# --- peak memory, one fresh process per mode --------------------------------------------------


def _memory_only(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """Peak RSS of each of :data:`MEMORY_MODES` in its own fresh process, one after the other."""
    modes = {name: _run_child(args, name, threads) for name in MEMORY_MODES}
    report = {
        "benchmark": "train_memory",
        "model": args.model,
        "resolution": args.resolution,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": threads,
        "mixed_precision": args.mixed_precision,
        "machine": common.machine(),
        "modes": modes,
        **common.rss_ratios(modes["ours"], modes["reference"]),
        "note": "child_seconds_per_step: the median step of each fresh process, a timing only where "
        "load_average shows the machine otherwise idle (peak RSS is valid either way)",
    }
    suffix = "-bf16" if args.mixed_precision == "bf16" else ""
    name = f"train_memory-{args.model}-{args.resolution}px{suffix}.json"
    out = common.results_path(name, args.out, report["machine"])
    common.write_json(out, report)
    width = 30
    lines = [f"{'peak RSS (MiB)':{width}}{'process':>12}{'training':>12}{'s/step':>10}"]
    for mode, m in modes.items():
        lines.append(
            f"{mode:{width}}{m['peak_rss_mib']:12.0f}{m['training_peak_rss_mib']:12.0f}"
            f"{m['child_seconds_per_step']:10.3f}"
        )
    print("\n".join([*lines, *common.rss_ratio_line(report), f"wrote {out}"]))
    return report


def _run_child(args: argparse.Namespace, mode: str, threads: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.train_step", "--child", mode, "--model", args.model]
    cmd += ["--resolution", str(args.resolution), "--batch", str(args.batch), "--threads", str(threads)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--mixed_precision", args.mixed_precision]
    proc = common.run(cmd, cwd=common.ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of one mode in a fresh process: ours is the real engine, ``train(config)``.

    Reports the whole-process peak and the training peak: the peak-RSS mark is reset once the
    weights are loaded (for ours just before the latents are cached, which is part of training).
    """
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="bench-child-") as work:
        if args.child in ENGINE_MEMORY_MODES:
            out = common.run_engine(
                args.model,
                args.resolution,
                args.batch,
                steps,
                work,
                mixed_precision=args.mixed_precision,
                **ENGINE_MEMORY_MODES[args.child],
            )
        else:
            setup = common.make_setup(args.model, args.resolution, args.batch, work, args.mixed_precision)
            ref = common.ReferenceStep(setup)
            timer = common.PhaseTimer(setup.parts.text_encoder, ref.unet)
            totals = []
            common.reset_peak_rss()
            with ref.active(), cpu.keep_freed_memory():  # the same allocator setting as the engine
                for step in range(steps):
                    ref(step, timer)
                    totals.append(timer.phases()["total"])
            out = {
                "seconds_per_step": common.summarize(totals[args.warmup :] or totals)["median"],
                "peak_rss_mib": common.peak_rss_mib(),
                "training_peak_rss_mib": common.peak_rss_since_reset_mib(),
            }
    out["child_seconds_per_step"] = out.pop("seconds_per_step")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(parse_args())

"""Where the engine's training step loses against the machine's bound, family of ops by family.

    python -m bench.step_ops --model sd15-shape --resolution 256 [--mixed_precision bf16] [--steps 2]

After warm-up, the engine's own step (``common.OursStep``) runs ``--steps`` times under
``torch.profiler`` and once under torch's FLOP counter. Every op's self time (its own time, its
callees' excluded, so the parts add up to the profiled step) goes to one family: convolution,
matmul, attention, normalisation, activation, copies, casts and fills, or element-wise and other. Per
family: seconds per step, GFLOP per step, GFLOP/s, and the seconds lost against the bound,
``seconds - FLOPs / peak``, where ``peak`` is this machine's matrix-multiply speed in the compute
dtype, measured in the same process. Families without FLOPs lose all of their time. oneDNN's own
work (its weight and activation reorders included) is inside the convolution family;
``bench.train_step`` splits it by primitive kind. Also the ops with the most self time, each with
its input shapes. Results: ``bench/results/step_ops-<model>-<px>px[-bf16].json``. Not part of
``make test``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile

from bench import common
from helpers import cpu

# First match wins; names are profiler keys ("aten::mkldnn_convolution") or FLOP-counter ops ("convolution").
FAMILIES = (
    ("convolution", r"conv"),
    ("attention", r"scaled_dot_product|attention"),
    ("matmul", r"\b(mm|addmm|bmm|baddbmm|matmul|linear)\b|_linear_pointwise"),
    ("normalisation", r"norm"),
    ("activation", r"silu|gelu|sigmoid|softmax"),
    ("copies, casts and fills", r"copy|\bto\b|contiguous|clone|\bcat\b|empty|zero|fill"),
)
OTHER = "element-wise and other"
TOP_OPS = 15


def family(name: str) -> str:
    """The family of an op name (see :data:`FAMILIES`)."""
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return OTHER


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.step_ops", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sd15-shape", help="sd15-shape, tiny or a local diffusers folder")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps (after one warm-up step)")
    parser.add_argument("--mixed_precision", choices=("no", "bf16"), default="no")
    parser.add_argument(
        "--out", default=None, help="default: bench/results/step_ops-<model>-<px>px[-bf16].json"
    )
    return parser.parse_args(argv)


def flops_by_family(fn) -> dict[str, float]:
    """FLOPs of one ``fn()`` per family, from torch's FLOP counter (with the CPU attention formula)."""
    out: dict[str, float] = {}
    for op, n in common.flop_counts(fn).items():
        out[family(op)] = out.get(family(op), 0.0) + n
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    threads = cpu.set_threads(None)
    with common.scratch_dir() as work, cpu.keep_freed_memory():
        setup = common.make_setup(args.model, args.resolution, args.batch, work, args.mixed_precision)
        ours = common.OursStep(setup)
        with ours.active():
            ours(0)  # warm-up
            plain = []
            for i in range(args.steps):
                start = time.perf_counter()
                ours(1 + i)
                plain.append(time.perf_counter() - start)
            flops = flops_by_family(lambda: ours(0))
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for i in range(args.steps):
                    ours(1 + args.steps + i)
    dtype = cpu.compute_dtype(args.mixed_precision)
    peak = max(common.gemm_gflops(dtype=dtype) for _ in range(3)) * 1e9
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        fam = family(event.key)
        seconds[fam] = seconds.get(fam, 0.0) + event.self_cpu_time_total / 1e6 / args.steps
    top = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    families = {}
    for fam in [f for f, _ in FAMILIES] + [OTHER]:
        s, n = seconds.get(fam, 0.0), flops.get(fam, 0.0)
        families[fam] = {
            "seconds": s,
            "gflop": n / 1e9,
            "gflops_per_s": n / s / 1e9 if s and n else 0.0,
            "fraction_of_peak": n / s / peak if s and n else 0.0,
            "seconds_lost": s - n / peak,
        }
    profiled = sum(seconds.values())
    total_flops = sum(flops.values())
    result = {
        "model": args.model,
        "resolution": args.resolution,
        "batch": args.batch,
        "mixed_precision": args.mixed_precision,
        "threads": threads,
        "steps": args.steps,
        "seconds_per_step": statistics.median(plain),
        "profiled_seconds_per_step": profiled,
        "gflop_per_step": total_flops / 1e9,
        "peak_gflops": peak / 1e9,
        "bound_seconds": total_flops / peak,
        "fraction_of_bound": total_flops / peak / statistics.median(plain),
        "families": families,
        "top_ops": [
            {
                "op": e.key,
                "input_shapes": str(e.input_shapes),
                "calls_per_step": e.count / args.steps,
                "seconds": e.self_cpu_time_total / 1e6 / args.steps,
            }
            for e in top
        ],
        "machine": common.machine(),
    }
    suffix = "-bf16" if args.mixed_precision == "bf16" else ""
    out = Path(args.out or common.RESULTS / f"step_ops-{args.model}-{args.resolution}px{suffix}.json")
    common.write_json(out, result)
    print("\n".join(table([result])))
    print(f"\nwrote {out}")
    return result


def table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: per family, seconds per step and seconds lost against the bound."""
    lines = [
        "Where the engine's step loses against its bound (`bench.step_ops`: self time per family of ops "
        "under torch's profiler; lost = seconds - FLOPs / GEMM peak):",
        "",
        "| model | px | precision | family | s/step | GFLOP | GFLOP/s | of peak | s lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: r["mixed_precision"] != "no"):
        precision = "bf16" if r["mixed_precision"] == "bf16" else "fp32"
        head = f"| {r['model']} | {r['resolution']} | {precision} |"
        for fam, f in sorted(r["families"].items(), key=lambda kv: -kv[1]["seconds_lost"]):
            if f["seconds"] < 0.005:
                continue
            rate = f"{f['gflops_per_s']:.0f} | {100 * f['fraction_of_peak']:.0f} %" if f["gflop"] else "- | -"
            lines.append(
                f"{head} {fam} | {f['seconds']:.2f} | {f['gflop']:.0f} | {rate} | {f['seconds_lost']:.2f} |"
            )
            head = "| | | |"
        lines.append(
            f"| | | | **step** | **{r['seconds_per_step']:.2f}** (profiled {r['profiled_seconds_per_step']:.2f}) | "
            f"{r['gflop_per_step']:.0f} | peak {r['peak_gflops']:.0f} | {100 * r['fraction_of_bound']:.0f} % "
            f"| {r['seconds_per_step'] - r['bound_seconds']:.2f} |"
        )
    return lines


if __name__ == "__main__":
    main(parse_args())

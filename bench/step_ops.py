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
its input shapes.

The FLOP bound ignores that at batch 1 many layers have few rows (16 at the UNet's 4x4 level at
256 px) against a large frozen weight, which has to come from memory on every call: a 1280 x 1280
x 3 x 3 convolution reads 29 MB of bf16 weights for 0.5 GFLOP. So each family also gets a
roofline bound: per op call with FLOPs, ``max(FLOPs / peak, frozen weight bytes / read speed)``
(the weights read: the modules' parameters and the engine's laid-out copies; activations are
taken as cached, so it stays a lower bound), with the read speed of a 1 GiB sum measured in the
same process. Results: ``bench/results/step_ops-<model>-<px>px[-bf16].json``. Not part of
``make test``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from bench import common
from helpers.core import cpu

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


class _CallCounter(FlopCounterMode):
    """torch's FLOP counter, call by call: each op call with FLOPs as (family, FLOPs, bytes of the
    frozen weights it reads). A weight is a tensor whose storage is one of ``weights`` (data
    pointers), or a oneDNN-laid-out tensor (only the engine's copies of weights are)."""

    def __init__(self, weights: set[int]):
        super().__init__(display=False, custom_mapping=common.CPU_FLOPS)
        self.weights, self.calls = weights, []

    def _is_weight(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (t.is_mkldnn or t.untyped_storage().data_ptr() in self.weights)

    def _count_flops(self, func_packet, out, args, kwargs):  # the counter's per-call hook (torch 2.x)
        before = self.flop_counts["Global"][func_packet]
        out = super()._count_flops(func_packet, out, args, kwargs)
        if flops := self.flop_counts["Global"][func_packet] - before:
            read = sum(
                t.numel() * t.element_size() for t in pytree.tree_leaves((args, kwargs)) if self._is_weight(t)
            )
            self.calls.append((family(str(func_packet)), flops, read))
        return out


def op_calls(fn, modules) -> list[tuple[str, int, int]]:
    """Every op call with FLOPs in one ``fn()``: (family, FLOPs, bytes of frozen weights read), the
    weights being ``modules``' parameters and buffers (and oneDNN-laid-out copies)."""
    weights = {t.untyped_storage().data_ptr() for m in modules for t in (*m.parameters(), *m.buffers())}
    with _CallCounter(weights) as counter:
        fn()
    return counter.calls


def roofline(calls: list[tuple[str, int, int]], peak: float, read_bytes_per_s: float) -> dict[str, dict]:
    """Per family: FLOPs, weight bytes read, and the roofline bound, the sum over the calls of
    ``max(FLOPs / peak, bytes / read speed)``."""
    out: dict[str, dict] = {}
    for fam, flops, read in calls:
        f = out.setdefault(fam, {"flops": 0, "weight_bytes": 0, "bound_seconds": 0.0})
        f["flops"] += flops
        f["weight_bytes"] += read
        f["bound_seconds"] += max(flops / peak, read / read_bytes_per_s)
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    threads = cpu.set_threads(None)
    dtype = cpu.compute_dtype(args.mixed_precision)
    # The GEMM peak, before the model is loaded and again after the steps; the best counts (on a Xeon
    # with AMX, bf16 reached 2,050-2,360 GFLOP/s in a fresh process but 1,560-1,620 after the steps).
    peaks = [common.gemm_gflops(dtype=dtype) for _ in range(3)]
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
            calls = op_calls(lambda: ours(0), (setup.parts.unet, setup.parts.text_encoder))
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for i in range(args.steps):
                    ours(1 + args.steps + i)
    peak = max(peaks + [common.gemm_gflops(dtype=dtype) for _ in range(3)]) * 1e9
    read = common.read_gbps() * 1e9
    roof = roofline(calls, peak, read)
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        fam = family(event.key)
        seconds[fam] = seconds.get(fam, 0.0) + event.self_cpu_time_total / 1e6 / args.steps
    top = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    families = {}
    for fam in [f for f, _ in FAMILIES] + [OTHER]:
        s, r = seconds.get(fam, 0.0), roof.get(fam, {"flops": 0, "weight_bytes": 0, "bound_seconds": 0.0})
        n = r["flops"]
        families[fam] = {
            "seconds": s,
            "gflop": n / 1e9,
            "gflops_per_s": n / s / 1e9 if s and n else 0.0,
            "fraction_of_peak": n / s / peak if s and n else 0.0,
            "seconds_lost": s - n / peak,
            "weight_gb": r["weight_bytes"] / 1e9,
            "roofline_seconds": r["bound_seconds"],
        }
    profiled = sum(seconds.values())
    total_flops = sum(r["flops"] for r in roof.values())
    roofline_seconds = sum(r["bound_seconds"] for r in roof.values())
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
        "read_gbps": read / 1e9,
        "roofline_seconds": roofline_seconds,
        "fraction_of_roofline": roofline_seconds / statistics.median(plain),
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
    out = common.results_path(f"step_ops-{args.model}-{args.resolution}px{suffix}.json", args.out)
    common.write_json(out, result)
    print("\n".join(table([result])))
    print(f"\nwrote {out}")
    return result


def table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: per family, seconds per step, seconds lost against the FLOP bound, and the roofline
    bound (results measured before it existed show "-" there)."""
    lines = [
        "Where the engine's step loses against its bound (`bench.step_ops`: self time per family of ops "
        "under torch's profiler; lost = seconds - FLOPs / GEMM peak; roofline = the sum over calls of "
        "max(FLOPs / GEMM peak, frozen weights read / memory read speed)):",
        "",
        "| model | px | precision | family | s/step | GFLOP | GFLOP/s | of peak | s lost | weights read, GB | roofline, s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def roof(f: dict[str, Any]) -> str:
        if "roofline_seconds" not in f:
            return "- | -"
        return f"{f['weight_gb']:.2f} | {f['roofline_seconds']:.2f}" if f["gflop"] else "- | -"

    for r in sorted(results, key=lambda r: r["mixed_precision"] != "no"):
        precision = "bf16" if r["mixed_precision"] == "bf16" else "fp32"
        head = f"| {r['model']} | {r['resolution']} | {precision} |"
        for fam, f in sorted(r["families"].items(), key=lambda kv: -kv[1]["seconds_lost"]):
            if f["seconds"] < 0.005:
                continue
            rate = f"{f['gflops_per_s']:.0f} | {100 * f['fraction_of_peak']:.0f} %" if f["gflop"] else "- | -"
            lines.append(
                f"{head} {fam} | {f['seconds']:.2f} | {f['gflop']:.0f} | {rate} | {f['seconds_lost']:.2f} | {roof(f)} |"
            )
            head = "| | | |"
        if "roofline_seconds" in r:
            step_roof = (
                f"{sum(f.get('weight_gb', 0) for f in r['families'].values()):.2f} at {r['read_gbps']:.0f} GB/s | "
                f"**{r['roofline_seconds']:.2f}** ({100 * r['fraction_of_roofline']:.0f} %)"
            )
        else:
            step_roof = "- | -"
        lines.append(
            f"| | | | **step** | **{r['seconds_per_step']:.2f}** (profiled {r['profiled_seconds_per_step']:.2f}) | "
            f"{r['gflop_per_step']:.0f} | peak {r['peak_gflops']:.0f} | {100 * r['fraction_of_bound']:.0f} % "
            f"| {r['seconds_per_step'] - r['bound_seconds']:.2f} | {step_roof} |"
        )
    return lines


if __name__ == "__main__":
    main(parse_args())

"""Turn the JSON results under ``bench/results/`` into the markdown tables of the README.

python -m bench.report     # writes bench/results/README_table.md and the README's Performance tables

The README's tables sit between the markers ``<!-- bench:begin -->`` and ``<!-- bench:end -->``;
everything outside them is left as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import common
from helpers.files import write_text_atomic

README = common.ROOT / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
VARIANT_LABELS = {
    "pytorch_fp32": "PyTorch fp32",
    "openvino_dynamic": "OpenVINO dynamic",
    "openvino_static": "OpenVINO static",
    "openvino_static_int8": "OpenVINO static, int8 weights",
    "openvino_static_bf16": "OpenVINO static, bf16 (the CPU's default)",
}

OPTION_NOTES = {
    "channels_last": "UNet weights and activations in NHWC",
    "attention_math": "SDPA math backend instead of the CPU flash kernel",
    "attention_classic": "diffusers `AttnProcessor` (baddbmm + softmax) instead of SDPA",
    "flush_denormal": "`torch.set_flush_denormal(True)`",
    "prepacked_convs": "conv weights reordered for oneDNN once (`bench/prepack.py`); +2 x 2.19 GiB of weight copies",
    "compile": "`torch.compile(unet)` (default inductor)",
    "bf16_weights": "bf16 runs: the frozen UNet held in bf16 instead of autocast casting its fp32 weights every step",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(common.RESULTS), help="folder of result JSON files")
    parser.add_argument("--out", default=None, help="markdown file (default RESULTS/README_table.md)")
    parser.add_argument("--readme", default=str(README), help="README whose tables to replace ('' for none)")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> str:
    results = Path(args.results)
    loaded = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    text = render(loaded)
    write_text_atomic(args.out or results / "README_table.md", text)
    if args.readme:
        write_text_atomic(args.readme, replace_block(Path(args.readme).read_text(), text))
    print(text)
    return text


def replace_block(readme: str, tables: str) -> str:
    """``readme`` with the text between the bench markers replaced by ``tables``.

    Raises:
        ValueError: the markers are missing or out of order (nothing is written then).
    """
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README needs the lines {BEGIN} and {END} (in that order) around its tables")
    return readme[: start + len(BEGIN)] + "\n" + tables + readme[end:]


def describe_machine(m: dict[str, Any]) -> str:
    """One line: CPU, cores, instruction sets, memory and library versions of a result."""
    return (
        f"{m['cpu']}, {m['physical_cores']} cores ({', '.join(m['isa'])}), {m['ram_gib']} GiB; "
        f"torch {m['torch']}, diffusers {m['diffusers']}"
    )


def _precision(r: dict[str, Any]) -> str:
    return "bf16 autocast" if r.get("mixed_precision") == "bf16" else "fp32"


def _gib(mib: float) -> str:
    return f"{mib / 1024:.2f} GiB"


def render(results: dict[str, dict[str, Any]]) -> str:
    """The Performance section's tables from loaded results (keys: result file stems)."""
    steps = [r for k, r in results.items() if k.startswith("train_step-")]
    comms = [r for k, r in results.items() if k.startswith("allreduce-")]
    opts = [r for k, r in results.items() if k.startswith("optimisations-")]
    infer = [r for k, r in results.items() if k.startswith("inference-")]
    machines = sorted({describe_machine(r["machine"]) for r in results.values() if "machine" in r})
    out = [f"Measured on: {m}." for m in machines]
    if steps:
        out += [
            "",
            "Training: ours and the reference run in the same process, interleaved step by step; medians.",
            "",
            "| model | px | batch | precision | mode | s/step | images/s | peak RSS (process / training) "
            "| GFLOP/step | of FLOP bound |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            for name in ("ours", "reference"):
                mode = r["modes"][name]
                frac = (
                    r["fraction_of_flop_bound"] if name == "ours" else r["reference_fraction_of_flop_bound"]
                )
                rss = (
                    f"{_gib(mode['peak_rss_mib'])} / {_gib(mode['training_peak_rss_mib'])}"
                    if "peak_rss_mib" in mode
                    else "-"
                )
                out.append(
                    f"| {r['model']} | {r['resolution']} | {r['batch']} | {_precision(r)} | {name} | "
                    f"{mode['seconds_per_step']['median']:.2f} | {mode['images_per_second']:.3f} | {rss} | "
                    f"{mode['flops_per_step'] / 1e9:.0f} | {100 * frac:.0f} % |"
                )
            out.append(
                f"| | | | | **ours / reference** | **{r['speedup']:.2f}x faster** | | "
                f"{r.get('rss_ratio', float('nan')):.2f} / {r.get('training_rss_ratio', float('nan')):.2f} | "
                f"bound {r['flop_bound_seconds']:.2f} s at {r['gemm_peak_gflops']:.0f} GFLOP/s | |"
            )
        out += ["", "Where a step's time goes (seconds, medians):", ""]
        phases = list(steps[0]["modes"]["ours"]["breakdown"])
        out.append(
            "| model | px | precision | mode | " + " | ".join(p.replace("_", " ") for p in phases) + " |"
        )
        out.append("|---|---|---|---|" + "---|" * len(phases))
        for r in steps:
            for name in ("ours", "reference"):
                b = r["modes"][name]["breakdown"]
                out.append(
                    f"| {r['model']} | {r['resolution']} | {_precision(r)} | {name} | "
                    + " | ".join(f"{b[p]:.2f}" for p in phases)
                    + " |"
                )
    if comms:
        out += [
            "",
            "Data-parallel communication (gloo, localhost), per step:",
            "",
            "| model | px | processes x threads | mode | bytes all-reduced | all-reduce s | s/step |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in comms:
            layout = f"{r['world_size']} x {r['threads_per_process']}"
            for name in ("ours", "reference"):
                mode = r["modes"][name]
                out.append(
                    f"| {r['model']} | {r['resolution']} | {layout} | {name} | "
                    f"{mode['allreduce_bytes_per_step']:,} | {mode['allreduce_seconds']:.4f} | "
                    f"{mode['seconds_per_step']['median']:.2f} |"
                )
            out.append(f"| | | | **ratio** | **{r['bytes_ratio']:,.0f}x fewer** | | {r['speedup']:.2f}x |")
        for r in comms:
            if "split" in r:
                parts = [
                    f"{name.replace('x', ' processes x ', 1)} threads: {v['images_per_second']:.3f} images/s"
                    for name, v in r["split"]["layouts"].items()
                ]
                out += [
                    "",
                    f"One node, same {r['split']['images_per_step']} images per step ({r['model']}, "
                    f"{r['resolution']} px): "
                    + "; ".join(parts)
                    + f" ({r['split']['speedup_of_processes']:.2f}x).",
                ]
    groups: dict[tuple, dict[str, Any]] = {}
    for r in opts:  # several files for one model and resolution make one table
        key = (r["model"], r["resolution"], r["batch"], r["threads"])
        groups.setdefault(key, {}).update(r["options"])
    for (model, resolution, batch, threads), options in groups.items():
        out += [
            "",
            f"What each option buys ({model}, {resolution} px, batch {batch}, {threads} threads; "
            "speed-up > 1: faster with the option):",
            "",
            "| option | in the engine | without | with | speed-up | memory, note |",
            "|---|---|---|---|---|---|",
        ]
        for name, o in options.items():
            out.extend(_option_rows(name, o))
    if infer:
        out += ["", *_inference_table(infer)]
    return "\n".join(out) + "\n"


def _inference_table(results: list[dict[str, Any]]) -> list[str]:
    """Seconds per image per variant; speed-up over PyTorch and PSNR against it in brackets."""
    names = [v for v in VARIANT_LABELS if any(v in r["seconds_per_image"] for r in results)]
    columns = [f"{r['model']}, {r['resolution']} px, {r['steps']} steps, batch {r['batch']}" for r in results]
    lines = [
        "Inference, seconds per image (x PyTorch, PSNR against PyTorch); same latents, prompt and "
        "scheduler for every variant, medians:",
        "",
        "| variant | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(results),
    ]
    for name in names:
        cells = []
        for r in results:
            if name not in r["seconds_per_image"]:
                cells.append("-")
                continue
            psnr = r["psnr_vs_pytorch_db"][name]
            cells.append(
                f"{r['seconds_per_image'][name]:.3g} ({r['speedup_vs_pytorch'][name]:.2f}x, "
                + ("same" if name == "pytorch_fp32" else f"{psnr:.0f} dB")
                + ")"
            )
        lines.append(f"| {VARIANT_LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


PROCESS_NOTES = {
    "glibc_default": ("keep_freed_memory (glibc `mallopt`)", "yes"),
    "tcmalloc": ("tcmalloc via `LD_PRELOAD`", "no"),
    "jemalloc": ("jemalloc via `LD_PRELOAD` (+ `MALLOC_CONF`)", "no"),
    "thp": ("`THP_MEM_ALLOC_ENABLE=1` (huge pages) on top of the engine", "no"),
    "close_cores": ("`OMP_PROC_BIND=close OMP_PLACES=cores`", "no"),
    "gradient_checkpointing": ("gradient_checkpointing", "no (flag)"),
}


def _option_rows(name: str, o: dict[str, Any]) -> list[str]:
    if "on_s" in o:  # in-process A/B
        note = OPTION_NOTES.get(name, "")
        if name == "compile":
            note += f"; compile time {o['compile_s']:.0f} s, not counted"
        used = "yes" if o["used_by_engine"] else "no"
        return [
            f"| {name} | {used} | {o['off_s']:.2f} s | {o['on_s']:.2f} s | {o['speedup']:.2f}x | {note} |"
        ]
    rows = []
    base_s, base_rss = o["baseline_s"], o["baseline_training_rss_mib"]
    glibc_s = o.get("glibc_default_s")
    for key in o:
        if not key.endswith("_speedup"):
            continue
        variant = key[: -len("_speedup")]
        label, used = PROCESS_NOTES.get(variant, (variant, "no"))
        var_s, var_rss = o[f"{variant}_s"], o[f"{variant}_training_rss_mib"]
        if variant == "glibc_default":  # the engine's own setting, against glibc's defaults
            row = (label, used, glibc_s, base_s, glibc_s / base_s, base_rss, var_rss)
        elif glibc_s is not None and variant != "thp":  # another allocator, against glibc's defaults
            row = (label, used, glibc_s, var_s, glibc_s / var_s, var_rss, o["glibc_default_training_rss_mib"])
        else:
            row = (label, used, base_s, var_s, base_s / var_s, var_rss, base_rss)
        label, used, without, with_, speedup, rss_with, rss_without = row
        rows.append(
            f"| {label} | {used} | {without:.2f} s | {with_:.2f} s | {speedup:.2f}x | "
            f"training peak RSS {_gib(rss_with)} (without: {_gib(rss_without)}) |"
        )
    return rows


if __name__ == "__main__":
    main(parse_args())

"""Turn the JSON results under ``bench/results/`` into markdown tables: the one home of every figure.

python -m bench.report     # writes bench/results/README_table.md, docs/performance.md's tables, README's headline

``docs/performance.md`` holds every table between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``;
``README.md`` holds one headline table between ``<!-- bench:headline:begin -->`` and
``<!-- bench:headline:end -->``. Everything outside the markers is left as it is, and
``tests/test_bench.py`` fails when the committed text differs from what this renders.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import common, end_to_end, optimisations, startup, step_ops
from helpers import inference
from helpers.core.files import write_text_atomic

README = common.ROOT / "README.md"
PERFORMANCE = common.ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
HEADLINE_BEGIN, HEADLINE_END = "<!-- bench:headline:begin -->", "<!-- bench:headline:end -->"
VARIANT_LABELS = {
    "pytorch_fp32": "PyTorch fp32",
    "openvino_dynamic": "OpenVINO dynamic",
    "openvino_static": "OpenVINO static",
    "openvino_static_int8": "OpenVINO static, int8 weights",
    inference.BF16_VARIANT: "OpenVINO static, bf16 (the CPU's default)",
    "openvino_static_int8_bf16": "OpenVINO static, int8 weights, bf16 compute",
    inference.QUANT_VARIANT: "OpenVINO static, UNet and VAE decoder in int8 (weights and activations, calibrated)",
}

OPTION_NOTES = {
    "channels_last": "UNet weights and activations in NHWC",
    "attention_math": "SDPA math backend instead of the CPU flash kernel",
    "attention_classic": "diffusers `AttnProcessor` (baddbmm + softmax) instead of SDPA",
    "attention_by_size": "the classic processor up to 1024 x 1024 scores per head, SDPA above "
    "(`helpers/training/engine/attention.py`), against SDPA everywhere",
    "flush_denormal": "`torch.set_flush_denormal(True)`",
    "prepacked_convs": "conv weights laid out for oneDNN once, forward and input gradient "
    "(`helpers/training/engine/prepack.py`); two copies of them, less the dense weights they free "
    "(`prepack.copy_bytes`, SD v1.5 UNet): +2.2 GiB fp32, +1.1 GiB bf16",
    "prepacked_linears": "linear-layer weights laid out for oneDNN once, forward and input gradient "
    "(`helpers/training/engine/prepack.py`); two copies of them, less the dense weights they free "
    "(`prepack.linear_copy_bytes`, SD v1.5 UNet): +1.0 GiB fp32, +0.5 GiB bf16",
    "prepacked_text_encoder": "the text encoder's frozen linear layers laid out once too (its bf16 "
    "runs compute on bf16 copies of its fp32 weights instead of autocast casting them every step)",
    "prepacked_convs_forward": "the forward's copy only (half the memory), against no copies",
    "prepacked_convs_backward": "the input gradient's copy only (half the memory), against no copies",
    "fused_qkv": "diffusers' `fuse_qkv_projections()`: one GEMM for q, k, v (self-attention), one for k, v",
    "compile": "`torch.compile(unet)` (default inductor)",
    "bf16_weights": "bf16 runs: the frozen UNet held in bf16 instead of autocast casting its fp32 weights every step",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(common.RESULTS), help="folder of result JSON files")
    parser.add_argument("--out", default=None, help="markdown file (default RESULTS/README_table.md)")
    parser.add_argument("--docs", default=str(PERFORMANCE), help="page whose tables to replace ('' for none)")
    parser.add_argument(
        "--readme", default=str(README), help="README whose headline table to replace ('' for none)"
    )
    return parser.parse_args(argv)


def load(results: Path) -> dict[str, dict[str, Any]]:
    """Every result file of a folder, by file stem (the keys :func:`render` and :func:`headline` read)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def main(args: argparse.Namespace) -> str:
    results = Path(args.results)
    loaded = load(results)
    text = render(loaded)
    # Both pages are checked before either is written, so a missing marker leaves neither half-updated.
    pages = {}
    if args.docs:
        pages[args.docs] = replace_block(Path(args.docs).read_text(), text)
    if args.readme:
        pages[args.readme] = replace_block(
            Path(args.readme).read_text(), headline(loaded), HEADLINE_BEGIN, HEADLINE_END
        )
    write_text_atomic(args.out or results / "README_table.md", text)
    for path, page in pages.items():
        write_text_atomic(path, page)
    print(text)
    return text


def replace_block(page: str, tables: str, begin: str = BEGIN, end: str = END) -> str:
    """``page`` with the text between the markers ``begin`` and ``end`` replaced by ``tables``.

    Raises:
        ValueError: the markers are missing or out of order (nothing is written then).
    """
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"the page needs the lines {begin} and {end} (in that order) around its tables")
    return page[: start + len(begin)] + "\n" + tables + page[stop:]


def headline(results: dict[str, dict[str, Any]]) -> str:
    """The README's one table: ours against the reference on the SD v1.5 shape, each row from its file.

    Rows whose result file is missing are left out, so a partial results folder still renders.
    """
    rows = []
    for precision, stem in (
        ("fp32", "train_step-sd15-shape-256px"),
        ("bf16", "train_step-sd15-shape-256px-bf16"),
    ):
        if stem in results:
            r = results[stem]
            ours, ref = (r["modes"][m]["seconds_per_step"]["median"] for m in ("ours", "reference"))
            rows.append(
                f"| one training step, {precision} | {ours:.2f} s | {ref:.2f} s | **{r['speedup']:.2f}x** "
                f"| `{stem}.json` |"
            )
    for steps, precision in ((30, "fp32"), (30, "bf16"), (200, "fp32")):
        stem = f"end_to_end-sd15-shape-256px-{steps}steps-{precision}"
        if stem in results:
            r = results[stem]
            m = r["medians"]
            rows.append(
                f"| the guides' command, {steps} steps, {precision}, first run | "
                f"{m['ours']['wall_seconds']:.0f} s | {m['reference']['wall_seconds']:.0f} s | "
                f"**{r['speedup_ours']:.2f}x** | `{stem}.json` |"
            )
    stem = "allreduce-sd15-shape-256px"
    if stem in results:
        r = results[stem]
        ours, ref = (r["modes"][m]["allreduce_bytes_per_step"] for m in ("ours", "reference"))
        rows.append(
            f"| bytes all-reduced per step | {ours:,} | {ref:,} | **{r['bytes_ratio']:,.0f}x fewer** "
            f"| `{stem}.json` |"
        )
    stem = "inference-sd15-shape-256px"
    if stem in results:
        r = results[stem]
        fastest = max(r["speedup_vs_pytorch"], key=r["speedup_vs_pytorch"].get)
        rows.append(
            f"| one image, 10 steps: {VARIANT_LABELS.get(fastest, fastest)} against PyTorch fp32 | "
            f"{r['seconds_per_image'][fastest]:.2f} s | {r['seconds_per_image']['pytorch_fp32']:.1f} s | "
            f"**{r['speedup_vs_pytorch'][fastest]:.2f}x** at {r['psnr_vs_pytorch_db'][fastest]:.1f} dB "
            f"| `{stem}.json` |"
        )
    machines = sorted(
        {
            describe_machine(results[k]["machine"])
            for k in results
            if "machine" in results[k] and k.startswith("train_step-")
        }
    )
    head = [
        "SD v1.5 shape (random weights), 256 px, batch 1; medians"
        + "".join(f"; measured on {m}" for m in machines)
        + ".",
        "",
        "| what | ours | reference | ours / reference | result file (`bench/results/`) |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def describe_machine(m: dict[str, Any]) -> str:
    """One line: CPU, cores, instruction sets, memory and library versions of a result."""
    return (
        f"{m['cpu']}{f' (family/model {fm})' if (fm := m.get('cpu_family_model')) else ''}, "
        f"{m['physical_cores']} cores ({', '.join(m['isa'])}), {m['ram_gib']} GiB; "
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
            rss_ratios = f"{r['rss_ratio']:.2f} / {r['training_rss_ratio']:.2f}" if "rss_ratio" in r else "-"
            out.append(
                f"| | | | | **ours / reference** | **{r['speedup']:.2f}x faster** | | {rss_ratios} | "
                f"bound {r['flop_bound_seconds']:.2f} s at {r['gemm_peak_gflops']:.0f} GFLOP/s | |"
            )
        phases = list(steps[0]["modes"]["ours"]["breakdown"])
        out += [
            "",
            *_seconds_by_mode(steps, "Where a step's time goes (seconds, medians):", "breakdown", phases),
            "",
            *_onednn_table(steps),
        ]
    ops = [r for k, r in results.items() if k.startswith("step_ops-")]
    if ops:  # bench/step_ops.py: the engine's step by family of ops, against the bound
        out += ["", *step_ops.table(ops)]
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
    for k, r in results.items():
        if k.startswith("scaling-"):  # bench/scaling.py: the calibration of helpers.cluster.scaling
            seconds = dict(zip(r["bytes"], r["median_seconds"], strict=True))
            out += [
                "",
                f"All-reduce alone ({r['transport']}, {r['world_size']} processes): "
                + ", ".join(
                    f"{n:,} bytes {seconds[n] * 1e3:.2f} ms" for n in (r["bytes"][0], 3_072, r["bytes"][-1])
                )
                + f"; the ring model's fit: {r['fit']['latency_s'] * 1e6:.0f} µs per ring step, "
                f"{r['fit']['bytes_per_s'] / 1e9:.2f} GB/s.",
            ]
    for k, r in results.items():
        if k.startswith("startup-"):  # bench/startup.py: time to the first step, latent cache off/cold/warm
            out += ["", *startup.table(r)]
    differenced = [r for k, r in results.items() if k.startswith("train_step_whole-")]
    if differenced:  # bench.train_step --whole_process: per step as whole processes pay it
        out += ["", *end_to_end.whole_process_table(differenced)]
    whole = [r for k, r in results.items() if k.startswith("end_to_end-")]
    if whole:  # bench/end_to_end.py: the guides' command as whole processes
        out += ["", *end_to_end.table(whole)]
    groups: dict[tuple, dict[tuple[str, str], Any]] = {}
    for r in opts:  # several files for one model and resolution make one table
        key = (r["model"], r["resolution"], r["batch"], r["threads"])
        precision = r.get("mixed_precision", "no")
        groups.setdefault(key, {}).update({(name, precision): o for name, o in r["options"].items()})
    for (model, resolution, batch, threads), options in groups.items():
        out += [
            "",
            f"What each option buys ({model}, {resolution} px, batch {batch}, {threads} threads; "
            "speed-up > 1: faster with the option):",
            "",
            "| option | in the engine | without | with | speed-up | memory, note |",
            "|---|---|---|---|---|---|",
        ]
        for (name, precision), o in options.items():
            out.extend(_option_rows(name, o, precision))
    if infer:
        out += ["", *_inference_table(infer)]
    for k, r in results.items():
        if k.startswith("train_memory-"):  # bench/train_step.py --memory_only: what the copies cost
            out += ["", *_memory_table(r)]
    for k, r in results.items():
        if k.startswith("dreambooth-"):  # bench/dreambooth.py: DreamBooth-LoRA's step against diffusers'
            out += ["", *_dreambooth_table(r)]
    for k, r in results.items():
        if k.startswith("launchers-"):  # bench/launchers.py: Ray Train against mpirun and torchrun
            out += ["", *_launchers_table(r)]
    for k, r in results.items():
        if k.startswith("allreduce_backends-"):  # bench/allreduce.py --backends: oneCCL against gloo
            out += ["", *_backends_table(r)]
    for k, r in results.items():
        if k.startswith(("stress_launch", "stress_ccl")):  # bench/stress_*.py: jobs that end under load
            backend = " on ccl" if k.startswith("stress_ccl") else ""
            out += [
                "",
                f"Launch under load (`bench.{k}`: {r['runs']} two-process tiny jobs{backend}, mpirun and "
                f"torchrun alternating, {r['load']['cpu_processes']} busy processes and "
                f"{r['load']['memory_gb']:g} GB held beside them): {r['ok']} of {r['runs']} ended on their own, "
                f"{r['failures']} failures, {r['hangs']} hangs; wall time per run p50 {r['p50_seconds']:.1f} s, "
                f"p95 {r['p95_seconds']:.1f} s.",
            ]
    return "\n".join(out) + "\n"


def _backends_table(r: dict[str, Any]) -> list[str]:
    """One all-reduce's latency on each backend, and the same 2-process training step on each."""
    names = list(r["median_seconds"])
    lines = [
        f"All-reduce between {r['world_size']} processes ({r['threads_per_process']} thread each, this "
        f"machine's loopback; medians of {r['rounds']} rounds), µs:",
        "",
        "| bytes | " + " | ".join(names) + " | " + "/".join(names) + " |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for size in r["bytes"]:
        times = [r["median_seconds"][n][str(size)] * 1e6 for n in names]
        lines.append(
            f"| {size:,} | " + " | ".join(f"{t:,.0f}" for t in times) + f" | {times[0] / times[-1]:.1f}x |"
        )
    step = r.get("train_step")
    if step:
        per = step["median_seconds_per_step"]
        lines += [
            "",
            f"The same {step['world_size']}-process training step ({step['model']}, {step['resolution']} px, "
            f"medians of {len(step['runs_seconds_per_step'][names[0]])} runs): "
            + ", ".join(f"{n} {per[n]:.3f} s" for n in names)
            + ".",
        ]
    return lines


MEMORY_MODES = {
    "ours": "ours (convolutions and linear layers prepacked: the default)",
    "ours_convs": "ours, convolutions prepacked only",
    "ours_linears": "ours, linear layers prepacked only",
    "ours_unpacked": "ours, nothing prepacked",
    "reference": "reference",
}


def _memory_table(r: dict[str, Any]) -> list[str]:
    """Peak RSS of the engine with each kind of prepacked layer, and of the reference, each in a fresh process."""
    ref = r["modes"]["reference"]
    lines = [
        f"Training memory ({r['model']}, {r['resolution']} px, {_precision(r)}, batch {r['batch']}; each mode "
        f"the real run in a fresh process, {r['warmup']} + {r['steps']} steps; load average "
        f"{r['machine']['load_average'][0]:.1f} when it ended):",
        "",
        "| mode | training peak RSS | of the reference's | s/step in that process | reference's s/step over it |",
        "|---|---|---|---|---|",
    ]
    for name, label in MEMORY_MODES.items():
        if m := r["modes"].get(name):
            lines.append(
                f"| {label} | {_gib(m['training_peak_rss_mib'])} | "
                f"{m['training_peak_rss_mib'] / ref['training_peak_rss_mib']:.2f}x | "
                f"{m['child_seconds_per_step']:.2f} | "
                f"{ref['child_seconds_per_step'] / m['child_seconds_per_step']:.2f}x |"
            )
    return lines


def _dreambooth_table(r: dict[str, Any]) -> list[str]:
    """DreamBooth-LoRA with prior preservation: ours against diffusers' step written out."""
    lines = [
        f"DreamBooth-LoRA ({r['model']}, {r['resolution']} px, {_precision(r)}, {r['batch']} subject + "
        f"{r['batch']} class picture per step, LoRA rank {r['rank']}; medians of {r['steps']} steps):",
        "",
        "| mode | s/step (median, min) | images/s | VAE + text encoder per step | peak RSS |",
        "|---|---|---|---|---|",
    ]
    for name in ("ours", "reference"):
        m = r["modes"][name]
        lines.append(
            f"| {name} | {m['seconds_per_step']['median']:.2f} ({m['seconds_per_step']['min']:.2f}) | "
            f"{m['images_per_second']:.2f} | {m['inputs_seconds']:.3f} s | {_gib(m['peak_rss_mib'])} |"
        )
    lines.append(f"| **ours / reference** | **{r['speedup']:.2f}x faster** | | | {r['rss_ratio']:.2f} |")
    pictures = r.get("class_image_seconds")
    if isinstance(pictures, dict):  # prepacked against plain, each in a fresh process
        pictures = (
            f" One class picture (25 DPM-Solver++ steps): {pictures['prepacked']:.1f} s with the UNet's "
            f"convolutions prepacked, {pictures['plain']:.1f} s plain "
            f"({pictures['plain'] / pictures['prepacked']:.2f}x)."
        )
    elif pictures:
        pictures = f" One class picture (25 DPM-Solver++ steps): {pictures:.1f} s."
    lines += [
        "",
        f"All-reduced per step: the LoRA's {r['lora_parameters']:,} values ({r['allreduce_bytes_per_step']:,} "
        f"bytes) against {r['full_unet_allreduce_bytes_per_step']:,} for the whole UNet." + (pictures or ""),
    ]
    return lines


def _launchers_table(r: dict[str, Any]) -> list[str]:
    """The same run through each launcher: images/s while training, wall time, Ray's start-up apart."""
    lines = [
        f"Launchers ({r['model']}, {r['resolution']} px, {r['processes']} processes x "
        f"{r['threads_per_process']} thread, {r['steps']} steps; medians and ranges of the runs):",
        "",
        "| launcher | runs | images/s (median, range) | vs mpirun | wall time of the run, s "
        "| Ray start-up, s (ray.init; workers) |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in r["launchers"].items():
        lo, hi = v["images_per_second_range"]
        ray = (
            f"{v['ray_init_seconds_median']:.1f}; {v['workers_started_seconds_median']:.1f}"
            if "ray_init_seconds_median" in v
            else "-"
        )
        lines.append(
            f"| {name} | {v['ok']} of {v['runs']} | {v['images_per_second_median']:.1f} ({lo:.1f}-{hi:.1f}) | "
            f"{v['images_per_second_vs_mpirun']:.2f}x | {v['wall_seconds_median']:.1f} | {ray} |"
        )
    return lines


ONEDNN_ORDER = (
    "convolution",
    "deconvolution",
    "reorder_weights",
    "reorder_activations",
    "matmul",
    "inner_product",
)


def _onednn_table(steps: list[dict[str, Any]]) -> list[str]:
    """Seconds per oneDNN primitive kind in a step of each mode (train_step's verbose-log capture)."""
    found = {k for r in steps for m in r["modes"].values() for k in m["onednn_seconds"]}
    kinds = [k for k in ONEDNN_ORDER if k in found] + sorted(found - set(ONEDNN_ORDER))
    # results since the prepacked convolutions' input gradient became a transposed one have that kind
    deconvolution = (
        "`deconvolution` = the prepacked convolutions' input gradient; " if "deconvolution" in found else ""
    )
    title = (
        "Inside those phases, oneDNN's own log (seconds per step, medians of 3 steps; `reorder` = a "
        f"tensor laid out afresh for oneDNN; {deconvolution}`inner_product` = the engine's prepacked linear layers; "
        "PyTorch's own fp32 `Linear` layers run in MKL and are not in it):"
    )
    return _seconds_by_mode(steps, title, "onednn_seconds", kinds)


def _seconds_by_mode(steps: list[dict[str, Any]], title: str, field: str, columns: list[str]) -> list[str]:
    """A table of seconds, one row per result and mode, one column per key of ``modes[mode][field]``."""
    lines = [
        title,
        "",
        "| model | px | precision | mode | " + " | ".join(c.replace("_", " ") for c in columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for r in steps:
        for name in ("ours", "reference"):
            got = r["modes"][name][field]
            lines.append(
                f"| {r['model']} | {r['resolution']} | {_precision(r)} | {name} | "
                + " | ".join(f"{got.get(c, 0.0):.2f}" for c in columns)
                + " |"
            )
    return lines


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
                + ("same" if name == "pytorch_fp32" else f"{psnr:.1f} dB")
                + ")"
            )
        lines.append(f"| {VARIANT_LABELS[name]} | " + " | ".join(cells) + " |")
    return lines


PROCESS_NOTES = {
    "glibc_default": ("keep_freed_memory (glibc `mallopt`)", "yes"),
    "tcmalloc": ("tcmalloc via `LD_PRELOAD` instead of the engine's glibc setting", "no"),
    "jemalloc": ("jemalloc via `LD_PRELOAD` (+ `MALLOC_CONF`) instead of the engine's glibc setting", "no"),
    "thp": ("`THP_MEM_ALLOC_ENABLE=1` (huge pages) on top of the engine", "no"),
    "close_cores": ("`OMP_PROC_BIND=close OMP_PLACES=cores`", "no"),
    "gradient_checkpointing": ("gradient_checkpointing", "no (flag)"),
    "ipex": ("Intel Extension for PyTorch (`use_ipex`), against the same torch 2.8 without it", "no (flag)"),
    "workshop_torch": (
        "torch 2.13 (the workshop's environment) instead of torch 2.8, neither with IPEX",
        "yes",
    ),
}


def _option_rows(name: str, o: dict[str, Any], precision: str = "no") -> list[str]:
    if "on_s" in o:  # in-process A/B: steps interleaved in one process
        note = OPTION_NOTES.get(name, "")
        if name == "compile":
            note += f"; compile time {o['compile_s']:.0f} s, not counted"
        off, on = o["seconds"]["off"], o["seconds"]["on"]
        off_cell, on_cell = (_spread(r["median"], r["min"], r["max"], r["n"], "steps") for r in (off, on))
        used = "yes" if o["used_by_engine"] else "no"
        label = name + (
            " (bf16 runs)" if precision == "bf16" and name not in optimisations.NEEDS_BF16 else ""
        )
        return [
            f"| {label} | {used} | {off_cell} | {on_cell} | {o['speedup']:.2f}x | "
            f"{note}{_inside(off['min'], off['max'], on['min'], on['max'])} |"
        ]
    rows = []
    for key in o:  # process-level: fresh launches per variant
        if not key.endswith("_speedup"):
            continue
        variant = key[: -len("_speedup")]
        label, used = PROCESS_NOTES.get(variant, (variant, "no"))
        if precision == "bf16":
            label += " (bf16 runs)"
        without, with_ = "baseline", variant  # against the engine as it is
        if variant == "glibc_default":  # the engine's own setting, against glibc's defaults
            without, with_ = "glibc_default", "baseline"
        (a, lo_a, hi_a, n_a), (b, lo_b, hi_b, n_b) = (_launches(o, v) for v in (without, with_))
        rows.append(
            f"| {label} | {used} | {_spread(a, lo_a, hi_a, n_a, 'launches')} | "
            f"{_spread(b, lo_b, hi_b, n_b, 'launches')} | {a / b:.2f}x | training peak RSS "
            f"{_gib(o[f'{with_}_training_rss_mib'])} (without: {_gib(o[f'{without}_training_rss_mib'])})"
            f"{_inside(lo_a, hi_a, lo_b, hi_b)} |"
        )
    return rows


def _launches(o: dict[str, Any], variant: str) -> tuple[float, float, float, int]:
    """Median, fastest, slowest (seconds per step) and count of a process-level variant's launches."""
    runs = [r["seconds_per_step"] for r in o["seconds"][variant]]
    return o[f"{variant}_s"], min(runs), max(runs), len(runs)


def _spread(median: float, lo: float, hi: float, n: int, what: str) -> str:
    return f"{median:.2f} s ({lo:.2f}-{hi:.2f}, {n} {what})"


def _inside(lo_a: float, hi_a: float, lo_b: float, hi_b: float) -> str:
    """A note when two ranges of measurements overlap: the difference of their medians is not established."""
    return "; within the spread of the measurements" if lo_a <= hi_b and lo_b <= hi_a else ""


if __name__ == "__main__":
    main(parse_args())

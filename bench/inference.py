"""Seconds per image: PyTorch fp32 against OpenVINO dynamic, static, static int8 (and static bf16,
and int8 weights with bf16 compute, where the CPU has native bf16), and a UNet and VAE decoder
quantized to int8 (weights and activations, calibrated), side by side.

    python -m bench.inference --model tiny
    python -m bench.inference --model sd15-shape --resolution 512 --steps 20

One process, one prompt with a learned token (random vectors inserted the way a trained concept
is), the same steps, size and initial latents for every variant. ``--repeats`` rounds run the
variants in turn (alternating the order, so drift of the machine affects all alike), each loaded
fresh, alone in memory, and timed after one untimed 1-step warm-up call. Prints the median seconds per image, the speed-up over
PyTorch, PSNR against PyTorch, export times and model sizes; writes them as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench import common
from helpers import inference
from helpers.core import cpu

TOKEN = "<bench>"
INT8_BF16 = "openvino_static_int8_bf16"  # int8 weights, bf16 compute: only where bf16 is native
PROMPT = f"a photo of {TOKEN} on a beach"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny, sd15-shape (random weights), or a diffusers folder"
    )
    parser.add_argument(
        "--resolution", type=int, default=None, help="pixels (default: 128 tiny, 512 otherwise)"
    )
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per image")
    parser.add_argument("--batch", type=int, default=1, help="prompts per call (static batch)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds over the variants")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    parser.add_argument("--out", default=None, help="JSON results file (default bench/results/...)")
    args = parser.parse_args(argv)
    if args.resolution is None:  # tiny: 128 px, as 64 px hits the int8 static-shape bug (see inference.py)
        args.resolution = 128 if args.model == "tiny" else 512
    return args


def _timed(fn, *args, **kwargs) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Export, load the variants, time them round-robin; return (and write) the results."""
    threads = cpu.set_threads(args.threads)
    model = common.model_dir(args.model)
    width = json.loads((model / "text_encoder" / "config.json").read_text())["hidden_size"]
    prompts, size = [PROMPT] * args.batch, dict(height=args.resolution, width=args.resolution)
    with tempfile.TemporaryDirectory(prefix="bench-inference-") as work:
        embeds = Path(work) / "learned_embeds.safetensors"
        # a stand-in concept, about the scale of real token embeddings (values ~0.01)
        save_file(
            {TOKEN: torch.randn(1, width, generator=torch.Generator().manual_seed(0)) * 0.01}, str(embeds)
        )
        fp32, fp32_s = _timed(inference.export_openvino, model, Path(work) / "fp32", learned_embeds=embeds)
        int8, int8_s = _timed(inference.export_openvino, fp32, Path(work) / "int8", weight_format="int8")
        quant, quant_s = _timed(
            inference.export_openvino,
            fp32,
            Path(work) / "quant_int8",
            placeholder_token=TOKEN,
            quant_mode="int8",
            resolution=args.resolution,
        )
        calibration = inference.export_info(quant)["calibration"]
        static = lambda path, **kw: inference.reshape_static(  # noqa: E731
            inference.load_openvino_pipeline(path, compile=False, **kw), args.batch, **size
        )
        loaders = {
            "pytorch_fp32": lambda: inference.load_pytorch_pipeline(model, learned_embeds=embeds),
            "openvino_dynamic": lambda: inference.load_openvino_pipeline(fp32),
            "openvino_static": lambda: static(fp32),
            "openvino_static_int8": lambda: static(int8),
        }
        if inference.openvino_default_precision() == "bf16":
            loaders[inference.BF16_VARIANT] = lambda: static(fp32, precision="bf16")
            loaders[INT8_BF16] = lambda: static(int8, precision="bf16")
        # int8 where the UNet and the VAE decoder were quantized,
        # the CPU's default precision (bf16 or f32) everywhere else
        loaders[inference.QUANT_VARIANT] = lambda: static(quant, precision=None)
        exports = {"fp32": fp32, "int8": int8, "quant_int8": quant}
        megabytes = {name: inference.disk_megabytes(path) for name, path in exports.items()}
        names, seconds, images = list(loaders), {name: [] for name in loaders}, {}
        for round_ in range(args.repeats):
            for name in names if round_ % 2 == 0 else names[::-1]:
                # One pipeline in memory at a time: with all five loaded, PyTorch ran 1.4x slower
                # than alone (SD v1.5 shape) and the OpenVINO speed-ups looked better than they are.
                pipe = loaders[name]()
                run = inference.generate(pipe, prompts, num_inference_steps=args.steps, warmup=True, **size)
                seconds[name].append(run.seconds_per_image)
                images[name] = run.images
                del pipe, run
                gc.collect()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "model": args.model,
        "resolution": args.resolution,
        "steps": args.steps,
        "batch": args.batch,
        "repeats": args.repeats,
        "torch_threads": threads,
        "machine": common.machine(),
        "seconds_per_image": median,
        "seconds_per_image_all": seconds,
        "speedup_vs_pytorch": {name: median["pytorch_fp32"] / value for name, value in median.items()},
        "psnr_vs_pytorch_db": {
            name: inference.image_psnr(images["pytorch_fp32"], images[name]) for name in names
        },
        "export_seconds": {"fp32": fp32_s, "int8_from_fp32": int8_s, "quant_int8_from_fp32": quant_s},
        "calibration": calibration,
        "model_megabytes": megabytes,
    }
    common.write_json(
        common.results_path(f"inference-{args.model}-{args.resolution}px.json", args.out), result
    )
    return result


def report(result: dict[str, Any]) -> str:
    """The results as the lines this benchmark prints."""
    lines = [
        f"{result['model']} {result['resolution']} px, {result['steps']} steps, batch {result['batch']}, "
        f"median of {result['repeats']} (torch threads {result['torch_threads']}, "
        f"load {result['machine']['load_average'][0]:.1f})",
        f"{'variant':<28}{'s/image':>10}{'x PyTorch':>11}{'PSNR dB':>9}",
    ]
    for name, value in result["seconds_per_image"].items():
        speedup, psnr = result["speedup_vs_pytorch"][name], result["psnr_vs_pytorch_db"][name]
        lines.append(f"{name:<28}{value:>10.4g}{speedup:>10.2f}x{psnr:>9.1f}")
    exports, sizes = result["export_seconds"], result["model_megabytes"]
    lines.append(
        f"export: fp32 {exports['fp32']:.1f} s, int8 (from fp32) {exports['int8_from_fp32']:.1f} s, "
        f"UNet and VAE decoder quantized to int8 (from fp32, calibration included) {exports['quant_int8_from_fp32']:.1f} s"
    )
    lines.append(
        f"size: fp32 {sizes['fp32']:.1f} MB, int8 {sizes['int8']:.1f} MB, quant_int8 {sizes['quant_int8']:.1f} MB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(report(main(parse_args())) + "\n")

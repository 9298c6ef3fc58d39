"""DreamBooth-LoRA: seconds per step and peak memory, ours against diffusers' way, side by side.

python -m bench.dreambooth --model sd15-shape --resolution 256 --steps 3   # ~10 min on 2 cores
python -m bench.dreambooth --model tiny                                   # seconds; checks the code

Both modes train the same LoRA layers (rank ``--rank``) of the same UNet, with prior preservation:
each step denoises ``--batch`` subject pictures and as many class pictures in one UNet call.

* **ours**: :func:`helpers.dreambooth.training.training_step`, the trainer's own step: latents
  sampled from the cache (the VAE encoded each picture once and was freed), the two prompts
  encoded once (frozen text encoder), only the LoRA matrices in AdamW.
* **reference**: the step of diffusers' ``examples/dreambooth/train_dreambooth_lora.py``, written
  here: the VAE encodes the batch's pixels and the text encoder the prompts in every step, then the
  UNet, the two halves' losses, backward, gradient clipping and AdamW over the LoRA matrices. For an
  SDXL model (``--model sdxl-shape``), the step of ``train_dreambooth_lora_sdxl.py``: its VAE stays
  in fp32 whatever the precision ("to avoid NaN losses") and encodes the pixels in every step, while
  the two prompts are encoded once (its text encoders are frozen and every picture has the
  instance prompt), so only the VAE and the UNet's own work differ from ours.

Speed: both run in one process, interleaved step by step (A B, B A, ...), after warm-up; medians.
Peak memory: each mode in a fresh child process (ours: the real ``training.train``), the peak RSS
of the whole process and since the weights were loaded. The bundled subject pictures also serve
as the class pictures (upscaled to the resolution): the speed and memory of a step depend on the
shapes, not on what the pictures show, and no class picture has to be generated first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from bench import common
from helpers.core import cpu
from helpers.dreambooth import class_images, training
from helpers.dreambooth.config import DreamBoothConfig
from helpers.dreambooth.data import ImageViews
from helpers.training.engine import events, prepack

CLASS_PROMPT, INSTANCE_PROMPT = "a photo of a toy", "a photo of sks toy"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dreambooth", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="sd15-shape", help="sd15-shape, sdxl-shape, tiny, tiny-xl or a diffusers folder"
    )
    parser.add_argument("--resolution", type=int, default=None, help="default 256 (64 for tiny models)")
    parser.add_argument(
        "--batch", type=int, default=1, help="subject pictures per step (as many class pictures)"
    )
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    parser.add_argument("--threads", type=int, default=None, help="default: physical cores")
    parser.add_argument("--mixed_precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--no_memory", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument("--class_image", action="store_true",
                        help="also time drawing one class picture (25 DPM-Solver++ steps, guidance 7.5)")  # fmt: skip
    parser.add_argument(
        "--out",
        default=None,
        help="result JSON (default: dreambooth-<model>-<px>px[-bf16].json in this machine's bench/results folder)",
    )
    parser.add_argument("--child", choices=("ours", "reference"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.resolution is None:
        args.resolution = 64 if args.model.startswith("tiny") else 256
    return args


def make_config(args: argparse.Namespace, work: Path, steps: int):
    """The run both modes train: the bundled pictures as subject and class, prior preservation, LoRA."""
    pictures = common.concept_dir(args.resolution, work / "pictures")
    return DreamBoothConfig(
        pretrained_model_name_or_path=str(common.model_dir(args.model)), instance_data_dir=str(pictures),
        instance_prompt=INSTANCE_PROMPT, with_prior_preservation=True, class_data_dir=str(pictures),
        class_prompt=CLASS_PROMPT, num_class_images=len(list(pictures.iterdir())), resolution=args.resolution,
        train_batch_size=args.batch, rank=args.rank, max_train_steps=steps, checkpointing_steps=10**6,
        mixed_precision=args.mixed_precision, output_dir=str(work / "out"), seed=common.SEED,
    )  # fmt: skip


def batches(run, n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` batches of epoch 0, collated as the trainer's loader gives them."""
    order = list(run.sampler)
    items = [run.pairs[order[(i * run.config.train_batch_size + k) % len(order)]]
             for i in range(n) for k in range(run.config.train_batch_size)]  # fmt: skip
    size = run.config.train_batch_size
    return [
        {key: torch.tensor([it[key] for it in items[i * size : (i + 1) * size]]) for key in items[0]}
        for i in range(n)
    ]


class ReferenceStep:
    """diffusers' DreamBooth-LoRA step on the run's modules: the VAE in every step, and the text
    encoder too for SD v1 (SDXL's script encodes its two prompts once: the module docstring)."""

    def __init__(self, run):
        self.run = run
        config = run.config
        self.sdxl = run.family.name == "sdxl"
        self.weight_dtype = cpu.compute_dtype(run.precision.mixed_precision)
        vae_dtype = torch.float32 if self.sdxl else self.weight_dtype
        self.vae = AutoencoderKL.from_pretrained(run.model_dir, subfolder="vae", torch_dtype=vae_dtype).eval()
        self.vae.requires_grad_(False)
        files = class_images.image_files(config.instance_data_dir)
        self.views = ImageViews(files, config.resolution)  # subject pictures, then class pictures
        self.num_instance = len(files)
        self.optimizer = torch.optim.AdamW(
            run.params, lr=config.learning_rate, weight_decay=config.adam_weight_decay
        )

    def __call__(self, batch: dict[str, torch.Tensor], marks: dict[str, float]) -> None:
        with prepack.plain(self.run.unet):  # diffusers' script runs PyTorch's own convolutions
            self._step(batch, marks)

    def _step(self, batch: dict[str, torch.Tensor], marks: dict[str, float]) -> None:
        run, config = self.run, self.run.config
        marks["start"] = time.perf_counter()
        views = torch.cat([batch["instance_view"], batch["class_view"]])
        pixels = torch.stack([self.views.view_pixels(int(v) % self.views.num_views) for v in views])
        # outside autocast, as in both scripts: SDXL's VAE computes in fp32, SD v1's in the weights' dtype
        latents = (
            self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.sample() * self.vae.config.scaling_factor
        )
        latents = latents.to(self.weight_dtype)
        with run.accelerator.autocast():
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, run.noise_scheduler.config.num_train_timesteps, (latents.shape[0],))
            noisy = run.noise_scheduler.add_noise(latents, noise, timesteps)
            pred = run.unet(noisy, timesteps, **self._unet_kwargs(len(batch["index"]), views)).sample
        pred, pred_prior = torch.chunk(pred, 2, dim=0)
        target, target_prior = torch.chunk(noise, 2, dim=0)
        loss = F.mse_loss(pred.float(), target.float()) + config.prior_loss_weight * F.mse_loss(
            pred_prior.float(), target_prior.float()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.params, config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        marks["end"] = time.perf_counter()

    def _unet_kwargs(self, n: int, views: torch.Tensor) -> dict:
        """The UNet's conditioning for ``n`` subject and ``n`` class pictures, subject rows first."""
        run = self.run
        if self.sdxl:  # its script encodes the two prompts once, as ours does
            return run.family.unet_kwargs(
                training.conditioning(run, n), [run.view_sizes[int(v)] for v in views]
            )
        ids = torch.cat([run.prompt_ids[k][0].expand(n, -1) for k in ("instance", "class")])
        return run.family.unet_kwargs(run.family.encode_prompt(run.text_encoders, [ids]))  # in every step


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; return (and write) the results."""
    threads = cpu.set_threads(args.threads)
    if args.child:
        return _child(args)
    # First, as the trainer draws them: after the training steps, this process drew the plain
    # pictures 1.2x faster than a fresh one (41 against 50 s, Xeon with AMX), and the packed ones not
    class_image = class_image_seconds(args) if args.class_image else None
    results, lora_numel, unet_numel = _timed(args)  # the models are freed before the children start
    memory = (
        {} if args.no_memory else {name: _run_child(args, name, threads) for name in ("ours", "reference")}
    )
    report = _report(args, threads, results, memory, lora_numel, unet_numel)
    if class_image:
        report["class_image_seconds"] = class_image
    suffix = "-bf16" if args.mixed_precision == "bf16" else ""
    out = common.results_path(
        f"dreambooth-{args.model}-{args.resolution}px{suffix}.json", args.out, report["machine"]
    )
    common.write_json(out, report)
    print(format_report(report))
    print(f"wrote {out}")
    return report


def _timed(args: argparse.Namespace) -> tuple[dict[str, list[dict[str, float]]], int, int]:
    """Both modes on one run's modules, interleaved; also the LoRA's and the UNet's sizes."""
    with tempfile.TemporaryDirectory(prefix="bench-dreambooth-") as work:
        run = training.setup_run(make_config(args, Path(work), args.warmup + args.steps))
        reference = ReferenceStep(run)
        feed = batches(run, args.warmup + args.steps)
        marks: dict[str, float] = {}

        def unet_starts(module, inputs) -> None:  # returns None: the UNet's inputs stay as they are
            marks.setdefault("unet", time.perf_counter())

        def ours(step: int) -> dict[str, float]:
            marks.clear()
            marks["start"] = time.perf_counter()
            training.training_step(run, [feed[step]], epoch=0, step=step + 1)
            marks["end"] = time.perf_counter()
            return _phases(marks)

        def ref(step: int) -> dict[str, float]:
            marks.clear()
            reference(feed[step], marks)
            return _phases(marks)

        hook = run.unet.register_forward_pre_hook(unet_starts)
        with cpu.keep_freed_memory():  # as the trainer's loop does, for both modes
            results = common.run_interleaved({"ours": ours, "reference": ref}, args.steps, warmup=args.warmup)
        hook.remove()
        lora_numel = sum(p.numel() for p in run.params)
        unet_numel = sum(p.numel() for n, p in run.unet.named_parameters() if ".lora_" not in n)
        run.accelerator.end_training()
    return results, lora_numel, unet_numel


def class_image_seconds(args: argparse.Namespace) -> dict[str, float]:
    """Seconds to draw one class picture at the resolution, as the trainer draws them (its UNet's
    convolutions prepacked, forward only) and with PyTorch's plain convolutions: after a warm-up
    picture, two of each in the order packed, plain, plain, packed; medians."""
    with tempfile.TemporaryDirectory(prefix="bench-dreambooth-class-") as work:
        config = make_config(args, Path(work), 1).replace(class_data_dir=str(Path(work) / "class"))
        pipe = class_images.class_pipeline(
            common.model_dir(args.model), cpu.compute_dtype(args.mixed_precision), prepack_convs=True
        )
        class_images.draw_class_images(config.replace(class_num_inference_steps=1), pipe, [0])  # warm-up
        seconds: dict[str, list[float]] = {"prepacked": [], "plain": []}
        for k, mode in enumerate(("prepacked", "plain", "plain", "prepacked"), start=1):
            start = time.perf_counter()
            with prepack.plain(pipe.unet) if mode == "plain" else contextlib.nullcontext():
                class_images.draw_class_images(config, pipe, [k])
            seconds[mode].append(time.perf_counter() - start)
        return {mode: statistics.median(v) for mode, v in seconds.items()}


def _phases(marks: dict[str, float]) -> dict[str, float]:
    """``inputs``: until the UNet is called (VAE and text encoder for the reference); ``total``."""
    return {"inputs": marks["unet"] - marks["start"], "total": marks["end"] - marks["start"]}


def _report(args, threads, results, memory, lora_numel: int, unet_numel: int) -> dict[str, Any]:
    modes = {}
    for name, steps in results.items():
        seconds = common.summarize([s["total"] for s in steps])
        modes[name] = {
            "seconds_per_step": seconds,
            "images_per_second": 2 * args.batch / seconds["median"],  # subject + class pictures
            "inputs_seconds": common.summarize([s["inputs"] for s in steps])["median"],
            **memory.get(name, {}),
        }
    report = {
        "benchmark": "dreambooth",
        "model": args.model,
        "resolution": args.resolution,
        "batch": args.batch,
        "rank": args.rank,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": threads,
        "mixed_precision": args.mixed_precision,
        "machine": common.machine(),
        "modes": modes,
        "speedup": modes["reference"]["seconds_per_step"]["median"]
        / modes["ours"]["seconds_per_step"]["median"],
        "lora_parameters": lora_numel,
        "allreduce_bytes_per_step": lora_numel * 4,
        "full_unet_allreduce_bytes_per_step": unet_numel * 4,
    }
    if memory:
        report.update(common.rss_ratios(modes["ours"], modes["reference"]))
    return report


def format_report(r: dict[str, Any]) -> str:
    """A plain-text table of a result."""
    ours, ref = r["modes"]["ours"], r["modes"]["reference"]
    lines = [
        f"DreamBooth-LoRA, {r['model']} {r['resolution']} px, {r['batch']} + {r['batch']} pictures per step, "
        f"rank {r['rank']}, {r['threads']} threads, {r['mixed_precision']}, {r['steps']} steps/mode after "
        f"{r['warmup']} warm-up (load {r['machine']['load_average'][0]:.2f})",
        f"{'':32}{'ours':>12}{'reference':>12}",
    ]

    def row(label: str, a: float, b: float) -> None:
        lines.append(common.side_by_side(label, a, b, 32))

    row("s/step (median)", ours["seconds_per_step"]["median"], ref["seconds_per_step"]["median"])
    row("s/step (min)", ours["seconds_per_step"]["min"], ref["seconds_per_step"]["min"])
    row("  of which VAE + text encoder", ours["inputs_seconds"], ref["inputs_seconds"])
    row("images/s", ours["images_per_second"], ref["images_per_second"])
    lines += common.memory_lines(r, 32)
    lines.append(f"speed-up (reference / ours): {r['speedup']:.2f}x")
    lines += common.rss_ratio_line(r)
    if "class_image_seconds" in r:
        c = r["class_image_seconds"]
        lines.append(
            f"one class picture (25 steps, guidance 7.5): {c['prepacked']:.1f} s with prepacked convolutions, "
            f"{c['plain']:.1f} s plain ({c['plain'] / c['prepacked']:.2f}x)"
        )
    lines.append(
        f"LoRA: {r['lora_parameters']:,} parameters, {r['allreduce_bytes_per_step']:,} bytes all-reduced per step "
        f"(the whole UNet: {r['full_unet_allreduce_bytes_per_step']:,})"
    )
    return "\n".join(lines)


# --- peak memory, one fresh process per mode --------------------------------------------------


def _run_child(args: argparse.Namespace, mode: str, threads: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.dreambooth", "--child", mode, "--model", args.model]
    cmd += ["--resolution", str(args.resolution), "--batch", str(args.batch), "--rank", str(args.rank)]
    cmd += ["--threads", str(threads), "--steps", str(min(args.steps, 2)), "--warmup", str(args.warmup)]
    cmd += ["--mixed_precision", args.mixed_precision]
    proc = common.run(cmd, cwd=common.ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(args: argparse.Namespace) -> dict[str, float]:
    """Peak RSS of one mode in a fresh process: ours is the real ``training.train``.

    The peak-RSS mark is reset once the weights are loaded (for ours, in the trainer's setup just
    before the latents are cached, which counts as training).
    """
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="bench-dreambooth-child-") as work:
        config = make_config(args, Path(work), steps)
        if args.child == "ours":

            def reset_once_loaded(event: events.Event) -> None:
                if isinstance(event, events.WeightsLoaded):
                    common.reset_peak_rss()

            with events.listening(reset_once_loaded):  # the trainer publishes it once the weights are in
                result = training.train(config)
            seconds = [h["seconds"] for h in result.history][args.warmup :]
        else:
            run = training.setup_run(config)
            reference = ReferenceStep(run)
            common.reset_peak_rss()
            seconds = []
            with cpu.keep_freed_memory():
                for batch in batches(run, steps):
                    marks: dict[str, float] = {"unet": 0.0}
                    reference(batch, marks)
                    seconds.append(marks["end"] - marks["start"])
            seconds = seconds[args.warmup :]
    out = {
        "child_seconds_per_step": common.summarize(seconds)["median"],
        "peak_rss_mib": common.peak_rss_mib(),
        "training_peak_rss_mib": common.peak_rss_since_reset_mib(),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(parse_args())

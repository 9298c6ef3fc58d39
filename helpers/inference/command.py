"""``python -m helpers.inference {export,generate,compare} ...``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from helpers.core.errors import ArgumentParser, run_cli
from helpers.core.outputs import LEARNED_EMBEDS, LEARNED_EMBEDS_2
from helpers.inference.common import QUANT_MODES, WEIGHT_FORMATS, InferenceInputError, is_openvino_folder
from helpers.inference.concept import read_learned_embeds
from helpers.inference.generation import generate, save_images
from helpers.inference.openvino import (
    CALIBRATION_SAMPLES,
    export_info,
    export_openvino,
    load_openvino_pipeline,
    reshape_static,
)
from helpers.inference.parity import compare
from helpers.inference.pytorch import load_learned_embeds, load_pytorch_pipeline
from helpers.training.config import MAX_RESOLUTION
from helpers.training.models import HubUnavailableError

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``python -m helpers.inference {export,generate,compare} ...``."""
    parser = ArgumentParser(
        prog="python -m helpers.inference",
        description="Export, generate and compare the learned concept with PyTorch and OpenVINO.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def concept(p: argparse.ArgumentParser, model_help: str) -> None:
        p.add_argument("--model", required=True, help=model_help)
        p.add_argument(
            "--learned_embeds",
            default=None,
            help=f"{LEARNED_EMBEDS} to load on top of --model (SDXL: {LEARNED_EMBEDS_2} beside it too)",
        )
        p.add_argument(
            "--placeholder_token", default=None, help="token to load the embeddings under / to check"
        )

    def sampling(p: argparse.ArgumentParser) -> None:
        p.add_argument("--num_inference_steps", type=int, default=20, help="denoising steps")
        p.add_argument("--guidance_scale", type=float, default=7.5, help="classifier-free guidance strength")
        p.add_argument("--seed", type=int, default=0, help="seed of the initial latents")
        p.add_argument("--resolution", type=int, default=None, help="height and width (default: the model's)")

    p = sub.add_parser("export", help="export to OpenVINO IR (fp32 or int8 weights, or int8 arithmetic)")
    concept(p, "fine-tuned folder, base model ('tiny', Hub id, folder) or an OpenVINO export")
    p.add_argument("--output_dir", required=True, help="folder for the OpenVINO pipeline")
    p.add_argument("--weight_format", choices=WEIGHT_FORMATS, default="fp32", help="int8: compressed weights")
    p.add_argument(
        "--quant_mode",
        choices=QUANT_MODES,
        default=None,
        help="int8: the UNet and the VAE decoder compute in int8 (calibrated)",
    )
    p.add_argument(
        "--num_samples",
        type=int,
        default=CALIBRATION_SAMPLES,
        help="--quant_mode: UNet calls to calibrate on",
    )
    p.add_argument("--resolution", type=int, default=None, help="--quant_mode: the size you will generate at")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")

    p = sub.add_parser("generate", help="generate images and report seconds per image")
    concept(p, "an OpenVINO export (runs OpenVINO) or a PyTorch model folder/'tiny'/Hub id")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeat for a batch)")
    p.add_argument("--num_images_per_prompt", type=int, default=1, help="images per prompt")
    p.add_argument("--static", action="store_true", help="OpenVINO: reshape to static shapes first")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after one warm-up (median reported)")
    p.add_argument("--output_dir", required=True, help="folder for the PNG images")
    sampling(p)

    p = sub.add_parser("compare", help="parity of an OpenVINO export against PyTorch")
    concept(p, "the PyTorch source the OpenVINO folder was exported from")
    p.add_argument("--openvino_dir", required=True, help="the exported OpenVINO folder")
    p.add_argument("--prompt", required=True, help="prompt, with the placeholder token")
    sampling(p)
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no model: run before anything is loaded, so bad input fails in a second.

    Raises:
        FileNotFoundError, InferenceInputError: a count below 1, a resolution that is not a
            multiple of 8 or above :data:`~helpers.training.config.MAX_RESOLUTION`, a guidance scale that is not a number; the embeddings file is missing,
            empty, corrupt or not finite; ``--output_dir`` is a file (or lies under one);
            ``--openvino_dir`` is not an export.
    """
    for name in ("num_inference_steps", "num_images_per_prompt", "repeats", "num_samples"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise InferenceInputError(f"--{name} {value}: must be at least 1")
    resolution = getattr(args, "resolution", None)
    if resolution is not None and (resolution < 8 or resolution % 8):
        raise InferenceInputError(
            f"--resolution {resolution}: must be a positive multiple of 8 (the VAE halves it three times), "
            f"e.g. 512, or 64 for 'toyworld'; leave it out for the model's own size"
        )
    if resolution is not None and resolution > MAX_RESOLUTION:  # 100000 tried to allocate 40 GB
        raise InferenceInputError(
            f"--resolution {resolution}: at most {MAX_RESOLUTION} (Stable Diffusion models are trained at 512 to "
            f"1024 px); leave it out for the model's own size"
        )
    guidance = getattr(args, "guidance_scale", None)
    if guidance is not None and not (math.isfinite(guidance) and guidance >= 0):
        raise InferenceInputError(
            f"--guidance_scale {guidance}: must be a finite number of 0 or more, e.g. 7.5"
        )
    if args.learned_embeds is not None:
        read_learned_embeds(args.learned_embeds)
    out = getattr(args, "output_dir", None)
    nearest = None if out is None else next((p for p in (Path(out), *Path(out).parents) if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        where = "is a file" if nearest == Path(out) else f"lies under {nearest}, which is a file"
        raise InferenceInputError(
            f"--output_dir {out!r} {where}. Fix: pass a folder (it is created if missing)"
        )
    ov_dir = getattr(args, "openvino_dir", None)
    if ov_dir is not None and not is_openvino_folder(Path(ov_dir)):
        raise InferenceInputError(
            f"--openvino_dir {ov_dir!r} is not an exported OpenVINO pipeline (no unet/openvino_model.xml). "
            f"Fix: export first with `python -m helpers.inference export`."
        )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run one command of :func:`parse_args`; returns its results (also logged)."""
    check_args(args)
    if args.command == "export":
        out = export_openvino(
            args.model,
            args.output_dir,
            args.weight_format,
            args.learned_embeds,
            args.placeholder_token,
            overwrite=args.overwrite,
            quant_mode=args.quant_mode,
            num_samples=args.num_samples,
            resolution=args.resolution,
        )
        return export_info(out)
    size = dict(height=args.resolution, width=args.resolution)
    sampling = dict(
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale, seed=args.seed
    )
    if args.command == "generate":
        if is_openvino_folder(Path(args.model)):
            pipe = load_openvino_pipeline(args.model)
            if args.learned_embeds:
                load_learned_embeds(pipe, args.learned_embeds, args.placeholder_token)
            if args.static:
                h = args.resolution or pipe.unet.config.sample_size * pipe.vae_scale_factor
                reshape_static(pipe, len(args.prompt), h, h, args.num_images_per_prompt)
        else:
            pipe = load_pytorch_pipeline(args.model, args.learned_embeds, args.placeholder_token)
        run = generate(
            pipe,
            args.prompt,
            num_images_per_prompt=args.num_images_per_prompt,
            repeats=args.repeats,
            **sampling,
            **size,
        )
        paths = save_images(run.images, args.output_dir, "image")
        result = {"seconds_per_image": run.seconds_per_image, "images": [str(p) for p in paths]}
    else:
        pt = load_pytorch_pipeline(args.model, args.learned_embeds, args.placeholder_token)
        result = asdict(
            compare(pt, load_openvino_pipeline(args.openvino_dir), args.prompt, **sampling, **size)
        )
    logger.info("%s: %s", args.command, result)
    return result


def cli(argv: list[str] | None = None) -> int:
    """Entry point: run a command, print its JSON result; input problems exit 2 with one ``error:`` line."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run(args: argparse.Namespace) -> None:
        sys.stdout.write(json.dumps(main(args), indent=2) + "\n")

    return run_cli(run, parse_args, argv, also=(HubUnavailableError,))

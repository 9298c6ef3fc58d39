"""``python -m helpers.toyworld build|score|render-sample``: build the model, score pictures of Pip, draw Pip.

::

    python -m helpers.toyworld build [--family sd1|sdxl] --output_dir DIR [--seed 0] [--unet_steps N ...]
    python -m helpers.toyworld score --model toyworld|toyworld-xl --prompt "a photo of <pip>" \\
        [--learned_embeds PATH] [--num_images 8] [--seed 0] [--output_dir DIR]
    python -m helpers.toyworld render-sample DEST   # the bundled pictures of Pip (helpers/assets/sample_concept)

``score`` prints one JSON line (``concept_score``, per-image probabilities, judged backgrounds,
image paths). Input problems are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import fields

from helpers.core.errors import ArgumentParser, InputError, run_cli
from helpers.toyworld import build, evaluate, world


def config_from_args(args: argparse.Namespace) -> build.BuildConfig | build.XLBuildConfig:
    """The configuration of ``--family`` from the flags given (the family's defaults for the others).

    Raises:
        InputError: a flag of the other family only (``--vae_steps`` with ``--family sdxl``).
    """
    cls = build.CONFIGS[args.family]
    own = _settings(cls)
    for name in _flags():
        if getattr(args, name) is not None and name not in own:
            other = next(family for family, c in build.CONFIGS.items() if name in _settings(c))
            raise InputError(
                f"--{name}: the {args.family} build has no such setting (only the {other} build has). "
                f"Fix: leave it out, or build with --family {other}."
            )
    return cls(**{name: getattr(args, name) for name in own if getattr(args, name) is not None})


def _settings(cls: type) -> set[str]:
    """The setting names of one family's build configuration."""
    return {f.name for f in fields(cls)}


def _flags() -> dict[str, type]:
    """Every build setting of any family, by flag name, with its type."""
    return {f.name: type(f.default) for cls in build.CONFIGS.values() for f in fields(cls)}


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The build's flags: ``--family``, then one per setting of :class:`build.BuildConfig` and :class:`build.XLBuildConfig`."""
    parser.add_argument("--family", choices=tuple(build.CONFIGS), default="sd1",
                        help="sd1: toyworld (StableDiffusionPipeline); sdxl: toyworld-xl, grafted from --base_model")  # fmt: skip
    for name, kind in _flags().items():
        defaults = ", ".join(
            f"{family} {getattr(cls, name)}"
            for family, cls in build.CONFIGS.items()
            if name in _settings(cls)
        )
        parser.add_argument(f"--{name}", type=kind, default=None, help=f"default: {defaults}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m helpers.toyworld", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build", help="train the toy-world pipeline and judge, or graft its SDXL twin (resumable)"
    )
    add_build_arguments(b)
    s = sub.add_parser("score", help="generate pictures and print Pip's mean probability as JSON")
    s.add_argument(
        "--model", default="toyworld", help='"toyworld", "toyworld-xl" or a folder built by `build`'
    )
    s.add_argument("--prompt", required=True, help='e.g. "a photo of <pip>"')
    s.add_argument("--learned_embeds", help="learned_embeds.safetensors (or the training output_dir)")
    s.add_argument("--num_images", type=int, default=8)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--output_dir", default="toyworld_scores", help="where the pictures go")
    s.add_argument("--guidance_scale", type=float, default=evaluate.GUIDANCE_SCALE)
    s.add_argument("--num_inference_steps", type=int, default=evaluate.NUM_INFERENCE_STEPS)
    r = sub.add_parser("render-sample", help="draw the bundled sample concept (Pip) into DEST")
    r.add_argument("dest", help="the folder to write the pictures into")
    return parser.parse_args(argv)


def check_score_args(args: argparse.Namespace) -> None:
    """Refuse counts that cannot work before any model loads (``--num_images 0`` was an IndexError).

    Raises:
        InputError: one line naming the flag and the fix.
    """
    for name in ("num_images", "num_inference_steps"):
        value = getattr(args, name)
        if value < 1:
            raise InputError(f"--{name} {value}: must be at least 1 (leave the flag out for the default)")
    if args.guidance_scale != args.guidance_scale or args.guidance_scale < 0:  # NaN or negative
        raise InputError(f"--guidance_scale {args.guidance_scale}: must be a number of 0 or more")


def main(args: argparse.Namespace) -> int:
    """Build (prints the model folder) or score (prints one JSON line)."""
    if args.command == "build":
        print(build.build(config_from_args(args), sys.argv[2:]))
        return 0
    if args.command == "render-sample":
        print(*world.render_pip_pictures(args.dest), sep="\n")
        return 0
    check_score_args(args)
    result = evaluate.score(args.model, args.prompt, args.learned_embeds, args.num_images, args.seed,
                            args.output_dir, args.guidance_scale, args.num_inference_steps)  # fmt: skip
    print(json.dumps(result))
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(cli())

"""Generate pictures with a toy-world pipeline and let the judge score them.

:func:`score` is what ``python -m helpers.toyworld score`` prints: the mean probability of Pip
(``concept_score``) over images generated from fixed seeds, with the judged backgrounds.
:func:`evaluate` measures the generator itself for the build's manifest: does "a photo of a
big red car on the grass" give a red car on grass?
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from helpers.toyworld import world
from helpers.toyworld.judge import HEADS, Judge, judge_images, load_judge

NUM_INFERENCE_STEPS = 20
GUIDANCE_SCALE = 4.0


def sampling_pipeline(pipe):
    """The same pipeline with DPM-Solver++ (good pictures in 20 steps), progress bar off."""
    from diffusers import DPMSolverMultistepScheduler

    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate_images(pipe, prompts: Sequence[str], seed: int = 0, guidance_scale: float = GUIDANCE_SCALE,
                    num_inference_steps: int = NUM_INFERENCE_STEPS) -> list:  # fmt: skip
    """One picture per prompt; picture ``i`` starts from the noise of ``(seed, i)`` whatever the batch."""
    from helpers.inference import generate

    return generate(sampling_pipeline(pipe), list(prompts), num_inference_steps=num_inference_steps,
                    guidance_scale=guidance_scale, seed=seed, warmup=False).images  # fmt: skip


def concept_scores(judge: Judge, images: Sequence) -> dict[str, Any]:
    """Pip's mean probability and each background's share of the judged pictures."""
    probs = judge_images(judge, images)
    pip = probs["object"][:, HEADS["object"].index(world.PIP)]
    backgrounds = [HEADS["background"][i] for i in probs["background"].argmax(1)]
    return {
        "concept_score": round(float(pip.mean()), 4),
        "pip_probabilities": [round(float(p), 4) for p in pip],
        "backgrounds": backgrounds,
        "objects": [HEADS["object"][i] for i in probs["object"].argmax(1)],
    }


def score(
    model: str | os.PathLike,
    prompt: str,
    learned_embeds: str | os.PathLike | None = None,
    num_images: int = 8,
    seed: int = 0,
    output_dir: str | os.PathLike | None = None,
    guidance_scale: float = GUIDANCE_SCALE,
    num_inference_steps: int = NUM_INFERENCE_STEPS,
) -> dict[str, Any]:
    """Generate ``num_images`` pictures of ``prompt`` and judge them.

    Args:
        model: ``"toyworld"`` or a folder built by ``python -m helpers.toyworld build`` (it holds the judge).
        prompt: e.g. ``"a photo of <pip>"``; must contain the placeholder of ``learned_embeds``.
        learned_embeds: a ``learned_embeds.safetensors`` (or training output folder) to load first.
        num_images: pictures, one per seed ``(seed, i)``.
        seed: the seed of the first picture's noise.
        output_dir: where the pictures are written as PNG (none written if None).

    Returns:
        ``concept_score`` (mean probability of Pip), per-picture probabilities, judged backgrounds
        and objects, and the written image paths.
    """
    from helpers.inference import load_pytorch_pipeline
    from helpers.models import resolve_model

    model_dir = resolve_model(model)
    judge = load_judge(model_dir)
    pipe = load_pytorch_pipeline(model_dir, learned_embeds)
    images = generate_images(pipe, [prompt] * num_images, seed, guidance_scale, num_inference_steps)
    result = {"prompt": prompt, **concept_scores(judge, images), "images": []}
    if output_dir is not None:
        from helpers.inference import save_images

        result["images"] = [str(p) for p in save_images(images, output_dir, "image")]
    return result


def evaluate(
    model_dir: str | os.PathLike, judge: Judge | None = None, num_images: int = 48, seed: int = 0
) -> dict[str, Any]:
    """How faithfully the generator draws what a caption asks, as the judge sees it.

    Returns:
        Per head, the fraction of ``num_images`` pictures (one random full caption each) whose
        judged class is the one asked for; and Pip's mean probability for "a photo of a toy"
        (Pip is not in the world, so this should be low) and for "a photo of a teal duck" (the
        words that describe Pip: what the generator does with a combination it never saw).
    """
    from helpers.inference import load_pytorch_pipeline

    judge = judge or load_judge(model_dir)
    pipe = load_pytorch_pipeline(Path(model_dir))
    rng = random.Random(f"toyworld-eval:{seed}")
    scenes = [world.random_scene(rng) for _ in range(num_images)]
    prompts = [world.full_caption(s) for s in scenes]
    probs = judge_images(judge, generate_images(pipe, prompts, seed))
    asked = Judge.labels(scenes)
    fidelity = {k: round(float(np.mean(probs[k].argmax(1) == asked[k].numpy())), 4) for k in HEADS}
    toy = concept_scores(judge, generate_images(pipe, ["a photo of a toy"] * 8, seed))["concept_score"]
    teal_duck = concept_scores(judge, generate_images(pipe, ["a photo of a teal duck"] * 8, seed))[
        "concept_score"
    ]
    return {"prompt_fidelity": fidelity, "pip_score_a_toy": toy, "pip_score_a_teal_duck": teal_duck}

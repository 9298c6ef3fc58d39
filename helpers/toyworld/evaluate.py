"""Generate pictures with a toy-world pipeline and let the judge score them.

:func:`score` is what ``python -m helpers.toyworld score`` prints: the mean probability of Pip
(``concept_score``) over images generated from fixed seeds, with the judged backgrounds.
:func:`evaluate` measures the generator itself for the build's manifest: does "a photo of a
big red car on the grass" give a red car on grass?
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch

from helpers.core.errors import InputError
from helpers.core.files import write_file_atomic
from helpers.inference import (
    generate,
    learned_embeds_files,
    load_pytorch_pipeline,
    read_learned_embeds,
    save_images,
)
from helpers.toyworld import world
from helpers.toyworld.judge import HEADS, JUDGE_DIR, Judge, judge_images, load_judge
from helpers.training import models

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


@dataclass
class ConceptReport:
    """Pictures of one prompt from fixed seeds, and what the judge says of them (if the model has one)."""

    prompt: str
    images: list = field(repr=False)
    concept_score: float | None = None  # mean probability of Pip
    judged: dict[str, Any] = field(default_factory=dict)  # per-picture probabilities, backgrounds, objects

    @property
    def label(self) -> str:
        """A short row label for a picture grid: the prompt and, if judged, Pip's score."""
        score = "" if self.concept_score is None else f"\nPip score {self.concept_score:.2f}"
        return f"{self.prompt}{score}"


def pip_score(model: str | os.PathLike, images: Sequence) -> float | None:
    """The judge's mean probability of Pip over ``images``, or None if ``model`` has no judge.

    ``model`` is the base model the pictures' concept was trained on (``"toyworld"``); pictures
    from any backend (PyTorch, OpenVINO) can be scored.
    """
    if os.fspath(model) not in models.OFFLINE_MODELS and not Path(model).is_dir():
        return None  # a Hub model: no judge, and no need to download it to learn that
    model_dir = models.resolve_model(model)
    if not (model_dir / JUDGE_DIR).is_dir():
        return None
    return concept_scores(load_judge(model_dir), images)["concept_score"]


def check_prompt(prompt: str, learned_embeds: str | os.PathLike | None) -> None:
    """The prompt must use the placeholder that the embeddings define (and only with embeddings).

    Raises:
        InputError: naming the prompt and the fix, before any model loads.
    """
    if learned_embeds is None:
        if "<" in prompt and ">" in prompt:
            raise InputError(
                f"prompt {prompt!r} has a placeholder but no learned embeddings define it. "
                f"Fix: pass --learned_embeds PATH (the training output's learned_embeds.safetensors)."
            )
        return
    token, _ = read_learned_embeds(learned_embeds)
    if token not in prompt:
        raise InputError(
            f"prompt {prompt!r} does not contain {token!r}, the placeholder that {os.fspath(learned_embeds)!r} "
            f'defines. Fix: use it in the prompt, e.g. --prompt "a photo of {token}".'
        )


def concept_report(
    model: str | os.PathLike,
    prompt: str,
    learned_embeds: str | os.PathLike | None = None,
    num_images: int = 8,
    seed: int = 0,
    guidance_scale: float = GUIDANCE_SCALE,
    num_inference_steps: int = NUM_INFERENCE_STEPS,
) -> ConceptReport:
    """Generate ``num_images`` pictures of ``prompt`` (picture ``i`` from seed ``(seed, i)``) and judge them.

    Args:
        model: a Stable Diffusion folder, ``"toyworld"`` (which has a judge) or any other model
            :func:`helpers.training.models.resolve_model` knows (pictures only, no score).
        prompt: e.g. ``"a photo of <pip>"``; must contain the placeholder of ``learned_embeds``.
        learned_embeds: a ``learned_embeds.safetensors`` (or training output folder) to load first.
    """
    check_prompt(prompt, learned_embeds)
    model_dir = models.resolve_model(model)
    pipe = load_pytorch_pipeline(model_dir, learned_embeds)
    images = generate_images(pipe, [prompt] * num_images, seed, guidance_scale, num_inference_steps)
    if not (model_dir / JUDGE_DIR).is_dir():
        return ConceptReport(prompt, images)
    judged = concept_scores(load_judge(model_dir), images)
    return ConceptReport(prompt, images, judged.pop("concept_score"), judged)


def before_training_report(
    model: str | os.PathLike,
    prompt: str,
    placeholder_token: str,
    initializer_token: str,
    num_images: int = 8,
    seed: int = 0,
    **kwargs: Any,
) -> ConceptReport:
    """:func:`concept_report` of the placeholder as a run starts it: a copy of its initializer word."""
    with tempfile.TemporaryDirectory() as tmp:
        path = initial_embeds(model, placeholder_token, initializer_token, Path(tmp) / "initial.safetensors")
        return concept_report(model, prompt, path, num_images, seed, **kwargs)


def initial_embeds(
    model: str | os.PathLike, placeholder_token: str, initializer_token: str, path: str | os.PathLike
) -> Path:
    """Write the embedding a run starts from (the initializer word's row, under the placeholder).

    Scoring it shows what the model draws for the new word *before* training. For an SDXL model
    (``"toyworld-xl"``) each text encoder's row is written, the second encoder's beside ``path``
    under the name inference looks for (``initial.safetensors`` -> ``initial_2.safetensors``).

    Returns:
        ``path``, the first encoder's file.
    """
    # imported here: these lines (transformers' CLIP, diffusers and accelerate) cost 6.0 s CPU on
    # top of helpers.toyworld (measured with time.process_time), which every importer of the package
    # would pay, `python -m helpers.toyworld render-sample|--help` included
    from helpers.training.families import family_of, load_text_encoders, load_tokenizers
    from helpers.training.textual_inversion import check_tokens

    model_dir = models.resolve_model(model)
    family = family_of(model_dir)
    files = learned_embeds_files(path, family, f"model {os.fspath(model)!r}")
    tokenizers, encoders = load_tokenizers(model_dir, family), load_text_encoders(model_dir, family)
    for file, tokenizer, encoder in zip(files, tokenizers, encoders, strict=True):
        init_id = check_tokens(tokenizer, placeholder_token, initializer_token, 1)
        row = encoder.get_input_embeddings().weight[init_id][None].detach().clone().contiguous()
        write_file_atomic(
            file, lambda fh, row=row: fh.write(safetensors.torch.save({placeholder_token: row}))
        )
    return Path(path)


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
    """What ``python -m helpers.toyworld score`` prints: :func:`concept_report` of a judged model.

    Returns:
        ``concept_score`` (mean probability of Pip), per-picture probabilities, judged backgrounds
        and objects, and the paths of the pictures written into ``output_dir`` (if given).

    Raises:
        FileNotFoundError / InputError: a missing model or embeddings file, a model without a
            judge, a prompt without the embeddings' placeholder (before any picture is made).
    """
    check_prompt(prompt, learned_embeds)
    load_judge(models.resolve_model(model))  # fails fast on a model without a judge
    report = concept_report(
        model, prompt, learned_embeds, num_images, seed, guidance_scale, num_inference_steps
    )
    paths = []
    if output_dir is not None:
        paths = [str(p) for p in save_images(report.images, output_dir, "image")]
    return {"prompt": prompt, "concept_score": report.concept_score, **report.judged, "images": paths}


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

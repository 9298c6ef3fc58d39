"""Pictures of a DreamBooth-LoRA run, the toy world's judge, and the comparison with Textual Inversion.

:func:`lora_report` draws pictures of a prompt from fixed seeds with (or without) the LoRA, loaded
the stock way, and lets the toy world's judge score them (:class:`helpers.toyworld.ConceptReport`).
:func:`class_share` reads from such a report whether the class still looks like the class: the
share of "a photo of a toy" pictures the judge does *not* take for the subject. :func:`compare_methods`
puts Textual Inversion and DreamBooth-LoRA side by side: time, bytes, concept score, class share.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers.core.outputs import HISTORY, LEARNED_EMBEDS, SUMMARY
from helpers.dreambooth.lora import LORA_WEIGHTS, lora_file, stock_lora_pipeline
from helpers.inference import load_pytorch_pipeline
from helpers.toyworld import ConceptReport
from helpers.toyworld.evaluate import concept_scores, generate_images
from helpers.toyworld.judge import JUDGE_DIR, load_judge
from helpers.toyworld.world import PIP
from helpers.training import models


def lora_report(
    model: str | os.PathLike,
    prompt: str,
    lora: str | os.PathLike | None = None,
    num_images: int = 8,
    seed: int = 0,
) -> ConceptReport:
    """``num_images`` pictures of ``prompt`` (picture ``i`` from seed ``(seed, i)``), judged if the model has a judge.

    Args:
        model: the base model (``"toyworld"`` has a judge).
        prompt: e.g. ``"a photo of sks toy"``.
        lora: a DreamBooth-LoRA output_dir (or its LoRA file), loaded with diffusers'
            ``load_lora_weights``; None: the base model alone (pictures *before* training).
    """
    if lora is not None:
        lora_file(lora)  # fails fast, before the model loads
    model_dir = models.resolve_model(model)
    pipe = stock_lora_pipeline(model_dir, lora) if lora is not None else load_pytorch_pipeline(model_dir)
    images = generate_images(pipe, [prompt] * num_images, seed)
    if not (model_dir / JUDGE_DIR).is_dir():
        return ConceptReport(prompt, images)
    judged = concept_scores(load_judge(model_dir), images)
    return ConceptReport(prompt, images, judged.pop("concept_score"), judged)


def class_share(report: ConceptReport) -> float | None:
    """The share of the report's pictures the judge does not take for the subject (Pip), or None unjudged.

    For the class prompt ("a photo of a toy") this should stay near 1: the class still looks like
    the class. A model that has forgotten the class draws the subject for it instead.
    """
    objects = report.judged.get("objects")
    if not objects:
        return None
    return round(sum(o != PIP for o in objects) / len(objects), 4)


def _training_seconds(output_dir: Path) -> float:
    return round(sum(h["seconds"] for h in json.loads((output_dir / HISTORY).read_text())), 2)


def method_row(
    method: str,
    output_dir: str | os.PathLike,
    result_file: str | os.PathLike,
    concept: ConceptReport,
    class_report: ConceptReport,
    extra_seconds: float = 0.0,
) -> dict[str, Any]:
    """One row of the comparison table, from a finished run's files and its two reports."""
    output_dir = Path(output_dir)
    summary = json.loads((output_dir / SUMMARY).read_text())
    return {
        "method": method,
        "steps": summary["steps"],
        "training seconds": _training_seconds(output_dir),
        "class images seconds": round(extra_seconds, 2),
        "result": Path(result_file).name,
        "result bytes": Path(result_file).stat().st_size,
        "concept score": concept.concept_score,
        "class pictures not the subject": class_share(class_report),
    }


def compare_methods(
    ti_output_dir: str | os.PathLike,
    ti: ConceptReport,
    db_output_dir: str | os.PathLike,
    db: ConceptReport,
    class_before: ConceptReport,
    class_after: ConceptReport,
) -> list[dict[str, Any]]:
    """Textual Inversion and DreamBooth-LoRA on the same subject, the same seeds and the same judge.

    The reports are the ones the notebook has already drawn (nothing is drawn twice):

    Args:
        ti_output_dir, ti: a textual-inversion run (notebook 02) and the report of its prompt, e.g.
            :func:`helpers.toyworld.concept_report` of ``"a photo of <pip>"``.
        db_output_dir, db: a DreamBooth-LoRA run and the :func:`lora_report` of its instance prompt.
        class_before, class_after: :func:`lora_report` of the class prompt (e.g. ``"a photo of a
            toy"``) without and with the LoRA. Textual Inversion leaves the model as it was, so its
            class pictures are the base model's (``class_before``).

    Returns:
        Two rows (:func:`method_row`).
    """
    ti_dir, db_dir = Path(ti_output_dir), Path(db_output_dir)
    made = json.loads((db_dir / SUMMARY).read_text()).get("class_images") or {}
    return [
        method_row("Textual Inversion", ti_dir, ti_dir / LEARNED_EMBEDS, ti, class_before),
        method_row(
            "DreamBooth-LoRA", db_dir, db_dir / LORA_WEIGHTS, db, class_after, made.get("seconds", 0.0)
        ),
    ]

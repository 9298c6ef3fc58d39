"""Where a learned concept comes from and whether it fits a model: checked before any loading work."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.core.outputs import (
    LEARNED_EMBEDS,
    MODEL_INDEX,
    SUMMARY,
    is_pipeline_folder,
    placeholder_tokens_for,
)
from helpers.core.sources import classify_source
from helpers.inference.common import ROUTES, InferenceInputError
from helpers.training.models import OFFLINE_MODELS, TINY, TOYWORLD, resolve_model


@dataclass(frozen=True)
class ConceptSource:
    """Where a learned concept comes from.

    Attributes:
        model: a diffusers folder (the fine-tuned pipeline, or the base model), ``"tiny"`` or a Hub id.
        learned_embeds: embeddings to load on top of ``model``, or None when ``model`` already has them.
        placeholder_token: the token the concept was learned as.
        route: ``"pipeline"`` or ``"embeddings"``.
    """

    model: str
    learned_embeds: str | None
    placeholder_token: str
    route: str


def first_finished_run(*output_dirs: str | os.PathLike) -> Path:
    """The first of ``output_dirs`` that holds a finished training run (its ``run_summary.json``,
    written last), e.g. notebook 04's cluster run, else notebook 02's.

    Raises:
        FileNotFoundError: none of them holds a finished run; the message names each.
    """
    for out in map(Path, output_dirs):
        if (out / SUMMARY).is_file():
            return out
    raise FileNotFoundError(
        f"no finished training run in {', '.join(map(str, output_dirs))} (none holds {SUMMARY}). "
        "Fix: run notebook 02 or 04 first, or point trained_output_dir at a finished run's output_dir."
    )


def find_concept(
    trained_output_dir: str | os.PathLike, base_model: str, placeholder_token: str, route: str = "auto"
) -> ConceptSource:
    """Locate what training wrote: the full fine-tuned pipeline, or base model + learned embeddings.

    Args:
        trained_output_dir: the training ``output_dir``.
        base_model: the model the concept was trained on (used by the ``"embeddings"`` route).
        placeholder_token: the token the concept was learned as.
        route: ``"pipeline"`` (``output_dir`` itself, a pipeline folder when trained with
            ``--save_as_full_pipeline``), ``"embeddings"`` (base model +
            ``learned_embeds.safetensors``) or ``"auto"`` (the pipeline if it was saved).

    Raises:
        FileNotFoundError: the output folder or the file the route needs is missing.
    """
    if route not in ROUTES:
        raise InferenceInputError(f"route={route!r}: must be one of {', '.join(ROUTES)}")
    out = Path(trained_output_dir)
    if not out.is_dir():
        raise FileNotFoundError(
            f"trained_output_dir {str(out)!r} does not exist. Fix: train first (notebook 02 or "
            f"`python -m helpers.train --output_dir {out}`), or point trained_output_dir at its output_dir."
        )
    embeds = out / LEARNED_EMBEDS
    if route == "auto":
        route = "pipeline" if is_pipeline_folder(out) else "embeddings"
    if route == "pipeline":
        if not is_pipeline_folder(out):
            raise FileNotFoundError(
                f"{out} holds no diffusers pipeline ({MODEL_INDEX}). Fix: train with "
                f"--save_as_full_pipeline, or use route='embeddings' (base model + {LEARNED_EMBEDS})."
            )
        return ConceptSource(str(out), None, placeholder_token, route)
    if not embeds.is_file():
        raise FileNotFoundError(
            f"{embeds} does not exist. Fix: let training finish; it writes {LEARNED_EMBEDS}."
        )
    return ConceptSource(base_model, str(embeds), placeholder_token, route)


def read_learned_embeds(path: str | os.PathLike) -> tuple[str, torch.Tensor]:
    """Read ``{token: FloatTensor[num_vectors, hidden]}`` from a file or a training output folder.

    Returns:
        The token stored in the file and its vectors, always 2-D ``[num_vectors, hidden]``.

    Raises:
        FileNotFoundError: no such file (or no ``learned_embeds.safetensors`` in the folder).
        InferenceInputError: not a single-token safetensors embedding file (empty, corrupt, other
            tensors), or its vectors are not finite (a diverged run).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = learned_embeds_file(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"learned_embeds {str(path)!r} does not exist. Fix: pass the {LEARNED_EMBEDS} that training "
            f"wrote (or its output_dir)."
        )
    if path.suffix != ".safetensors":
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: expected a .safetensors file like {LEARNED_EMBEDS}"
        )
    fix = f"Fix: pass the {LEARNED_EMBEDS} of a finished run, or train again."
    if path.stat().st_size == 0:
        raise InferenceInputError(f"learned_embeds {str(path)!r} is empty (0 bytes). {fix}")
    try:
        state = load_file(str(path))
    except SafetensorError as err:
        raise InferenceInputError(
            f"learned_embeds {str(path)!r} is not a readable safetensors file ({err}). {fix}"
        ) from None
    if len(state) != 1:
        raise InferenceInputError(
            f"learned_embeds {str(path)!r} holds {len(state)} tensors ({', '.join(state)}); expected one "
            f"{{placeholder_token: [num_vectors, hidden]}}. "
            f"Fix: pass the {LEARNED_EMBEDS} that training wrote."
        )
    token, vectors = next(iter(state.items()))
    vectors = vectors[None] if vectors.ndim == 1 else vectors
    if vectors.ndim != 2 or vectors.shape[0] == 0 or not vectors.is_floating_point():
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: tensor {token!r} of shape {tuple(vectors.shape)} and type "
            f"{vectors.dtype} is not [num_vectors, hidden] floating-point vectors. {fix}"
        )
    bad = int((~torch.isfinite(vectors)).sum())
    if bad:
        raise InferenceInputError(
            f"learned_embeds {str(path)!r}: {bad} of the {vectors.numel()} numbers of {token!r} are NaN or "
            f"infinite (training diverged), so every picture would be blank. Fix: train again with a lower "
            f"learning_rate."
        )
    return token, vectors.float()


def check_embeds(
    tokenizer, hidden_size: int, learned_embeds, placeholder_token: str | None, where: str
) -> list[str]:
    """Check embeddings fit a text encoder (width) and a tokenizer (new tokens); return the tokens to add.

    Raises:
        FileNotFoundError, InferenceInputError: with the fix in the message.
    """
    file_token, vectors = read_learned_embeds(learned_embeds)
    if vectors.shape[1] != hidden_size:
        raise InferenceInputError(
            f"learned_embeds {str(learned_embeds)!r} has vectors of width {vectors.shape[1]}, but the text "
            f"encoder of {where} has width {hidden_size}. Fix: load them into the model they were trained on."
        )
    tokens = placeholder_tokens_for(placeholder_token or file_token, vectors.shape[0])
    taken = [t for t in tokens if t in tokenizer.get_vocab()]
    if taken:
        raise InferenceInputError(
            f"learned_embeds {str(learned_embeds)!r}: token(s) {', '.join(taken)} already in the vocabulary "
            f"of {where}. Fix: if {where} is already the fine-tuned pipeline, pass no learned_embeds; "
            f"otherwise load them under a new name with placeholder_token='<new-name>'."
        )
    return tokens


def learned_embeds_file(path: str | os.PathLike) -> Path:
    """``path`` itself, or the ``learned_embeds.safetensors`` in it when it is a training output folder."""
    path = Path(path)
    return path / LEARNED_EMBEDS if path.is_dir() else path


def _local_model(model: str | os.PathLike) -> Path:
    name = os.fspath(model)
    if name not in OFFLINE_MODELS and classify_source(name) not in ("folder", "hub_id"):
        raise FileNotFoundError(
            f"model folder {name!r} does not exist. Fix: pass an existing diffusers folder (e.g. the "
            f"training output_dir with --save_as_full_pipeline), an exported OpenVINO folder, a Hub id, "
            f"'{TOYWORLD}' or '{TINY}'."
        )
    return resolve_model(name)


def check_concept(
    model: str | os.PathLike,
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
) -> Path:
    """Check a model (and embeddings for it) before any loading or export work.

    Reads only the tokenizer and the text-encoder config.

    Args:
        model: ``"tiny"``, a Hub id, a diffusers folder or an exported OpenVINO folder.
        learned_embeds: embeddings to load on top of ``model``: their width must match the text
            encoder and their tokens must be new to the tokenizer.
        placeholder_token: without ``learned_embeds``, a token that ``model`` must already know.

    Returns:
        The local folder of ``model``.

    Raises:
        FileNotFoundError, InferenceInputError, HubUnavailableError: with the fix in the message.
    """
    from transformers import CLIPTokenizer

    path = _local_model(model)
    tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
    hidden_size = json.loads((path / "text_encoder" / "config.json").read_text())["hidden_size"]
    if learned_embeds is not None:
        check_embeds(tokenizer, hidden_size, learned_embeds, placeholder_token, f"model {os.fspath(model)!r}")
    elif placeholder_token is not None and placeholder_token not in tokenizer.get_vocab():
        raise InferenceInputError(
            f"placeholder_token {placeholder_token!r} is not in the tokenizer of model {os.fspath(model)!r}, "
            f"so it does not hold the learned concept. "
            f"Fix: pass the fine-tuned folder (the output_dir of a run with --save_as_full_pipeline), or "
            f"the base model with learned_embeds=output_dir/{LEARNED_EMBEDS}."
        )
    return path

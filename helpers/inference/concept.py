"""Where a learned concept comes from and whether it fits a model: checked before any loading work."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from helpers.core.outputs import (
    LEARNED_EMBEDS,
    LEARNED_EMBEDS_2,
    MODEL_INDEX,
    SUMMARY,
    is_pipeline_folder,
    placeholder_tokens_for,
)
from helpers.core.sources import classify_source
from helpers.inference.common import ROUTES, InferenceInputError, encoder_pairs, hidden_size, pipe_family
from helpers.training.families import FAMILIES, Family, family_of
from helpers.training.models import OFFLINE_MODELS, TINY, TINY_XL, TOYWORLD, resolve_model


@dataclass(frozen=True)
class ConceptSource:
    """Where a learned concept comes from.

    Attributes:
        model: a diffusers folder (the fine-tuned pipeline, or the base model), ``"tiny"`` or a Hub id.
        learned_embeds: embeddings to load on top of ``model``, or None when ``model`` already has them.
        placeholder_token: the token the concept was learned as.
        route: ``"pipeline"`` or ``"embeddings"``.
        learned_embeds_2: an SDXL concept's second text encoder's embeddings, beside
            ``learned_embeds`` (the loaders find it there); None for SD v1 and the pipeline route.
    """

    model: str
    learned_embeds: str | None
    placeholder_token: str
    route: str
    learned_embeds_2: str | None = None


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
            ``learned_embeds.safetensors``, and ``learned_embeds_2.safetensors`` for SDXL) or
            ``"auto"`` (the pipeline if it was saved).

    Raises:
        FileNotFoundError: the output folder or the file the route needs is missing.
        InferenceInputError: the embeddings route on a base model of the other family: an SDXL
            base without ``learned_embeds_2.safetensors`` beside the first file (an SD v1 concept),
            or an SD v1 base with it (an SDXL concept). Checked here when ``base_model`` is local
            (a folder, ``"tiny"``, ``"tiny-xl"``, ``"toyworld"``); for a Hub id the loaders check it
            (:func:`check_concept`), still before any model loads.
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
    second = out / LEARNED_EMBEDS_2
    if base_model in OFFLINE_MODELS or classify_source(base_model) == "folder":
        learned_embeds_files(embeds, family_of(resolve_model(base_model)), f"base model {base_model!r}")
    return ConceptSource(
        base_model, str(embeds), placeholder_token, route, str(second) if second.is_file() else None
    )


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
    """Check one embeddings file fits a text encoder (width) and a tokenizer (new tokens); return the tokens to add.

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


def _beside(first: Path, family: Family, index: int) -> Path:
    """The ``index``-th encoder's file beside the first encoder's, named as diffusers' SDXL script names it.

    ``learned_embeds.safetensors`` -> ``learned_embeds_2.safetensors`` and a checkpoint's
    ``learned_embeds-steps-N.safetensors`` -> ``learned_embeds_2-steps-N.safetensors``; any other
    name gets the same tag after its stem (``cat.safetensors`` -> ``cat_2.safetensors``).
    """
    stem = Path(family.learned_embeds_files[0]).stem
    tag = Path(family.learned_embeds_files[index]).stem[len(stem) :]  # "_2"
    if first.name.startswith(stem):
        return first.with_name(stem + tag + first.name[len(stem) :])
    return first.with_name(first.stem + tag + first.suffix)


def learned_embeds_files(path: str | os.PathLike, family: Family, where: str) -> list[Path]:
    """The embeddings file of each text encoder of ``family``, checked against the family.

    Args:
        path: the first encoder's file (``learned_embeds.safetensors``, a checkpoint's, a renamed
            one), or the training output folder holding it; an SDXL concept's second file lies
            beside it (:func:`_beside`).
        family: the family of the model the embeddings go into.
        where: the model, as the error messages name it.

    Returns:
        One file per text encoder, in the family's order (only the first is checked to exist:
        :func:`read_learned_embeds` reads each).

    Raises:
        InferenceInputError: an SDXL model and no second file beside the first (an SD v1 concept,
            or a copy that left it behind), or an SD v1 model and a second file beside the first (an
            SDXL concept).
    """
    first = learned_embeds_file(path)
    files = [first] + [_beside(first, family, i) for i in range(1, len(family.learned_embeds_files))]
    missing = [f for f in files[1:] if not f.is_file()]
    if missing and first.is_file():
        raise InferenceInputError(
            f"learned_embeds {str(first)!r}: {where} is Stable Diffusion XL, which needs the second text "
            f"encoder's embeddings too, and {str(missing[0])!r} is not beside it (an SD v1 concept, or "
            f"a copy without it). Fix: copy {missing[0].name} from the SDXL training run's output_dir, "
            f"or load an SD v1 concept into the SD v1 model it was trained on."
        )
    extra = _beside(first, FAMILIES["sdxl"], 1)
    if len(files) == 1 and extra.is_file():
        raise InferenceInputError(
            f"learned_embeds {str(first)!r}: {extra.name} beside it makes it a Stable Diffusion XL concept "
            f"(one file per text encoder), but {where} is Stable Diffusion v1 (one text encoder). "
            f"Fix: load it into the SDXL model it was trained on."
        )
    return files


def _local_model(model: str | os.PathLike) -> Path:
    name = os.fspath(model)
    if name not in OFFLINE_MODELS and classify_source(name) not in ("folder", "hub_id"):
        raise FileNotFoundError(
            f"model folder {name!r} does not exist. Fix: pass an existing diffusers folder (e.g. the "
            f"training output_dir with --save_as_full_pipeline), an exported OpenVINO folder, a Hub id, "
            f"'{TOYWORLD}', '{TINY}' or '{TINY_XL}'."
        )
    return resolve_model(name)


def check_concept(
    model: str | os.PathLike,
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
) -> Path:
    """Check a model (and embeddings for it) before any loading or export work.

    Reads only ``model_index.json`` (the family), the tokenizers and the text encoders' configs.

    Args:
        model: ``"tiny"``, ``"tiny-xl"``, a Hub id, a diffusers folder or an exported OpenVINO folder,
            of a supported family (SD v1/v2 or SDXL).
        learned_embeds: embeddings to load on top of ``model`` (for SDXL the first encoder's file,
            the second's beside it: :func:`learned_embeds_files`): their width must match each text
            encoder and their tokens must be new to each tokenizer.
        placeholder_token: without ``learned_embeds``, a token that ``model`` must already know (in
            every tokenizer).

    Returns:
        The local folder of ``model``.

    Raises:
        FileNotFoundError, InferenceInputError, HubUnavailableError: with the fix in the message.
    """
    from transformers import CLIPTokenizer

    path = _local_model(model)
    family = family_of(path)
    where = f"model {os.fspath(model)!r}"
    tokenizers = [CLIPTokenizer.from_pretrained(path / sub) for sub in family.tokenizers]
    if learned_embeds is not None:
        widths = [
            json.loads((path / sub / "config.json").read_text())["hidden_size"]
            for sub in family.text_encoders
        ]
        check_family_embeds(family, tokenizers, widths, learned_embeds, placeholder_token, where)
        return path
    for tokenizer, sub in zip(tokenizers, family.tokenizers, strict=True):
        if placeholder_token is not None and placeholder_token not in tokenizer.get_vocab():
            which = "" if sub == "tokenizer" else f"{sub} "
            raise InferenceInputError(
                f"placeholder_token {placeholder_token!r} is not in the {which}tokenizer of {where}, so it does "
                f"not hold the learned concept. Fix: pass the fine-tuned folder (the output_dir of a run with "
                f"--save_as_full_pipeline), or the base model with learned_embeds=output_dir/{LEARNED_EMBEDS}."
            )
    return path


def check_pipe_embeds(
    pipe: Any, learned_embeds: str | os.PathLike, placeholder_token: str | None
) -> list[tuple[tuple[Path, list[str]], tuple[Any, Any]]]:
    """:func:`check_family_embeds` for a loaded pipeline (PyTorch or OpenVINO): each encoder's file
    and tokens, paired with its ``(tokenizer, text_encoder)``, before anything is inserted."""
    pairs = encoder_pairs(pipe)
    checked = check_family_embeds(
        pipe_family(pipe),
        [tok for tok, _ in pairs],
        [hidden_size(enc) for _, enc in pairs],
        learned_embeds,
        placeholder_token,
        "this pipeline",
    )
    return list(zip(checked, pairs, strict=True))


def check_family_embeds(
    family: Family,
    tokenizers: list,
    widths: list[int],
    learned_embeds: str | os.PathLike,
    placeholder_token: str | None,
    where: str,
) -> list[tuple[Path, list[str]]]:
    """Check a concept's files against every text encoder of a model of ``family``.

    Args:
        tokenizers, widths: each text encoder's tokenizer and width, in the family's order.
        learned_embeds: the first encoder's file or the output folder (:func:`learned_embeds_files`).

    Returns:
        For each encoder: its file and the tokens it adds (the same in every encoder).

    Raises:
        FileNotFoundError, InferenceInputError: a file is missing, unreadable, of the wrong width, of
            another family, its tokens are taken, or the files disagree on the token or its vectors.
    """
    files = learned_embeds_files(learned_embeds, family, where)
    checked = []
    for file, tokenizer, width in zip(files, tokenizers, widths, strict=True):
        checked.append((file, check_embeds(tokenizer, width, file, placeholder_token, where)))
    if len({tuple(tokens) for _, tokens in checked}) > 1:
        raise InferenceInputError(
            f"learned_embeds {str(files[0])!r} and {str(files[1])!r} hold different concepts "
            f"({' and '.join(', '.join(tokens) for _, tokens in checked)}): one training run writes the same "
            f"token with the same number of vectors into both. Fix: pass the two files of one run."
        )
    return checked

"""Textual Inversion's placeholder rows in every text encoder of a family, and the files they are saved to.

SD v1 has one text encoder, SDXL two (:mod:`helpers.training.families`). As diffusers'
``textual_inversion_sdxl.py`` does, the placeholder tokens are added to *each* tokenizer, their
rows to *each* encoder, each initialised from the initializer token's row of that encoder, and
all of them train. Each encoder's rows are a
:class:`~helpers.training.engine.rows.LearnedEmbeddings` routed in by an
:class:`~helpers.training.engine.rows.EmbeddingHook` (:mod:`helpers.training.engine.rows`: the
frozen matrices get no gradient), always held in fp32 whatever the encoder's dtype (diffusers'
SDXL script holds the second encoder's in the mixed-precision dtype). A run writes one file per
encoder in diffusers' layout, ``{placeholder_token: FloatTensor[num_vectors, width]}``:
``learned_embeds.safetensors`` (``text_encoder``) and, for SDXL, ``learned_embeds_2.safetensors``
(``text_encoder_2``), which stock ``load_textual_inversion`` reads, the second with
``text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from helpers.training.engine.rows import add_placeholder_tokens, check_tokens
from helpers.training.engine.saving import save_learned_embeds
from helpers.training.families import Family


def add_placeholder_rows(
    tokenizers: Sequence,
    text_encoders: Sequence[torch.nn.Module],
    placeholder_token: str,
    initializer_token: str,
    num_vectors: int = 1,
) -> list[list[int]]:
    """Add the placeholder tokens to every tokenizer and their rows (initialised) to every encoder.

    Every tokenizer is checked before anything is added (:func:`~helpers.training.engine.rows.check_tokens`),
    so a bad token leaves all of them unchanged. That the vectors fit in the run's prompt templates
    is checked before the model loads (the method's ``check_inputs``).

    Args:
        tokenizers, text_encoders: one pair per encoder, in the family's order.

    Returns:
        Each encoder's new token ids.

    Raises:
        TrainingInputError: a token is not new or the initializer is not one token, in any of the
            tokenizers.
    """
    for tokenizer in tokenizers:
        check_tokens(tokenizer, placeholder_token, initializer_token, num_vectors)
    return [
        add_placeholder_tokens(tokenizer, encoder, placeholder_token, initializer_token, num_vectors)
        for tokenizer, encoder in zip(tokenizers, text_encoders, strict=True)
    ]


def save_encoder_embeds(
    output_dir: str | os.PathLike, family: Family, placeholder_token: str, vectors: Sequence[torch.Tensor]
) -> list[Path]:
    """Write each encoder's vectors to the family's file for it (``learned_embeds[_2].safetensors``), in fp32.

    Each file is written atomically (complete or absent).

    Returns:
        The files written, in the family's encoder order.
    """
    if len(vectors) != len(family.learned_embeds_files):
        raise ValueError(
            f"{family.name} has {len(family.learned_embeds_files)} text encoders, got vectors for {len(vectors)}"
        )
    return [
        save_learned_embeds(Path(output_dir) / name, placeholder_token, v)
        for name, v in zip(family.learned_embeds_files, vectors, strict=True)
    ]

"""The placeholder tokens and their rows: the only thing a textual-inversion run learns.

The 49,409 x 768 token-embedding matrix stays frozen. :class:`LearnedEmbeddings` holds the
``num_vectors x hidden`` trainable values and :class:`EmbeddingHook` substitutes them into the
embedding's output, so the optimizer and the all-reduce see those rows only (docs/architecture.md,
"Row-sparse training").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from helpers.core import outputs
from helpers.core.errors import InputError
from helpers.training.engine import TrainingInputError


def placeholder_tokens_for(placeholder_token: str, num_vectors: int) -> list[str]:
    """``<tok>``, ``<tok>_1``, ... as diffusers names the tokens of a multi-vector embedding.

    Raises:
        TrainingInputError: ``num_vectors`` is below 1.
    """
    try:
        return outputs.placeholder_tokens_for(placeholder_token, num_vectors)
    except InputError as err:
        raise TrainingInputError(str(err)) from None


def check_tokens(
    tokenizer, placeholder_token: str, initializer_token: str, num_vectors: int, templates: Iterable[str] = ()
) -> int:
    """Check the new tokens are new, fit in every prompt, and the initializer is one token; return its id.

    Args:
        templates: the prompt templates the run trains with (``{}`` stands for the placeholder
            tokens): with ``num_vectors`` tokens in place of ``{}`` each must fit in the
            tokenizer's ``model_max_length`` (CLIP: 77), else the vectors past it never train.

    Raises:
        TrainingInputError: with the fix, before any model weights are loaded.
    """
    longest = max(templates, key=lambda t: len(tokenizer(t.format("")).input_ids), default=None)
    if longest is not None:
        taken = len(tokenizer(longest.format("")).input_ids)  # with the start and end tokens
        limit = tokenizer.model_max_length - taken
        if num_vectors > limit:
            raise TrainingInputError(
                f"num_vectors={num_vectors}: at most {limit} vectors fit in a prompt (CLIP reads "
                f"{tokenizer.model_max_length} tokens and the longest prompt template, {longest!r}, takes "
                f"{taken} of them), so vectors past that would never train. Fix: pass --num_vectors {limit} "
                f"or fewer."
            )
    vocab = tokenizer.get_vocab()  # a fresh dict of every token (49,408 for CLIP) on each call: once
    existing = [t for t in placeholder_tokens_for(placeholder_token, num_vectors) if t in vocab]
    if existing:
        raise TrainingInputError(
            f"placeholder_token {placeholder_token!r}: {', '.join(existing)} already in the tokenizer's "
            f"vocabulary, so it would not be a new concept. Fix: choose a new token such as '<my-concept>'."
        )
    ids = tokenizer.encode(initializer_token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise TrainingInputError(
            f"initializer_token {initializer_token!r} is {len(ids)} tokens ({pieces}), not one. "
            f"Fix: choose a single common word close to the concept, e.g. 'toy' or 'cat'."
        )
    return ids[0]


def add_placeholder_tokens(
    tokenizer, text_encoder, placeholder_token: str, initializer_token: str, num_vectors: int = 1
) -> list[int]:
    """Add the placeholder tokens to the tokenizer and their rows (initialised) to the embedding.

    Returns:
        The ids of the new tokens (contiguous, in order).
    """
    init_id = check_tokens(tokenizer, placeholder_token, initializer_token, num_vectors)
    tokens = placeholder_tokens_for(placeholder_token, num_vectors)
    tokenizer.add_tokens(tokens)
    token_ids = tokenizer.convert_tokens_to_ids(tokens)
    # The new rows are set just below, so transformers' default initialisation of them from the
    # mean and covariance of the 49,408 rows (a noticeable part of a start with SD v1.5) would be thrown away.
    text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    weight = text_encoder.get_input_embeddings().weight
    with torch.no_grad():
        weight[token_ids] = weight[init_id].clone()
    return token_ids


class LearnedEmbeddings(torch.nn.Module):
    """The trainable rows of the new tokens: the only parameters of a textual-inversion run."""

    def __init__(self, initial: torch.Tensor, token_ids: Sequence[int]):
        super().__init__()
        if list(token_ids) != list(range(token_ids[0], token_ids[0] + len(token_ids))):
            raise ValueError(f"placeholder token ids must be contiguous, got {list(token_ids)}")
        self.first_id = int(token_ids[0])
        self.vectors = torch.nn.Parameter(initial.detach().clone().float())

    def forward(self, input_ids: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Replace the embeddings of placeholder positions by the trainable vectors."""
        offset = input_ids - self.first_id
        is_new = (offset >= 0) & (offset < self.vectors.shape[0])
        rows = self.vectors[offset.clamp(0, self.vectors.shape[0] - 1)].to(token_embeds.dtype)
        return torch.where(is_new.unsqueeze(-1), rows, token_embeds)


class EmbeddingHook:
    """Routes the text encoder's frozen token embedding through the learned rows.

    A forward hook on ``text_encoder.get_input_embeddings()``: its output at placeholder positions
    is replaced by ``learned(input_ids, output)``, so the gradient reaches the learned rows and the
    frozen matrix gets none. Install it for as long as training runs; :meth:`remove` undoes it.

    Args:
        text_encoder: a transformers text model (``get_input_embeddings()``).
        learned: a :class:`LearnedEmbeddings`, or a wrapper of one (accelerate, DDP) that takes
            ``(input_ids, token_embeds)`` the same way.
    """

    def __init__(self, text_encoder, learned: torch.nn.Module):
        self.learned = learned
        self.handle = text_encoder.get_input_embeddings().register_forward_hook(self)

    def __call__(self, module, args, output):
        return self.learned(args[0], output)

    def remove(self) -> None:
        """Uninstall the hook: the text encoder reads its own matrix again."""
        self.handle.remove()


def write_rows(text_encoder, token_ids: Sequence[int], vectors: torch.Tensor) -> None:
    """Copy learned vectors into the text encoder's embedding matrix (for saving and sampling)."""
    with torch.no_grad():
        text_encoder.get_input_embeddings().weight[list(token_ids)] = vectors.detach().to(
            text_encoder.get_input_embeddings().weight.dtype
        )

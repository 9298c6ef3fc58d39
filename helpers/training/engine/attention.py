"""The UNet's attention kernel in bf16: diffusers' classic processor where the score matrix is small.

On CPU, diffusers' default (``AttnProcessor2_0``, PyTorch's SDPA) is a flash kernel that never
holds the score matrix and in bf16 runs far below the GEMM peak; the classic ``AttnProcessor``
(``baddbmm``, softmax, ``bmm``) holds the matrix and runs two plain bf16 GEMMs, faster while the
matrix is small, slower once it outgrows the caches. So :class:`SizedAttnProcessor` takes the
classic path up to :data:`MAX_CLASSIC_SCORES` scores per head and the flash kernel above; fp32
keeps diffusers' default, which wins or ties there at every size. Same maths, other rounding.
The measurements per layer and on the step: ``docs/performance.md`` (bf16 attention by size).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

# Queries x keys per head up to which the classic processor is used (256 px's largest, 1024 x 1024).
MAX_CLASSIC_SCORES = 1024 * 1024


class SizedAttnProcessor:
    """diffusers' classic attention processor for small score matrices, SDPA's for large ones."""

    def __init__(self, max_classic_scores: int = MAX_CLASSIC_SCORES):
        self.max_classic_scores = max_classic_scores
        self.classic, self.flash = AttnProcessor(), AttnProcessor2_0()

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        queries = hidden_states[0, 0].numel() if hidden_states.ndim == 4 else hidden_states.shape[1]
        keys = queries if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        processor = self.classic if queries * keys <= self.max_classic_scores else self.flash
        return processor(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)


def processor_for(dtype: torch.dtype) -> SizedAttnProcessor | None:
    """The engine's attention processor for a UNet computing in ``dtype`` (None: diffusers' default)."""
    return SizedAttnProcessor() if dtype == torch.bfloat16 else None

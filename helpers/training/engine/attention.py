"""The UNet's attention kernel in bf16: diffusers' classic processor where the score matrix is small.

diffusers runs attention through PyTorch's ``scaled_dot_product_attention`` (``AttnProcessor2_0``),
which on CPU is a flash kernel: it never holds the whole score matrix, and in bf16 it computes far
below the GEMM peak (23-27 % on the EPYC, 7-10 % on a Xeon with AMX). The classic processor
(``AttnProcessor``: ``baddbmm``, softmax, ``bmm``) holds the matrix and runs two plain bf16 GEMMs,
which is faster where the matrix is small and slower where it is large. Forward and backward
of one SD v1.5 attention layer at 256 px in bf16, on the 2-core EPYC (classic against flash):

============================  =====  =======
queries x keys                self   cross
============================  =====  =======
1024 x 1024 / 1024 x 77       1.23x  1.47x
256 x 256 / 256 x 77          1.33x  1.42x
64, 16 tokens                 1.00-1.15x
2048 x 2048, 4096 x 4096      0.78x, 0.79x (512 px)
============================  =====  =======

So :class:`SizedAttnProcessor` takes the classic path up to :data:`MAX_CLASSIC_SCORES` scores per
head and the flash kernel above (1.06x on the whole bf16 step, ``bench.optimisations --only
attention_by_size``). In fp32 the flash kernel wins or ties everywhere (the classic one 0.59x at
1024 x 1024), so fp32 keeps diffusers' default. The maths is the same; only the rounding differs.
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

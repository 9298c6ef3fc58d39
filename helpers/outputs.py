"""The names of what a training run writes, shared by training and everything that reads a run.

Inference, notebooks and benchmarks import these from here rather than from the training engine
(:mod:`helpers.textual_inversion`), which would pull in accelerate just for a file name.
"""

from __future__ import annotations

from helpers.errors import InputError

LEARNED_EMBEDS = "learned_embeds.safetensors"
"""``{placeholder_token: FloatTensor[num_vectors, hidden]}``, in ``output_dir``."""
SUMMARY = "run_summary.json"
"""What a finished run reports (steps, seconds, loss...), in ``output_dir``; written last."""
HISTORY = "history.json"
"""Per-step records (loss, learning rate, seconds), in ``output_dir``."""
PIPELINE_DIR = "pipeline"
"""The full fine-tuned diffusers pipeline (``--save_as_full_pipeline``), under ``output_dir``."""


def placeholder_tokens_for(placeholder_token: str, num_vectors: int) -> list[str]:
    """``<tok>``, ``<tok>_1``, ... as diffusers names the tokens of a multi-vector embedding.

    Raises:
        InputError: ``num_vectors`` is below 1.
    """
    if num_vectors < 1:
        raise InputError(f"num_vectors={num_vectors}: must be at least 1")
    return [placeholder_token] + [f"{placeholder_token}_{i}" for i in range(1, num_vectors)]

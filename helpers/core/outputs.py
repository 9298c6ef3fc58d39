"""The names of what a training run writes, shared by training and everything that reads a run.

Inference, notebooks and benchmarks import these from here rather than from the training engine
(:mod:`helpers.training.textual_inversion`), which would pull in accelerate just for a file name.

The layout of ``output_dir`` is that of diffusers' ``examples/textual_inversion/textual_inversion.py``
(so the guides' lines that load ``output_dir`` work unchanged), plus the engine's own records::

    output_dir/
      train_config.yaml                the settings, written first
      checkpoints/checkpoint-N/        resumable; each holds its run's train_config.yaml
      samples/step-N/, samples/final/  validation images
      learned_embeds-steps-N.safetensors (SDXL: learned_embeds_2-steps-N.safetensors too)
      history.json                     per-step records (history.json.partial while running)
      learned_embeds.safetensors
      learned_embeds_2.safetensors     SDXL only: the second text encoder's rows
      model_index.json, text_encoder/, tokenizer/, unet/, vae/, scheduler/
                                       (SDXL: text_encoder_2/ and tokenizer_2/ too)
                                       with --save_as_full_pipeline: output_dir is itself a
                                       diffusers pipeline folder (model_index.json written last)
      run_summary.json                 written last: the run is finished
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers.core.errors import InputError

LEARNED_EMBEDS = "learned_embeds.safetensors"
"""``{placeholder_token: FloatTensor[num_vectors, hidden]}``, in ``output_dir``."""
LEARNED_EMBEDS_2 = "learned_embeds_2.safetensors"
"""SDXL's second text encoder's rows, the same layout, beside :data:`LEARNED_EMBEDS` (the first's)."""
SUMMARY = "run_summary.json"
"""What a finished run reports (steps, seconds, loss...), in ``output_dir``; written last."""
HISTORY = "history.json"
"""Per-step records (loss, learning rate, seconds), in ``output_dir``."""
HISTORY_PARTIAL = "history.json.partial"
"""The records up to the last checkpoint, while a run is in progress (a resume reads them); removed at the end."""
TRAIN_CONFIG = "train_config.yaml"
"""The run's settings (``TrainConfig`` as YAML), in ``output_dir`` and in each checkpoint."""
CHECKPOINTS = "checkpoints"
"""The folder of resumable checkpoints ``checkpoint-N``, in ``output_dir``."""
SAMPLES = "samples"
"""The folder of validation images (``step-N/``, ``final/``), in ``output_dir``."""
LOGS = "logs"
"""TensorBoard's event files (``--report_to tensorboard``, ``--logging_dir``'s default), in ``output_dir``."""
MODEL_INDEX = "model_index.json"
"""With ``--save_as_full_pipeline`` ``output_dir`` itself is a diffusers pipeline folder; this file,
written after its components, says it is complete."""
PIPELINE_DIR = "pipeline"
"""A pipeline folder under ``output_dir``: DreamBooth's (:mod:`helpers.dreambooth`), and where
textual-inversion runs wrote theirs before it moved into ``output_dir`` itself (the engine still
removes such a folder with a run it replaces)."""
PIPELINE_PARTS = (
    "text_encoder",
    "tokenizer",
    "text_encoder_2",
    "tokenizer_2",
    "unet",
    "vae",
    "scheduler",
    "feature_extractor",
    "safety_checker",
    "image_encoder",
)
"""The component folders a Stable Diffusion (or SDXL) pipeline may have beside ``model_index.json``."""


def is_pipeline_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete diffusers pipeline (its ``model_index.json`` is written last)."""
    return (Path(path) / MODEL_INDEX).is_file()


def placeholder_tokens_for(placeholder_token: str, num_vectors: int) -> list[str]:
    """``<tok>``, ``<tok>_1``, ... as diffusers names the tokens of a multi-vector embedding.

    Raises:
        InputError: ``num_vectors`` is below 1.
    """
    if num_vectors < 1:
        raise InputError(f"num_vectors={num_vectors}: must be at least 1")
    return [placeholder_token] + [f"{placeholder_token}_{i}" for i in range(1, num_vectors)]

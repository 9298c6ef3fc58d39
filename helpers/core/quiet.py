"""Third-party messages that mean nothing to a workshop attendee, silenced at their source.

Each entry names the logger that emits it and why it is noise here; anything else those libraries
say still shows. :func:`install_log_filters` runs when ``helpers`` is imported (it imports no
library); :func:`quiet_model_loading` runs where ``helpers`` loads a model, since the progress
switches live inside diffusers and transformers.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from collections.abc import Iterator

# logger name -> message prefixes to drop (an empty tuple: drop everything below ERROR).
NOISE: dict[str, tuple[str, ...]] = {
    # optimum-intel and optimum both install the top-level package "optimum" on purpose.
    "diffusers.utils.import_utils": (),
    # torchvision is left out on purpose (the registry's build breaks the CPU torch); the PIL image
    # processors are the intended fallback, and the deprecation notes are about classes we never use.
    "transformers.utils.import_utils": (),
    # Adding a placeholder token resizes the embedding matrix; the new rows are overwritten at once
    # (by the initializer word in training, by the learned vectors in load_textual_inversion).
    "transformers.modeling_utils": (),
    # optimum-intel probes the folder for IR files with a call that fails on Python 3.11 and then
    # does the right thing anyway; the probe's failure is all the message says.
    "optimum.intel.openvino.modeling_base": ("Could not infer whether the model was already converted",),
    # diffusers passes `subfolder=""` on to every component loader of an exported pipeline.
    "diffusers.pipelines.pipeline_utils": ("Keyword arguments {'subfolder'",),
    # The workshop's models have no safety checker (the toy world cannot draw anything unsafe);
    # notebook 05 says so once instead of five times.
    "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion": (
        "You have disabled the safety checker",
    ),
    "optimum.intel.openvino.modeling_diffusion": ("You have disabled the safety checker",),
    # optimum-intel's OpenVINO export (patching_utils.sdpa_mask_without_vmap, for transformers 5.4-5.9)
    # passes the deprecated cache_position tensor on purpose: its converter expects that mask graph.
    "transformers.masking_utils": ("`cache_position` is deprecated",),
    # CLIP's text encoder has no tensor-parallel plan; in a distributed run (data parallel, nothing
    # is meant to be sharded) transformers lists every one of its layers as "not sharded".
    "transformers.integrations.tensor_parallel": ("The following layers were not sharded",),
}


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install_log_filters() -> None:
    """Apply :data:`NOISE` (idempotent; cheap: only loggers are touched, no library is imported)."""
    for name, prefixes in NOISE.items():
        logger = logging.getLogger(name)
        if not prefixes:
            logger.setLevel(logging.ERROR)
        elif not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))


@functools.cache
def quiet_model_loading() -> None:
    """Turn off the load-time progress bars of diffusers and transformers in this process.

    "Loading pipeline components", "Loading weights" and "Writing model shards" take a moment on
    a local folder and would add a bar per component to every notebook cell. Downloads from the
    Hub (huggingface_hub's own bars) and the workshop's training bar are not affected.
    """
    import diffusers.utils.logging
    import huggingface_hub.utils
    import transformers.utils.logging

    downloads_shown = not huggingface_hub.utils.are_progress_bars_disabled()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()  # turns huggingface_hub's bars off too
    if downloads_shown:
        huggingface_hub.utils.enable_progress_bars()


@contextlib.contextmanager
def tracing_quietly() -> Iterator[None]:
    """Silence ``torch.jit.TracerWarning`` while exporting: each names a line of library code where
    a Python value becomes a constant of the traced graph, which static shapes make true anyway."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


class _Nowhere(io.TextIOBase):
    """A text stream that keeps nothing (rich's console needs one with ``write``)."""

    def write(self, text: str) -> int:
        return len(text)


def quiet_weight_compression() -> None:
    """Quiet NNCF: its statistics table and its progress bars (about ten per notebook 05 run).

    The table is logged at INFO; NNCF sets its own logger's level when imported, so the level is set
    through its API, after the import. The bars (``nncf.common.logging.track_progress``, which has
    no switch) draw on rich's global console, an output widget each in JupyterLab; nothing else in
    the workshop uses that console, so it is pointed at a stream that is neither a terminal nor
    Jupyter and keeps nothing.
    """
    import nncf
    import rich

    nncf.set_log_level(logging.ERROR)
    rich.reconfigure(file=_Nowhere(), force_jupyter=False, force_terminal=False)

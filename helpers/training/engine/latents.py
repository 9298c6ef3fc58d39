"""The persistent latent cache: what the VAE encoder computed, kept on disk so a re-run skips the VAE.

Before its first step a run encodes every view of its images (each image, flipped or not) with the
VAE, which must be loaded first; with Stable Diffusion that is most of a start (the start-up table of
docs/performance.md, ``bench/results/startup-sd15-shape-256px.json``). The latents are a pure
function of the encoder's weights, the pixels it is given and how it computes, so this module keeps
them in one folder for every run and process of the machine, keyed by all of that: a re-run, a
resumed run, or another rank with the same images does not load the VAE at all.

The unit of the cache is one VAE call (:data:`~helpers.training.engine.step.LATENT_BATCH` views, grouped as
:func:`~helpers.training.engine.step.cache_latents` groups them), because the encoder's rounding depends on
the batch (and on the threads). An entry is exactly what that call computes here, so a run's
results are the same bit for bit whether the cache is cold, warm, partly warm or off.

Key of an entry, the SHA-256 of:

* the VAE's files (``vae/`` of the model: config and weights, each hashed by content; a large
  file's digest is remembered under ``files/`` by its path, size, mtime and inode);
* how the encoder computes: torch and diffusers versions, the CPU capability torch dispatches to
  (AVX2, AVX512, ...), the number of threads, the dtype, the pixels' memory layout;
* each view of the call, in order: the image file's bytes, flipped or not, the resolution, the
  centre crop, and the pixels given to the encoder (which also covers the resizing filter and
  Pillow's version).

An entry is ``<root>/<key[:2]>/<key>.safetensors`` holding ``mean`` and ``std`` (float32,
``[views, 4, size/8, size/8]``) and the VAE's ``scaling_factor``; its metadata repeats the key.
It is written to a temporary file and renamed, so processes writing the same entry at once are
safe. An entry that cannot be read or does not match its key is encoded again and rewritten; a
cache that cannot be written is named in a warning and never stops a run.

Where: ``latent_cache_dir``, else ``$WORKSHOP_LATENT_CACHE``, else ``latents/`` in the project's
cache folder (:func:`helpers.training.models.cache_dir`). Off: ``--no-latent_cache`` or
``WORKSHOP_LATENT_CACHE=off``. To clear it, delete the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.core import cpu
from helpers.core.files import write_bytes_atomic, write_path_atomic
from helpers.training import data, models
from helpers.training.engine.step import encode_views, pixel_layout, view_batches

logger = logging.getLogger(__name__)

ENV = "WORKSHOP_LATENT_CACHE"
"""Environment variable: the cache folder, or ``off`` (also ``0``, ``false``, ``no``, ``none``)."""
FORMAT = 1  # bump when an entry's layout or meaning changes: it is part of every key
_OFF = {"off", "0", "false", "no", "none"}
_MEMO_MIN_BYTES = 1 << 20  # smaller files are hashed each time


@dataclass
class CachedLatents:
    """Every view's latent distribution, and what the cache did.

    Attributes:
        mean, std: ``[num_views, 4, size/8, size/8]`` float32, as :func:`~helpers.training.engine.step.cache_latents` returns.
        scaling_factor: the VAE's latent scaling factor.
        calls: VAE calls a run needs (one per :data:`~helpers.training.engine.step.LATENT_BATCH` views).
        found: how many of them were read from the cache.
        vae_loaded: whether the VAE was loaded (some call was missing).
    """

    mean: torch.Tensor
    std: torch.Tensor
    scaling_factor: float
    calls: int
    found: int
    vae_loaded: bool

    def report(self, root: Path) -> dict:
        """What ``run_summary.json`` records about the cache."""
        return {"dir": str(root), "vae_calls": self.calls, "found": self.found, "vae_loaded": self.vae_loaded}


def cache_root(enabled: bool = True, folder: str | os.PathLike | None = None) -> Path | None:
    """The cache folder a run uses, or None when the cache is off.

    Args:
        enabled: the ``latent_cache`` setting.
        folder: the ``latent_cache_dir`` setting (wins over the environment).
    """
    if not enabled:
        return None
    if folder:
        return Path(folder).expanduser()
    env = os.environ.get(ENV, "").strip()
    if env.lower() in _OFF and env:
        return None
    return Path(env).expanduser() if env else models.cache_dir() / "latents"


def file_digest(path: Path, memo_dir: Path | None = None) -> str:
    """SHA-256 of a file's bytes; remembered in ``memo_dir`` by path, size, mtime and inode if large."""
    st = path.stat()
    memo = None
    if memo_dir is not None and st.st_size >= _MEMO_MIN_BYTES:
        stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}"
        memo = memo_dir / f"{hashlib.sha256(stamp.encode()).hexdigest()}.sha256"
        with contextlib.suppress(OSError):  # not remembered yet (or unreadable): hash it
            known = memo.read_text().strip()
            if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
                return known
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    if memo is not None:
        _best_effort(lambda: write_bytes_atomic(memo, digest.encode()), memo)
    return digest


def vae_digest(model_dir: str | os.PathLike, memo_dir: Path | None = None) -> str:
    """A hash of the model's ``vae/`` folder: every file's name and content."""
    folder = Path(model_dir) / "vae"
    h = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        h.update(f"{file.name}\0{file_digest(file, memo_dir)}\n".encode())
    return h.hexdigest()


def encoder_context(dtype: torch.dtype = torch.float32) -> dict:
    """What else decides the encoder's rounding here (versions, CPU kernels, threads, ``dtype``, layout).

    Once imported (``use_ipex``), IPEX replaces operator kernels process-wide, the VAE's among them.
    """
    import diffusers

    ipex = sys.modules.get("intel_extension_for_pytorch")

    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "pixel_layout": str(pixel_layout(dtype)).removeprefix("torch."),
        "ipex": getattr(ipex, "__version__", None),
    }


def view_key(dataset: data.ConceptDataset, view: int) -> dict:
    """What identifies one view's pixels: the image's bytes, the flip, the preprocessing, the pixels."""
    image, flipped = dataset.view_source(view)
    pixels = dataset.view_pixels(view)
    return {
        "image_sha256": file_digest(image),
        "flipped": flipped,
        "resolution": dataset.size,
        "center_crop": dataset.center_crop,
        "pixels_sha256": hashlib.sha256(pixels.numpy().tobytes()).hexdigest(),
    }


def entry_key(vae: str, context: dict, views: list[dict]) -> str:
    """The key of one VAE call's entry."""
    spec = {"vae": vae, "encoder": context, "views": views}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def entry_path(root: Path, key: str) -> Path:
    return root / key[:2] / f"{key}.safetensors"


def read_entry(path: Path, key: str, num_views: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """An entry's ``(mean, std, scaling_factor)``, or None if it is missing, unreadable or not this key's."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        mean, std, scaling = tensors["mean"], tensors["std"], tensors["scaling_factor"]
        ok = (
            meta.get("key") == key
            and mean.dtype == std.dtype == torch.float32
            and mean.shape == std.shape
            and mean.dim() == 4
            and mean.shape[0] == num_views
            and scaling.dtype == torch.float64
            and scaling.dim() == 0
            and bool(torch.isfinite(mean).all() and torch.isfinite(std).all())
        )
    except Exception as err:  # a truncated or foreign file is a miss, whatever the reader raises
        logger.warning("latent cache: ignoring unreadable entry %s (%s); encoding it again", path, err)
        return None
    if not ok:
        logger.warning(
            "latent cache: ignoring entry %s, which does not match its key; encoding it again", path
        )
        return None
    return mean, std, scaling.item()


def write_entry(path: Path, key: str, mean: torch.Tensor, std: torch.Tensor, scaling_factor: float) -> None:
    """Write an entry atomically (temporary file, then rename); a failure is only a warning."""
    from safetensors.torch import save_file

    tensors = {
        "mean": mean.contiguous(),
        "std": std.contiguous(),
        "scaling_factor": torch.tensor(scaling_factor, dtype=torch.float64),
    }
    metadata = {"key": key, "format": str(FORMAT)}
    _best_effort(lambda: write_path_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata)), path)


def _best_effort(write: Callable[[], object], path: Path) -> None:
    try:
        write()
    except Exception as err:  # a full disk or read-only cache must not stop training
        logger.warning("latent cache: could not write %s (%s); the run goes on without it", path, err)


def cached_latents(
    root: Path | None,
    model_dir: str | os.PathLike,
    dataset: data.ConceptDataset,
    vae_loader: Callable | None = None,
    dtype: torch.dtype = torch.float32,
) -> CachedLatents:
    """Every view's latent distribution: read from the cache, encoding (and storing) only what is missing.

    The VAE is loaded only if some VAE call is missing, and freed before returning.

    Args:
        root: the cache folder (:func:`cache_root`); None (the cache off): encode every view,
            read and write nothing.
        model_dir: the model's local folder (its ``vae/`` is hashed, and loaded if needed).
        dataset: the views to encode.
        vae_loader: ``vae_loader(model_dir, dtype)`` loads the VAE; default
            :func:`helpers.training.models.load_frozen_vae`.
        dtype: the VAE's weights and arithmetic: float32, or bfloat16 in bf16 runs (as diffusers'
            script encodes; the latents are returned in float32 either way).
    """
    calls = view_batches(dataset.num_views)
    keys: list[str] = []
    got: list[tuple[torch.Tensor, torch.Tensor, float] | None] = [None] * len(calls)
    if root is not None:
        vae_id, context = vae_digest(model_dir, root / "files"), encoder_context(dtype)
        keys = [entry_key(vae_id, context, [view_key(dataset, v) for v in views]) for views in calls]
        got = [read_entry(entry_path(root, k), k, len(views)) for k, views in zip(keys, calls, strict=True)]
    missing = [i for i, entry in enumerate(got) if entry is None]
    if missing:
        vae = (vae_loader or models.load_frozen_vae)(model_dir, dtype)
        scaling = vae.config.scaling_factor
        for i in missing:
            mean, std = encode_views(vae, dataset, calls[i])
            got[i] = (mean, std, scaling)
            if root is not None:
                write_entry(entry_path(root, keys[i]), keys[i], mean, std, scaling)
        cpu.drop_module_file_pages(vae)  # loaded from a mapped file, it would stay resident
        del vae  # never needed again
    if root is not None:
        logger.info(
            "latent cache %s: %d of %d VAE calls found%s",
            root,
            len(calls) - len(missing),
            len(calls),
            ", the VAE was not loaded" if not missing else "",
        )
    return CachedLatents(
        mean=torch.cat([m for m, _, _ in got]),
        std=torch.cat([s for _, s, _ in got]),
        scaling_factor=got[0][2],
        calls=len(calls),
        found=len(calls) - len(missing),
        vae_loaded=bool(missing),
    )

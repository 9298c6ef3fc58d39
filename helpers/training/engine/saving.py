"""What a run writes besides checkpoints: learned embeddings, JSON records, validation samples, the full pipeline."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from helpers.core import files
from helpers.core.outputs import MODEL_INDEX, PIPELINE_PARTS
from helpers.ranks import status
from helpers.training.engine import TrainingInputError
from helpers.training.engine.rows import write_rows

if TYPE_CHECKING:
    from helpers.training.engine.setup import Run


class StorageError(TrainingInputError):
    """Saving failed because the disk is full or failing: one line naming the path and the free space."""


_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS}
# How the writers report a full disk when they do not raise OSError: safetensors' SafetensorError
# ("... (os error 28)") and torch.save's RuntimeError ("[enforce fail at inline_container.cc:...]",
# "PytorchStreamWriter failed writing file ...").
_STORAGE_TEXTS = (
    "os error 28",
    "os error 122",
    "os error 5)",
    "no space left",
    "inline_container",
    "streamwriter failed",
)


def is_storage_error(err: BaseException) -> bool:
    """Whether ``err`` says the disk is full or failing (rather than that the code is wrong)."""
    if isinstance(err, OSError) and err.errno in _STORAGE_ERRNOS:
        return True
    text = str(err).lower()
    return not isinstance(err, OSError) and any(t in text for t in _STORAGE_TEXTS)


def free_space(path: str | os.PathLike) -> str:
    """The free space of the disk holding ``path`` (or its nearest existing parent), e.g. ``"1.2 GiB"``."""
    path = Path(path).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = float(shutil.disk_usage(existing).free)
    for unit in ("bytes", "KiB", "MiB"):
        if free < 1024:
            return f"{free:.0f} {unit}" if unit == "bytes" else f"{free:.1f} {unit}"
        free /= 1024
    return f"{free:.1f} GiB"


@contextlib.contextmanager
def storage_errors(
    path: str | os.PathLike, what: str, discard: str | os.PathLike | None = None
) -> Iterator[None]:
    """Turn a full disk or an I/O error while writing ``what`` to ``path`` into one :class:`StorageError`.

    Args:
        path: what was being written (named in the message with its disk's free space).
        what: its name in words, e.g. ``"checkpoint checkpoint-2"``.
        discard: a temporary to remove on any error, so nothing half-written stays.
    """
    try:
        yield
    except BaseException as err:
        if discard is not None:
            shutil.rmtree(discard, ignore_errors=True)
        if not is_storage_error(err):
            raise
        reason = (
            os.strerror(err.errno)
            if isinstance(err, OSError) and err.errno
            else str(err).splitlines()[0][:120]
        )
        raise StorageError(
            f"saving {what} to {path} failed: {reason}; {free_space(path)} free on that disk. Fix: free "
            f"space there (or choose an output_dir on another disk), then resume with "
            f"--resume_from_checkpoint latest (the last complete checkpoint is kept)."
        ) from None


def save_learned_embeds(path: str | os.PathLike, placeholder_token: str, vectors: torch.Tensor) -> Path:
    """Write ``{placeholder_token: [num_vectors, hidden]}``, the format ``load_textual_inversion`` reads.

    Atomically (:func:`helpers.core.files.write_path_atomic`): the file is complete or absent.
    """
    state = {placeholder_token: vectors.detach().float().cpu().contiguous()}
    return files.write_path_atomic(path, lambda tmp: save_file(state, str(tmp)))


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """Write ``value`` as strict JSON (no NaN or Infinity, which other readers reject), atomically.

    Raises:
        ValueError: ``value`` holds a non-finite float (a bug: a diverged run stops before writing).
    """
    return files.write_text_atomic(path, json.dumps(value, indent=2, allow_nan=False))


def encoder_parts(run) -> dict:
    """The run's tokenizers and text encoders under their pipeline names (``tokenizer``,
    ``text_encoder``, SDXL's ``tokenizer_2`` and ``text_encoder_2``), and its family's pipeline
    extras (SD v1's: no safety checker)."""
    family = run.family
    parts = {name: getattr(run, name) for name in (*family.tokenizers, *family.text_encoders)}
    return {**parts, **dict(family.pipeline_extras)}


def _sampling_pipeline(run: Run):
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler

    return run.family.diffusers_class()(
        vae=AutoencoderKL.from_pretrained(run.model_dir, subfolder="vae"),
        unet=run.unet,
        scheduler=DPMSolverMultistepScheduler.from_pretrained(run.model_dir, subfolder="scheduler"),
        feature_extractor=None,
        **encoder_parts(run),
    )


@torch.no_grad()
def save_samples(run: Run, dest: Path) -> list[Path]:
    """Generate validation images with the current embedding into ``dest`` (main process only)."""
    hooks = []
    for _, encoder, token_ids, hook, vectors in run.encoders:
        write_rows(encoder, token_ids, vectors)
        hooks.append((hook, hook.learned))
        hook.learned = lambda ids, out: out  # the rows are in the matrix now
    try:
        return draw_samples(run, dest)
    finally:
        for hook, learned in hooks:
            hook.learned = learned


@torch.no_grad()
def draw_samples(run, dest: Path, size: int | None = None) -> list[Path]:
    """``num_validation_images`` pictures of ``validation_prompt`` (seeded by ``seed``) with the run's
    models as they are now, into ``dest`` (replaced whole); for both methods.

    Args:
        run: a run with ``config``, ``model_dir``, ``unet``, ``text_encoder``, ``tokenizer``, ``accelerator``.
        dest: the folder the pictures go to.
        size: their height and width (None: the model's default).
    """
    config, unet = run.config, run.unet
    modules = [unet, *(m for m in encoder_parts(run).values() if isinstance(m, torch.nn.Module))]
    was_training = [m.training for m in modules]
    for module in modules:
        module.eval()
    try:
        pipe = _sampling_pipeline(run)
        pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator().manual_seed(config.seed)
        prompts = [config.validation_prompt] * config.num_validation_images
        with run.accelerator.autocast():  # the UNet may hold bf16 weights
            images = pipe(prompts, num_inference_steps=25, generator=gen, height=size, width=size,
                          callback_on_step_end=_beat).images  # fmt: skip
    finally:
        for module, training in zip(modules, was_training, strict=True):
            module.train(training)
    names = [f"{i:02d}.png" for i in range(len(images))]

    def fill(folder: Path) -> None:
        for name, image in zip(names, images, strict=True):
            files.save_image_atomic(folder / name, image)

    files.replace_dir_atomic(dest, fill)
    return [dest / name for name in names]


def _beat(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
    """Sampling can outlast helpers.launch's stall limit: each denoising step counts as progress."""
    status.beat("validating", step)
    return callback_kwargs


UNCHANGED_PARTS = ("unet", "vae")  # the heavy parts a textual-inversion run never changes
COPY_LIMIT_SECONDS = 1800.0  # the base model's UNet and VAE (3.6 GB for SD v1.5) onto a slow disk


def saved_files(folder: Path) -> list[str]:
    """The files of a model part saved as diffusers' ``save_pretrained`` writes it, if it is: its
    config and its safetensors weights, in one file or in the shards its index names (a part over
    ``max_shard_size``, 10 GB: SDXL's fp32 UNet as diffusers saves it). Else an empty list."""
    from diffusers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME

    if (folder / SAFETENSORS_WEIGHTS_NAME).is_file():
        weights = [SAFETENSORS_WEIGHTS_NAME]
    else:
        try:
            shards = json.loads((folder / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"].values()
            weights = [SAFE_WEIGHTS_INDEX_NAME, *sorted(set(shards))]
        except (OSError, ValueError, KeyError, AttributeError, TypeError):  # no index, or not one
            return []
    names = [CONFIG_NAME, *weights]
    # only files beside the index: a shard named '../x' would be copied out of the run's folder
    plain = all(isinstance(n, str) and Path(n).name == n and n not in (".", "..") for n in names)
    return names if plain and all((folder / n).is_file() for n in names) else []


class PipelineCopy:
    """The base model's UNet and VAE files copied into the pipeline's temporary folder while training runs.

    They make 3.6 of the 4.1 GB an SD v1.5 pipeline writes, and training never changes them. Copied
    in a background thread (the GIL is free while the kernel writes), the copy and the disk's writes
    overlap the first steps instead of following the last one: the save after the last step takes
    a small fraction of its time. The files are written by
    :func:`helpers.core.files.copy_file_uncached`, which leaves the steps their CPUs and memory (its
    docstring says what a page-cache copy cost them; the whole command's numbers are in
    docs/performance.md). Only parts the base holds as diffusers writes them (:func:`saved_files`)
    are copied, byte for byte; :func:`save_full_pipeline` saves the others.
    The thread never calls back into the run; :meth:`wait` re-raises its error (a full disk).

    Args:
        model_dir: the base model's local folder.
        output_dir: the run's output folder; the temporary is a hidden folder inside it, which
            :func:`helpers.training.engine.folder.clear_leftovers` removes if the process dies.
    """

    def __init__(self, model_dir: str | os.PathLike, output_dir: str | os.PathLike):
        source = Path(model_dir)
        self.folder = Path(output_dir) / f".pipeline.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        found = {part: saved_files(source / part) for part in UNCHANGED_PARTS}
        self.parts = [part for part, names in found.items() if names]
        self.folder.mkdir(parents=True)
        self._error: BaseException | None = None
        copies = [(source / part / n, self.folder / part / n) for part in self.parts for n in found[part]]
        self._thread = threading.Thread(target=self._copy, args=(copies,), name="pipeline-copy", daemon=True)
        self._thread.start()

    def _copy(self, copies: list[tuple[Path, Path]]) -> None:
        try:
            for source, dest in copies:
                dest.parent.mkdir(exist_ok=True)
                files.copy_file_uncached(source, dest)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def wait(self, limit: float = COPY_LIMIT_SECONDS) -> list[str]:
        """Wait for the copy (beating as ``saving``); return the parts it copied.

        Raises:
            TimeoutError: the copy took more than ``limit`` seconds.
            OSError: the copy failed (e.g. the disk is full).
        """
        deadline = time.monotonic() + limit
        while self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"copying the base model's {' and '.join(self.parts)} into {self.folder} took over "
                    f"{limit:.0f} s; check that disk, or train without --save_as_full_pipeline"
                )
            status.beat("saving")  # a slow disk is progress for helpers.launch, not a stall
            self._thread.join(timeout=5.0)
        if self._error is not None:
            raise self._error
        return self.parts

    def discard(self) -> None:
        """Remove the temporary (a no-op once :func:`save_full_pipeline` moved it into place)."""
        self._thread.join(timeout=COPY_LIMIT_SECONDS)
        shutil.rmtree(self.folder, ignore_errors=True)


def save_full_pipeline(run: Run, output_dir: Path, copied: PipelineCopy) -> Path:
    """Save the complete diffusers pipeline into ``output_dir`` itself, as diffusers' script does.

    ``output_dir`` then holds ``model_index.json``, ``text_encoder/``, ``tokenizer/`` (both with the
    placeholder tokens; SDXL: ``text_encoder_2/`` and ``tokenizer_2/`` too), ``unet/``, ``vae/`` and
    ``scheduler/`` beside ``learned_embeds.safetensors``, so the family's pipeline class
    (``StableDiffusion[XL]Pipeline.from_pretrained(output_dir)``) and optimum-intel's export load it.
    The UNet and VAE are the base model's, untouched: ``copied``, the :class:`PipelineCopy` started
    with the run for ``output_dir``, holds their files (or holds none, and they are saved here).

    Complete or absent: the pipeline is saved into a hidden folder inside ``output_dir`` (``copied``'s),
    any old ``model_index.json`` is removed, each component folder is moved in
    (:func:`helpers.core.files.move_dir_into_place`) and ``model_index.json`` is written last. A crash
    leaves no ``model_index.json``; the next run removes the half-moved parts
    (:func:`helpers.training.engine.folder.clear_leftovers`). Main process only.
    """
    for _, encoder, token_ids, _, vectors in run.encoders:
        write_rows(encoder, token_ids, vectors)
    output_dir = Path(output_dir)
    done = copied.wait()
    # Training never changes the UNet: reuse it unless it was cast to bf16, then load the original
    # (the module only names its class in model_index.json when its files were copied).
    unet = {"unet": run.unet} if run.unet.dtype == torch.float32 or "unet" in done else {}
    base = run.family.diffusers_class().from_pretrained(run.model_dir, **encoder_parts(run), **unet)
    (output_dir / MODEL_INDEX).unlink(missing_ok=True)  # not a whole pipeline until the new one is in
    tmp = copied.folder
    try:
        # What DiffusionPipeline.save_pretrained does, less the parts already copied.
        for name, module in base.components.items():
            if module is not None and name not in done:
                module.save_pretrained(tmp / name)
        base.save_config(tmp)
        for part in sorted(tmp.iterdir()):
            if part.is_dir():
                files.move_dir_into_place(part, output_dir / part.name)
            elif part.name != MODEL_INDEX:
                files.write_bytes_atomic(output_dir / part.name, part.read_bytes())
        files.write_bytes_atomic(output_dir / MODEL_INDEX, (tmp / MODEL_INDEX).read_bytes())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


def remove_full_pipeline(output_dir: Path) -> None:
    """Remove a pipeline saved into ``output_dir`` (``model_index.json`` first, then its parts)."""
    output_dir = Path(output_dir)
    (output_dir / MODEL_INDEX).unlink(missing_ok=True)
    for name in PIPELINE_PARTS:
        shutil.rmtree(output_dir / name, ignore_errors=True)

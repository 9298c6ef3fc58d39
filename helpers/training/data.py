"""Concept images for textual inversion: bundled sample, Hub download, validation, dataset.

The dataset follows the diffusers example ``examples/textual_inversion/textual_inversion.py``
(same prompt templates, ``repeats``, optional centre crop, bicubic resize, random horizontal
flip, pixels in [-1, 1]) with two changes the training engine relies on: every random choice
of item ``i`` comes from its own generator seeded by ``(seed, i)``, so items are identical
whatever the worker layout; and an item names a *view* (image x flip) instead of carrying
pixels, so the engine can encode each view with the VAE once and cache the latent.

Command line::

    python -m helpers.training.data download [--repo_id ID] [--dest DIR]
    python -m helpers.training.data validate PATH [--min_size N]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from helpers.core.errors import ArgumentParser, InputError, run_cli
from helpers.core.sources import classify_source
from helpers.training import models

__all__ = [
    "DEFAULT_CONCEPT_REPO",
    "IMAGE_EXTENSIONS",
    "ConceptDataset",
    "ConceptImagesWarning",
    "ImageFolderError",
    "download_concept",
    "imagenet_style_templates_small",
    "imagenet_templates_small",
    "sample_concept_dir",
    "validate_image_folder",
]

logger = logging.getLogger(__name__)

DEFAULT_CONCEPT_REPO = "sd-concepts-library/dicoo"
# sd-concepts-library repos keep the training pictures in concept_images/ beside
# learned_embeds.bin, token_identifier.txt and type_of_concept.txt.
CONCEPT_IMAGES_SUBDIR = "concept_images"
MAX_CONCEPT_FILES = 1000
"""Most files a concept folder may hold. Textual Inversion and DreamBooth learn a concept from a
handful of pictures (3-5 in both papers and diffusers' examples), and every file is decoded and
every picture's views encoded before the first step (10,000 tiny files took over 400 s): a folder
with more is a wrong folder (a whole photo library, a data set), refused before any file is opened.
DreamBooth's generated class pictures are not a concept folder and have no such limit."""
IMAGE_EXTENSIONS = frozenset(
    {".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
)
"""Extensions that promise a picture: such a file that Pillow cannot read is refused, not skipped."""

# The prompt templates of the diffusers textual-inversion example, in the same order and with
# the same duplicates (they weight the random choice).
imagenet_templates_small = [
    "a photo of a {}",
    "a rendering of a {}",
    "a cropped photo of the {}",
    "the photo of a {}",
    "a photo of a clean {}",
    "a photo of a dirty {}",
    "a dark photo of the {}",
    "a photo of my {}",
    "a photo of the cool {}",
    "a close-up photo of a {}",
    "a bright photo of the {}",
    "a cropped photo of a {}",
    "a photo of the {}",
    "a good photo of the {}",
    "a photo of one {}",
    "a close-up photo of the {}",
    "a rendition of the {}",
    "a photo of the clean {}",
    "a rendition of a {}",
    "a photo of a nice {}",
    "a good photo of a {}",
    "a photo of the nice {}",
    "a photo of the small {}",
    "a photo of the weird {}",
    "a photo of the large {}",
    "a photo of a cool {}",
    "a photo of a small {}",
]

imagenet_style_templates_small = [
    "a painting in the style of {}",
    "a rendering in the style of {}",
    "a cropped painting in the style of {}",
    "the painting in the style of {}",
    "a clean painting in the style of {}",
    "a dirty painting in the style of {}",
    "a dark painting in the style of {}",
    "a picture in the style of {}",
    "a cool painting in the style of {}",
    "a close-up painting in the style of {}",
    "a bright painting in the style of {}",
    "a cropped painting in the style of {}",
    "a good painting in the style of {}",
    "a close-up painting in the style of {}",
    "a rendition in the style of {}",
    "a nice painting in the style of {}",
    "a small painting in the style of {}",
    "a weird painting in the style of {}",
    "a large painting in the style of {}",
]

_TEMPLATES = {"object": imagenet_templates_small, "style": imagenet_style_templates_small}


def prompt_templates(learnable_property: str) -> list[str]:
    """The prompt templates of ``"object"`` or ``"style"`` training (``{}`` is the placeholder)."""
    return _TEMPLATES[learnable_property]


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, high bit depths scaled to 0-255 rather than clipped.

    Pillow's ``convert("RGB")`` clips the values of 16- and 32-bit grey pictures (modes ``I;16*``
    and ``I``) at 255, so a 16-bit grey PNG became almost all white. Those are scaled from 16 bits
    (or from 8 bits if no value exceeds 255); float pictures (``F``) from 0-1 if no value exceeds
    1, else clipped to 0-255. Every other mode (palette, grey, CMYK, with alpha) converts as
    diffusers' script converts it.
    """
    if not (image.mode == "I" or image.mode == "F" or image.mode.startswith("I;16")):
        return image.convert("RGB")
    values = np.asarray(image, dtype=np.float64)
    top = float(values.max()) if values.size else 0.0
    if image.mode == "F":
        scale = 255.0 if top <= 1.0 else 1.0
    elif image.mode.startswith("I;16") or top > 255:
        scale = 255.0 / 65535.0 if top <= 65535 else 255.0 / top
    else:
        scale = 1.0
    grey = np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)
    return Image.fromarray(grey, "L").convert("RGB")


class ConceptImagesWarning(UserWarning):
    """The concept folder is usable but not as given: files skipped, or pictures that will be resized up."""


class ImageFolderError(InputError):
    """A concept-image folder cannot be used; the one-line message lists every problem and the fix.

    Attributes:
        path: the folder that was checked.
        problems: ``(file or folder, problem)`` pairs, one per problem found.
    """

    def __init__(self, path: Path, problems: list[tuple[Path, str]], fix: str):
        self.path = path
        self.problems = problems
        listed = "; ".join(f"{p.name if p != path else str(p)}: {why}" for p, why in problems)
        super().__init__(
            f"Image folder {os.path.abspath(path)!r} cannot be used for training: {listed}. Fix: {fix}"
        )


def sample_concept_dir() -> Path:
    """The folder of the bundled sample concept: five pictures of a made-up toy robot-duck.

    Returns:
        ``helpers/assets/sample_concept`` inside the installed package.
    """
    return Path(__file__).resolve().parent.parent / "assets" / "sample_concept"


SAMPLE = "sample"


def resolve_concept(concept: str | os.PathLike, min_size: int = 0) -> Path:
    """Turn ``"sample"``, a local folder or a Hub concept repo id into a validated image folder.

    Args:
        concept: ``"sample"`` (the bundled toy), a folder of images, or a Hub repo id such as
            ``sd-concepts-library/dicoo`` (downloaded into ``concepts/``).
        min_size: the training resolution: smaller pictures are named in one warning (they are
            resized up, as diffusers does).

    Returns:
        The folder of images.
    """
    name = os.fspath(concept)
    if name == SAMPLE:
        folder = sample_concept_dir()
    elif classify_source(name) in ("folder", "missing_path"):
        folder = Path(name).expanduser()
    else:
        folder = download_concept(name)
    validate_image_folder(folder, min_size=min_size)
    return folder


def _open_picture(file: Path) -> tuple[str, tuple[int, int] | str | None]:
    """``("image", (w, h))``, ``("not_image", None)`` or ``("problem", why)`` for one file.

    A file is a picture if Pillow recognises it, whatever its name (diffusers' script opens every
    file); one that claims a picture's extension but is not one, is empty or cannot be read is a
    problem.
    """
    claims_image = file.suffix.lower() in IMAGE_EXTENSIONS
    try:
        size = file.stat().st_size
        if size == 0:
            return ("problem", "empty file (0 bytes)") if claims_image else ("not_image", None)
        # verify() checks structure without decoding pixels and leaves the file unusable,
        # so reopen and load() to catch truncated pixel data too.
        with Image.open(file) as img:
            img.verify()
        with Image.open(file) as img:
            img.load()
            return "image", img.size
    except UnidentifiedImageError:
        if claims_image:
            return "problem", "not a readable image (Pillow does not recognise its content)"
        return "not_image", None
    except OSError as err:
        if err.errno is not None:  # the file itself could not be read (permissions, I/O)
            return "problem", f"cannot be read ({err.strerror})"
        return "problem", f"corrupt or truncated image ({type(err).__name__}: {err})"
    except Exception as err:  # any other decoder failure means the file cannot be trained on
        return "problem", f"corrupt or truncated image ({type(err).__name__}: {err})"


def _folder_entries(folder: Path, max_files: int | None) -> list[Path]:
    """The entries of a concept folder, sorted; :class:`ImageFolderError` if it cannot be one."""
    if not folder.exists():
        raise ImageFolderError(
            folder,
            [(folder, "does not exist")],
            "pass the folder that holds the concept images, e.g. helpers.training.data.sample_concept_dir() "
            "or the folder returned by helpers.training.data.download_concept().",
        )
    if not folder.is_dir():
        raise ImageFolderError(
            folder,
            [(folder, "is a file, not a folder")],
            "pass the folder that contains this image, not the image.",
        )
    try:
        entries = sorted(folder.iterdir())
    except PermissionError:
        raise ImageFolderError(
            folder, [(folder, "cannot be read (permission denied)")], "check the folder's permissions."
        ) from None
    if max_files is not None and len(entries) > max_files:
        too_many = f"holds {len(entries):,} entries, more than the {max_files:,} a concept folder may hold"
        raise ImageFolderError(
            folder,
            [(folder, too_many)],
            "a concept is learned from a handful of pictures (3-5 are usual), and every file is read before "
            "the first step: copy a few pictures of it into a folder of their own and pass that.",
        )
    return entries


def validate_image_folder(
    path: str | os.PathLike, min_size: int = 0, max_files: int | None = MAX_CONCEPT_FILES
) -> list[Path]:
    """Check a folder of training images and return them; never writes anything.

    Accepts what diffusers' script accepts, and refuses only what cannot work. Every picture is
    fully decoded, so corrupt and truncated files are found here rather than in the middle of
    training. Files that are not pictures (``README.md``, ``.DS_Store``, ``notes.txt``) are
    skipped, named in one :class:`ConceptImagesWarning` (diffusers' script would crash on them).
    Pictures smaller than ``min_size`` are kept, named in one warning: training resizes them up,
    as diffusers does. Subfolders are not searched.

    Args:
        path: the folder holding the concept images.
        min_size: the training resolution (0: no size warning).
        max_files: most files the folder may hold (:data:`MAX_CONCEPT_FILES`; None: any number).

    Returns:
        The pictures, sorted by name.

    Raises:
        ImageFolderError: the folder is missing or a file, holds no picture, more than ``max_files``
            files, or files that claim to be pictures but are empty, corrupt or unreadable (every
            one listed, with the fix).
    """
    folder = Path(path)
    entries = _folder_entries(folder, max_files)
    subfolders = [p for p in entries if p.is_dir() and not p.name.startswith(".")]
    images: list[Path] = []
    small: list[str] = []
    skipped: list[str] = []
    problems: list[tuple[Path, str]] = []
    for file in (p for p in entries if not p.is_dir()):
        kind, detail = _open_picture(file)
        if kind == "problem":
            problems.append((file, detail))
        elif kind == "not_image":
            skipped.append(file.name)
        else:
            images.append(file)
            if min(detail) < min_size:
                small.append(f"{file.name} ({detail[0]}x{detail[1]})")
    if problems:
        raise ImageFolderError(
            folder,
            problems,
            "remove or replace the files listed above (pictures Pillow can read: PNG, JPEG, WebP, BMP, GIF, "
            "TIFF, ...).",
        )
    if not images:
        names = ", ".join(p.name for p in subfolders)
        hint = f" It has subfolders ({names}): point to the one holding the images." if subfolders else ""
        others = f" (only files that are not pictures: {', '.join(skipped)})" if skipped else ""
        raise ImageFolderError(
            folder,
            [(folder, "contains no images" + others)],
            "put 3-5 pictures of the concept in it, or use helpers.training.data.sample_concept_dir()."
            + hint,
        )
    if skipped:
        warnings.warn(
            f"{folder}: skipped {len(skipped)} file(s) that are not pictures: {', '.join(skipped)}",
            ConceptImagesWarning,
            stacklevel=1,  # this line: Python shows a message once per line, however many callers check
        )
    if small:
        warnings.warn(
            f"{folder}: {len(small)} picture(s) smaller than the training resolution {min_size} px will be "
            f"resized up (softer detail): {', '.join(small)}",
            ConceptImagesWarning,
            stacklevel=1,  # this line: Python shows a message once per line, however many callers check
        )
    return images


def download_concept(
    repo_id: str = DEFAULT_CONCEPT_REPO,
    dest: str | os.PathLike | None = None,
    revision: str | None = None,
    force: bool = False,
) -> Path:
    """Download the training images of a concept from the Hugging Face Hub.

    Only ``concept_images/*`` is fetched (the layout of the sd-concepts-library repos), not the
    learned embedding. Images already present in ``dest`` are reused without contacting the
    Hub, so a workshop can download once and then run offline.

    Args:
        repo_id: a Hub model repo with a ``concept_images/`` folder, e.g. ``sd-concepts-library/dicoo``.
        dest: local folder for the download; default ``concepts/<repo name>`` in the working directory.
        revision: branch, tag or commit of the repo; default its main branch.
        force: download again even if images are already present.

    Returns:
        The folder of images (``dest/concept_images``), validated.

    Raises:
        helpers.training.models.HubUnavailableError: the Hub cannot be reached (fails within seconds).
        ImageFolderError: the repo has no usable images under ``concept_images/``.
    """
    dest = Path(dest) if dest is not None else Path("concepts") / repo_id.split("/")[-1]
    images_dir = dest / CONCEPT_IMAGES_SUBDIR
    if (
        not force
        and images_dir.is_dir()
        and any(p.suffix.lower() in IMAGE_EXTENSIONS for p in images_dir.iterdir())
    ):
        logger.info("using the concept images already in %s", images_dir)
        validate_image_folder(images_dir)
        return images_dir
    # Without this check, huggingface_hub retries for a long time on a machine with no route.
    models.ensure_hub_reachable(
        what=f"downloading the concept images of {repo_id!r}",
        fix="train on the bundled sample instead: train_data_dir=helpers.training.data.sample_concept_dir()",
    )
    # imported here: 0.45 s CPU on top of this module (measured with time.process_time), which every
    # importer (helpers.toyworld, the validate command) would pay; only a download needs it (and
    # tests/training/test_data.py patches huggingface_hub.snapshot_download, read at call time here)
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id,
        repo_type="model",
        revision=revision,
        local_dir=dest,
        allow_patterns=[f"{CONCEPT_IMAGES_SUBDIR}/*"],
        force_download=force,
    )
    images = validate_image_folder(images_dir)
    logger.info("downloaded %d concept images of %s into %s", len(images), repo_id, images_dir)
    return images_dir


def picture_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(height, width)`` of a picture as the trainers load it (after its EXIF rotation).

    Reads the file's header only: an EXIF orientation of 5 to 8 turns the picture a quarter.
    """
    with Image.open(path) as img:
        width, height = img.size
        if img.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8):
            width, height = height, width
    return height, width


def _ids(tokenizer, prompt: str) -> torch.Tensor:
    """A prompt's ids padded (and truncated) to the tokenizer's full length, as the pipelines read it."""
    return tokenizer(
        prompt,
        padding="max_length",
        truncation=True,
        max_length=tokenizer.model_max_length,
        return_tensors="pt",
    ).input_ids[0]


class ConceptDataset(torch.utils.data.Dataset):
    """The textual-inversion training set: (view of a concept image, prompt with the placeholder).

    Item ``i`` uses image ``i % len(images)``; its template and flip are drawn from a
    ``random.Random`` seeded by ``(seed, i)``. Pixels are not in the item: the item names a
    view (image, flipped or not), whose pixels :meth:`view_pixels` returns (decoded once, cached).

    Args:
        data_root: folder of concept images (checked with :func:`validate_image_folder`).
        tokenizer: a CLIP tokenizer that already knows the placeholder token(s).
        placeholder_text: what stands for the concept in prompts; several tokens for
            multi-vector concepts, e.g. ``"<dicoo> <dicoo>_1"``.
        learnable_property: ``"object"`` or ``"style"`` (chooses the prompt templates).
        size: side of the square training images in pixels.
        repeats: how many times each image appears per epoch.
        center_crop: crop to the centred square of the shorter side before resizing.
        flip_p: probability of a horizontal flip.
        seed: seed of the per-item template and flip choices.
        tokenizer_2: SDXL's second tokenizer (with the placeholder tokens too): each item then also
            holds ``input_ids_2``, the same prompt in its ids.
    """

    def __init__(
        self,
        data_root: str | os.PathLike,
        tokenizer,
        placeholder_text: str,
        learnable_property: str = "object",
        size: int = 512,
        repeats: int = 100,
        center_crop: bool = False,
        flip_p: float = 0.5,
        seed: int = 0,
        tokenizer_2=None,
    ):
        if learnable_property not in _TEMPLATES:
            raise ValueError(
                f"learnable_property={learnable_property!r} is not supported: use 'object' or 'style'."
            )
        if size < 1 or repeats < 1:
            raise ValueError(f"size ({size}) and repeats ({repeats}) must be at least 1.")
        if not 0.0 <= flip_p <= 1.0:
            raise ValueError(f"flip_p={flip_p} is not a probability: use a value between 0 and 1.")
        if not placeholder_text.strip():
            raise ValueError("placeholder_text is empty: pass the placeholder token(s), e.g. '<dicoo>'.")
        self.images = validate_image_folder(data_root, min_size=0)  # before any tokenizer or pixel work
        self.data_root = Path(data_root)
        self.tokenizer = tokenizer
        self.tokenizer_2 = tokenizer_2
        self.placeholder_text = placeholder_text
        self.learnable_property = learnable_property
        self.templates = _TEMPLATES[learnable_property]
        self.size = size
        self.repeats = repeats
        self.center_crop = center_crop
        self.flip_p = flip_p
        self.seed = seed
        self._n_flip = 2 if flip_p > 0 else 1
        self._views: dict[int, torch.Tensor] = {}

    @property
    def num_views(self) -> int:
        """Number of distinct pixel variants: each image, and its mirror image if flips happen."""
        return len(self.images) * self._n_flip

    def __len__(self) -> int:
        return len(self.images) * self.repeats

    def _rng(self, i: int) -> random.Random:
        # A string seed is hashed with SHA-512 by random.seed: stable across processes and
        # Python runs, unlike hash() of a tuple.
        return random.Random(f"ConceptDataset:{self.seed}:{i}")

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for a dataset of {len(self)} items")
        i %= len(self)
        rng = self._rng(i)
        prompt = rng.choice(self.templates).format(self.placeholder_text)
        flipped = rng.random() < self.flip_p  # same rule as torchvision's RandomHorizontalFlip
        view_index = (i % len(self.images)) * self._n_flip + int(flipped)
        item = {"view_index": view_index, "input_ids": _ids(self.tokenizer, prompt), "prompt": prompt}
        if self.tokenizer_2 is not None:
            item["input_ids_2"] = _ids(self.tokenizer_2, prompt)
        return item

    def view_pixels(self, view_index: int) -> torch.FloatTensor:
        """Pixels of one view, as the UNet's VAE expects them.

        Args:
            view_index: ``image_index * n_flip + flipped``, where ``n_flip`` is 2 if flips happen.

        Returns:
            A float32 tensor ``[3, size, size]`` with values in [-1, 1]. It is the cached
            tensor itself: do not modify it in place.
        """
        if view_index not in self._views:
            self._views[view_index] = self._load_view(*self.view_source(view_index))
        return self._views[view_index]

    def view_source(self, view_index: int) -> tuple[Path, bool]:
        """The image file a view shows, and whether it is mirrored.

        Raises:
            IndexError: no such view.
        """
        if not 0 <= view_index < self.num_views:
            raise IndexError(f"view {view_index} out of range: this dataset has {self.num_views} views")
        image_index, flipped = divmod(view_index, self._n_flip)
        return self.images[image_index], bool(flipped)

    def original_size(self, view_index: int) -> tuple[int, int]:
        """``(height, width)`` of the picture a view shows, as loaded (:func:`picture_size`)."""
        return picture_size(self.view_source(view_index)[0])

    def _load_view(self, path: Path, flipped: bool) -> torch.Tensor:
        with Image.open(path) as img:
            # Phone photos store their rotation in EXIF; without this the concept trains sideways.
            image = to_rgb(ImageOps.exif_transpose(img))
        if self.center_crop:
            w, h = image.size
            crop = min(w, h)
            left, top = (w - crop) // 2, (h - crop) // 2
            image = image.crop((left, top, left + crop, top + crop))
        image = image.resize((self.size, self.size), resample=Image.Resampling.BICUBIC)
        if flipped:  # after the resize, as diffusers does, so a flipped view mirrors its twin exactly
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the ``python -m helpers.training.data`` command line."""
    parser = ArgumentParser(prog="python -m helpers.training.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    download = sub.add_parser("download", help="download the images of a concept from the Hub")
    download.add_argument("--repo_id", default=DEFAULT_CONCEPT_REPO)
    download.add_argument("--dest", type=Path, default=None)
    download.add_argument("--revision", default=None)
    validate = sub.add_parser("validate", help="check a folder of concept images")
    validate.add_argument("path", type=Path)
    validate.add_argument(
        "--min_size", type=int, default=0, help="training resolution: smaller pictures are named"
    )
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> list[Path] | Path:
    """Run one ``python -m helpers.training.data`` command; returns the files or folder it produced or checked."""
    if args.command == "download":
        return download_concept(args.repo_id, args.dest, revision=args.revision)
    return validate_image_folder(args.path, min_size=args.min_size)


def cli(argv: Sequence[str] | None = None) -> int:
    """Entry point: print what was produced or checked; bad input exits 2 with one ``error:`` line."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def run(args: argparse.Namespace) -> None:
        result = main(args)
        for item in result if isinstance(result, list) else [result]:
            print(item)

    return run_cli(
        run, parse_args, list(argv) if argv is not None else None, also=(models.HubUnavailableError,)
    )


if __name__ == "__main__":
    raise SystemExit(cli())

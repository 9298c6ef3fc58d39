"""DreamBooth's training pairs: a subject picture and, with prior preservation, a class picture.

As in diffusers' ``DreamBoothDataset``, item ``i`` pairs subject picture ``i % subjects`` with
class picture ``i % classes``, and an epoch has ``max(subjects, classes)`` items (``subjects``
without prior preservation). Every picture is resized (shorter side to ``resolution``) and
centre-cropped once: it becomes one *view* whose latent the engine encodes once and caches
(:func:`helpers.training.engine.step.cache_latents` takes any object with ``num_views`` and
``view_pixels``). An item names views, not pixels: instance views come first, then class views.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from helpers.training.data import picture_size, to_rgb
from helpers.training.families import ImageSizes


def view_sizes(path: str | os.PathLike, size: int) -> ImageSizes:
    """The sizes SDXL's UNet is told of a picture made into a view by :func:`load_view`: its own
    ``(height, width)``, the top-left of the centred crop in the resized picture, ``(size, size)``.
    Reads the file's header only."""
    height, width = picture_size(path)
    scale = size / min(width, height)
    resized_w, resized_h = max(size, round(width * scale)), max(size, round(height * scale))
    return ImageSizes((height, width), ((resized_h - size) // 2, (resized_w - size) // 2), (size, size))


def load_view(path: str | os.PathLike, size: int) -> torch.Tensor:
    """One picture as the VAE takes it: shorter side resized to ``size`` (bilinear, as diffusers),
    centre-cropped to ``size`` x ``size``, RGB in [-1, 1], float32 ``[3, size, size]``."""
    with Image.open(path) as img:
        image = to_rgb(ImageOps.exif_transpose(img))  # phone photos store their rotation in EXIF
    scale = size / min(image.size)
    resized = (max(size, round(image.width * scale)), max(size, round(image.height * scale)))
    image = image.resize(resized, resample=Image.Resampling.BILINEAR)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    pixels = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


class ImageViews:
    """The pictures of one folder as views (one per picture), decoded on demand."""

    def __init__(self, images: Sequence[str | os.PathLike], size: int):
        self.images = [Path(p) for p in images]
        self.size = size

    @property
    def num_views(self) -> int:
        return len(self.images)

    def view_pixels(self, view_index: int) -> torch.Tensor:
        """Pixels of picture ``view_index`` (see :func:`load_view`)."""
        return load_view(self.images[view_index], self.size)

    def sizes(self) -> list[ImageSizes]:
        """Every view's sizes, as SDXL's UNet is told them (:func:`view_sizes`)."""
        return [view_sizes(path, self.size) for path in self.images]


class DreamBoothPairs(torch.utils.data.Dataset):
    """Items ``{"index", "instance_view", "class_view"}``; class views are numbered after the instance views.

    Args:
        num_instance: subject pictures.
        num_class: class pictures (0: no prior preservation; ``class_view`` is then -1).
    """

    def __init__(self, num_instance: int, num_class: int = 0):
        if num_instance < 1:
            raise ValueError(f"num_instance={num_instance}: need at least one subject picture")
        self.num_instance, self.num_class = num_instance, num_class

    def __len__(self) -> int:
        return max(self.num_instance, self.num_class)

    def __getitem__(self, i: int) -> dict[str, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} items")
        class_view = self.num_instance + i % self.num_class if self.num_class else -1
        return {"index": i, "instance_view": i % self.num_instance, "class_view": class_view}

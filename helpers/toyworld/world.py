"""The procedural toy world: captioned 64 px scenes of toys, drawn from parts, and Pip.

A scene is one toy (a *kind* in a *colour*, *small* or *big*, somewhere left to right) on a
*background*. Everything is drawn with Pillow primitives at 4x the output size and downsampled
(anti-aliased edges), from a scene description and one seeded ``random.Random`` for texture
details, so a render is a pure function of its scene and seed.

Captions are ordinary words the real CLIP tokenizer knows ("a photo of a small red duck on the
grass"), put into the same sentence templates the textual-inversion script uses, with parts
left out at random so that every word also works on its own.

**Pip**, the bundled concept, is a teal duck. The world has ducks in every other colour and teal
toys of every other kind, but never a teal duck: the generator never sees Pip, yet Pip is made of
parts it knows, so one new word can describe it (which is what Textual Inversion is for).
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

from helpers.core.files import write_file_atomic
from helpers.training.data import imagenet_templates_small

SIZE = 64  # the world's native resolution
_SUPERSAMPLE = 4

KINDS = ("ball", "duck", "car", "robot", "bear")
COLOURS = {
    "red": (214, 40, 48),
    "yellow": (250, 204, 30),
    "teal": (24, 160, 150),
    "blue": (44, 92, 226),
    "purple": (132, 66, 196),
    "pink": (255, 140, 190),
}
SIZES = ("small", "big")
BACKGROUNDS = ("table", "grass", "sky", "blanket")
_PLACE = {"table": "on the table", "grass": "on the grass", "sky": "in the sky", "blanket": "on the blanket"}

PIP_KIND, PIP_COLOUR = "duck", "teal"
PIP = "pip"  # the judge's class name for Pip
GENERIC_NOUN = "toy"  # what a caption says when it leaves the kind out (and Pip's initializer word)

INK = (34, 30, 40)
WHITE = (255, 255, 255)
ORANGE = (255, 138, 20)
# The textual-inversion script's templates (so its prompts are in-distribution), minus those that
# name a size: a scene's size is its own caption word.
_TEMPLATES = tuple(t for t in imagenet_templates_small if not re.search(r"\b(small|large)\b", t))


@dataclass(frozen=True)
class Scene:
    """One picture of the world: which toy, how it looks, where it is."""

    kind: str
    colour: str
    size: str
    background: str
    x: float = 0.5  # centre of the toy, as a fraction of the width
    mirror: bool = False

    @property
    def is_pip(self) -> bool:
        return (self.kind, self.colour) == (PIP_KIND, PIP_COLOUR)

    @property
    def label(self) -> str:
        """The judge's object class: the kind, or ``pip`` for a teal duck."""
        return PIP if self.is_pip else self.kind


def random_scene(rng: random.Random, with_pip: bool = False) -> Scene:
    """Draw a scene uniformly over the world's parts (Pip only if ``with_pip``)."""
    while True:
        scene = Scene(
            kind=rng.choice(KINDS),
            colour=rng.choice(list(COLOURS)),
            size=rng.choice(SIZES),
            background=rng.choice(BACKGROUNDS),
            x=rng.uniform(0.32, 0.68),
            mirror=rng.random() < 0.5,
        )
        if with_pip or not scene.is_pip:
            return scene


def caption(scene: Scene, rng: random.Random) -> str:
    """A caption in plain words; parts are left out at random so each word also works alone.

    The kind becomes "toy" one time in six, the colour, size and place are each left out one
    time in four; one caption in ten is empty (what classifier-free guidance needs).
    """
    if rng.random() < 0.1:
        return ""
    words = []
    if rng.random() < 0.75:
        words.append(scene.size)
    if rng.random() < 0.75:
        words.append(scene.colour)
    words.append(GENERIC_NOUN if rng.random() < 1 / 6 else scene.kind)
    text = rng.choice(_TEMPLATES).format(" ".join(words))
    if rng.random() < 0.75:
        text += " " + _PLACE[scene.background]
    return text


def full_caption(scene: Scene) -> str:
    """The plain caption that names every part: "a photo of a big red car on the grass"."""
    return f"a photo of a {scene.size} {scene.colour} {scene.kind} {_PLACE[scene.background]}"


# --- drawing -----------------------------------------------------------------------------------


def _shade(rgb: tuple[int, int, int], f: float) -> tuple[int, int, int]:
    """Darker (f < 1) or lighter (f > 1) version of a colour."""
    if f <= 1:
        return tuple(round(c * f) for c in rgb)
    return tuple(round(c + (255 - c) * (f - 1)) for c in rgb)


def _ellipse(d: ImageDraw.ImageDraw, cx: float, cy: float, rx: float, ry: float, **kw) -> None:
    d.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), **kw)


def _gradient(top: tuple[int, int, int], bottom: tuple[int, int, int], n: int) -> Image.Image:
    img = Image.new("RGB", (n, n))
    d = ImageDraw.Draw(img)
    for y in range(n):
        t = y / (n - 1)
        d.line((0, y, n, y), fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)))
    return img


def _background(kind: str, n: int, rng: random.Random) -> tuple[Image.Image, float]:
    """The background on an ``n`` px canvas and the height (fraction) where a toy stands."""
    if kind == "table":
        img = _gradient((238, 228, 212), (216, 202, 184), n)
        d = ImageDraw.Draw(img)
        top = int(n * 0.62)
        d.rectangle((0, top, n, n), fill=(170, 110, 62))
        for _ in range(24):  # wood grain
            y, s = rng.uniform(top, n), rng.randint(-24, 10)
            d.line((0, y, n, y + rng.uniform(-4, 4)), fill=(170 + s, 110 + s, 62 + s), width=max(1, n // 90))
        d.line((0, top, n, top), fill=(110, 70, 40), width=max(1, n // 60))
        return img, 0.8
    if kind == "grass":
        # A meadow under a hazy green treeline, no blue: with half a sky above the grass (an
        # earlier build) the generator learned "grass" as a kind of "sky" and drew sky for it.
        img = _gradient((104, 140, 76), (150, 186, 104), n)
        d = ImageDraw.Draw(img)
        top = int(n * 0.3)
        d.rectangle((0, top, n, n), fill=(96, 176, 60))
        for _ in range(160):  # blades
            x, y, g = rng.uniform(0, n), rng.uniform(top, n), rng.randint(120, 200)
            d.line((x, y, x + rng.uniform(-3, 3) * n / 64, y - rng.uniform(3, 7) * n / 64), fill=(48, g, 36),
                   width=max(1, n // 120))  # fmt: skip
        return img, 0.8
    if kind == "sky":
        img = _gradient((96, 166, 240), (200, 226, 255), n)
        d = ImageDraw.Draw(img)
        for _ in range(3):  # clouds
            cx, cy, r = rng.uniform(0.05, 0.95) * n, rng.uniform(0.1, 0.9) * n, rng.uniform(0.06, 0.1) * n
            for k in range(4):
                _ellipse(
                    d, cx + (k - 1.5) * r * 0.8, cy + rng.uniform(-0.3, 0.3) * r, r, r * 0.65, fill=WHITE
                )
        return img.filter(ImageFilter.GaussianBlur(n / 256)), 0.62
    if kind == "blanket":
        img = Image.new("RGB", (n, n), (236, 226, 196))  # cream with red checks
        d = ImageDraw.Draw(img)
        step = n / 6
        for i in range(7):
            d.rectangle((i * step, 0, i * step + step / 3, n), fill=(200, 72, 72))
            d.rectangle((0, i * step, n, i * step + step / 3), fill=(200, 72, 72))
        return img, 0.78
    raise ValueError(f"unknown background {kind!r}: choose one of {', '.join(BACKGROUNDS)}")


def _draw_toy(
    d: ImageDraw.ImageDraw, kind: str, rgb: tuple[int, int, int], cx: float, base: float, h: float
) -> None:
    """Draw a toy of height ``h`` standing on ``base`` (its lowest point), centred at ``cx``."""
    w = max(1.0, h / 28)  # outline width
    dark, light = _shade(rgb, 0.7), _shade(rgb, 1.45)
    top = base - h
    if kind == "ball":
        r = h / 2
        cy = base - r
        _ellipse(d, cx, cy, r, r, fill=rgb, outline=INK, width=round(w))
        d.chord((cx - r, cy - r * 0.28, cx + r, cy + r * 0.28), 0, 360, fill=WHITE)
        d.line((cx - r, cy, cx + r, cy), fill=INK, width=round(w))
        _ellipse(d, cx - r * 0.4, cy - r * 0.5, r * 0.18, r * 0.13, fill=light)
    elif kind == "duck":
        # body (a wide egg), tail to the left, head up right, beak pointing right
        _ellipse(d, cx - h * 0.05, base - h * 0.3, h * 0.52, h * 0.3, fill=rgb, outline=INK, width=round(w))
        d.polygon([(cx - h * 0.62, base - h * 0.52), (cx - h * 0.4, base - h * 0.42), (cx - h * 0.5, base - h * 0.3)],
                  fill=rgb, outline=INK)  # fmt: skip
        _ellipse(d, cx - h * 0.1, base - h * 0.32, h * 0.24, h * 0.13, fill=dark)  # wing
        _ellipse(d, cx + h * 0.22, top + h * 0.3, h * 0.26, h * 0.26, fill=rgb, outline=INK, width=round(w))
        d.polygon([(cx + h * 0.42, top + h * 0.26), (cx + h * 0.7, top + h * 0.33), (cx + h * 0.42, top + h * 0.42)],
                  fill=ORANGE, outline=INK)  # fmt: skip
        _ellipse(d, cx + h * 0.28, top + h * 0.24, h * 0.06, h * 0.06, fill=INK)
    elif kind == "car":
        body_top = base - h * 0.62
        d.rounded_rectangle((cx - h * 0.8, body_top, cx + h * 0.8, base - h * 0.2), radius=h * 0.12, fill=rgb,
                            outline=INK, width=round(w))  # fmt: skip
        d.polygon([(cx - h * 0.45, body_top), (cx - h * 0.28, top), (cx + h * 0.32, top), (cx + h * 0.5, body_top)],
                  fill=rgb, outline=INK)  # fmt: skip
        d.polygon([(cx - h * 0.33, body_top), (cx - h * 0.2, top + h * 0.1), (cx + h * 0.25, top + h * 0.1),
                   (cx + h * 0.38, body_top)], fill=(190, 226, 250))  # fmt: skip
        for dx in (-0.48, 0.48):
            _ellipse(d, cx + dx * h, base - h * 0.2, h * 0.2, h * 0.2, fill=INK)
            _ellipse(d, cx + dx * h, base - h * 0.2, h * 0.08, h * 0.08, fill=(190, 190, 190))
    elif kind == "robot":
        d.line((cx, top + h * 0.2, cx, top + h * 0.05), fill=INK, width=round(w * 1.5))  # antenna
        _ellipse(d, cx, top + h * 0.05, h * 0.06, h * 0.06, fill=(230, 40, 40))
        d.rectangle((cx - h * 0.25, top + h * 0.18, cx + h * 0.25, top + h * 0.48), fill=rgb, outline=INK,
                    width=round(w))  # fmt: skip
        for dx in (-0.11, 0.11):
            _ellipse(d, cx + dx * h, top + h * 0.32, h * 0.06, h * 0.06, fill=WHITE, outline=INK)
        d.rectangle((cx - h * 0.32, top + h * 0.5, cx + h * 0.32, base - h * 0.12), fill=rgb, outline=INK,
                    width=round(w))  # fmt: skip
        d.rectangle((cx - h * 0.16, top + h * 0.6, cx + h * 0.16, top + h * 0.74), fill=dark)  # panel
        for dx in (-0.18, 0.18):  # legs
            d.rectangle(
                (cx + dx * h - h * 0.07, base - h * 0.13, cx + dx * h + h * 0.07, base), fill=(120, 120, 130)
            )
    elif kind == "bear":
        _ellipse(d, cx, base - h * 0.25, h * 0.3, h * 0.25, fill=rgb, outline=INK, width=round(w))  # body
        for dx in (-0.2, 0.2):
            _ellipse(d, cx + dx * h, top + h * 0.12, h * 0.1, h * 0.1, fill=rgb, outline=INK, width=round(w))
        _ellipse(d, cx, top + h * 0.32, h * 0.25, h * 0.23, fill=rgb, outline=INK, width=round(w))  # head
        _ellipse(d, cx, top + h * 0.4, h * 0.11, h * 0.08, fill=light)  # muzzle
        _ellipse(d, cx, top + h * 0.37, h * 0.04, h * 0.03, fill=INK)
        for dx in (-0.09, 0.09):
            _ellipse(d, cx + dx * h, top + h * 0.27, h * 0.03, h * 0.03, fill=INK)
    else:
        raise ValueError(f"unknown kind {kind!r}: choose one of {', '.join(KINDS)}")


def render(scene: Scene, size: int = SIZE, seed: int = 0) -> Image.Image:
    """Draw ``scene`` as an RGB image of ``size`` x ``size`` pixels.

    Args:
        scene: what to draw.
        size: side in pixels (the world's native size is 64; larger renders look the same, sharper).
        seed: seed of the texture details (wood grain, grass blades, clouds).
    """
    if scene.colour not in COLOURS:
        raise ValueError(f"unknown colour {scene.colour!r}: choose one of {', '.join(COLOURS)}")
    n = size * _SUPERSAMPLE
    rng = random.Random(f"toyworld:{seed}:{scene}")
    img, ground = _background(scene.background, n, rng)
    h = n * (0.36 if scene.size == "small" else 0.56)
    base = n * ground + (h * 0.5 if scene.background == "sky" else 0.0)  # floating toys sit lower
    layer = Image.new("RGBA", (n, n), (0, 0, 0, 0))
    _draw_toy(ImageDraw.Draw(layer), scene.kind, COLOURS[scene.colour], scene.x * n, min(base, n * 0.97), h)
    if scene.mirror:
        layer = layer.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if scene.background != "sky":  # a soft contact shadow so the toy stands on the surface
        shadow = Image.new("L", (n, n), 0)
        cx = (1 - scene.x if scene.mirror else scene.x) * n
        _ellipse(ImageDraw.Draw(shadow), cx, min(base, n * 0.97), h * 0.5, h * 0.07, fill=90)
        img = Image.composite(
            Image.new("RGB", (n, n), (30, 30, 30)), img, shadow.filter(ImageFilter.GaussianBlur(n / 80))
        )
    canvas = img.convert("RGBA")
    canvas.alpha_composite(layer)
    return canvas.convert("RGB").resize((size, size), Image.Resampling.LANCZOS)


# --- Pip, the bundled concept --------------------------------------------------------------------

PIP_SHOTS: dict[str, Scene] = {  # five pictures, as a person would take of their toy
    "01_table": Scene(PIP_KIND, PIP_COLOUR, "big", "table", x=0.5),
    "02_sky": Scene(PIP_KIND, PIP_COLOUR, "big", "sky", x=0.45, mirror=True),
    "03_grass_small": Scene(PIP_KIND, PIP_COLOUR, "small", "grass", x=0.36),
    "04_blanket": Scene(PIP_KIND, PIP_COLOUR, "big", "blanket", x=0.56, mirror=True),
    "05_table_small": Scene(PIP_KIND, PIP_COLOUR, "small", "table", x=0.62),
}
PIP_PICTURE_SIZE = 160


def pip_scene(rng: random.Random) -> Scene:
    """A random picture of Pip (the judge's Pip examples)."""
    return replace(random_scene(rng, with_pip=True), kind=PIP_KIND, colour=PIP_COLOUR)


def render_pip_pictures(dest: str | os.PathLike, seed: int = 0, size: int = PIP_PICTURE_SIZE) -> list[Path]:
    """Write the five pictures of Pip (the bundled sample concept) as PNG files into ``dest``.

    Each file is written under a temporary name and renamed, so an interrupted render never
    leaves a half-written picture.

    Returns:
        The written files, sorted by name.
    """
    dest = Path(dest)
    written = []
    for name, scene in PIP_SHOTS.items():
        image = render(scene, size=size, seed=seed)
        written.append(
            write_file_atomic(dest / f"{name}.png", lambda fh, im=image: im.save(fh, "PNG", optimize=True))
        )
    return sorted(written)

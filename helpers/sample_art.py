"""Draw the bundled sample concept: "Pip", a made-up little round robot-duck toy.

Every picture is drawn with Pillow primitives from fixed numbers and one seeded
``random.Random`` (no fonts, no system resources), so a re-render is pixel-identical to the
committed files. Shapes are drawn at 4x the output size and downsampled with a Lanczos filter,
which is what gives the edges their anti-aliasing.

Pip: a teal egg-shaped body with a cream belly and a red heart, big googly eyes, an orange
duck beak and feet, pink cheeks, stubby teal wings and a yellow antenna with a red bulb.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

logger = logging.getLogger(__name__)

OUTPUT_SIZE = 160  # pixels per side of each committed image
_SUPERSAMPLE = 4
_CANVAS = OUTPUT_SIZE * _SUPERSAMPLE
_SPRITE = 512  # the toy is drawn on a 512x512 transparent sprite, then placed on a background

TEAL = (38, 166, 154)
TEAL_DARK = (20, 112, 104)
CREAM = (255, 240, 205)
ORANGE = (255, 140, 26)
ORANGE_DARK = (214, 98, 10)
RED = (222, 45, 60)
YELLOW = (255, 210, 40)
PINK = (255, 150, 170)
INK = (30, 30, 40)
WHITE = (255, 255, 255)


@dataclass(frozen=True)
class Shot:
    """How the toy appears in one picture."""

    name: str
    background: str
    scale: float  # sprite height as a fraction of the canvas
    center: tuple[float, float]  # sprite centre, as fractions of the canvas
    angle: float  # degrees, counter-clockwise
    look: float  # pupil offset, -1 (looking left) .. 1 (looking right)
    mirror: bool = False
    wave: bool = False  # raise the right wing


SHOTS: tuple[Shot, ...] = (
    Shot("01_table", "table", scale=0.72, center=(0.5, 0.52), angle=0.0, look=0.0),
    Shot("02_sky_tilt", "sky", scale=0.60, center=(0.56, 0.50), angle=14.0, look=0.6, wave=True),
    Shot("03_grass_small", "grass", scale=0.42, center=(0.32, 0.62), angle=-6.0, look=-0.7, mirror=True),
    Shot("04_closeup", "wall", scale=1.05, center=(0.52, 0.62), angle=-4.0, look=0.3),
    Shot(
        "05_blanket",
        "blanket",
        scale=0.55,
        center=(0.62, 0.55),
        angle=-18.0,
        look=-0.4,
        mirror=True,
        wave=True,
    ),
)


def _ellipse(draw: ImageDraw.ImageDraw, cx: float, cy: float, rx: float, ry: float, **kw) -> None:
    draw.ellipse((cx - rx, cy - ry, cx + rx, cy + ry), **kw)


def _rotated_ellipse(
    draw: ImageDraw.ImageDraw,
    cx: float,
    cy: float,
    rx: float,
    ry: float,
    angle: float,
    fill,
    outline,
    width: int,
) -> None:
    a = math.radians(angle)
    pts = []
    for k in range(72):
        t = 2 * math.pi * k / 72
        x, y = rx * math.cos(t), ry * math.sin(t)
        pts.append((cx + x * math.cos(a) - y * math.sin(a), cy + x * math.sin(a) + y * math.cos(a)))
    draw.polygon(pts, fill=fill)
    draw.line(pts + pts[:1], fill=outline, width=width, joint="curve")


def draw_toy(look: float = 0.0, wave: bool = False) -> Image.Image:
    """Draw the toy facing the viewer on a transparent 512x512 RGBA sprite.

    Args:
        look: where the pupils point, from -1 (left) to 1 (right).
        wave: raise the right wing as if waving.

    Returns:
        The RGBA sprite; the toy's feet touch the bottom edge region, its bulb the top.
    """
    img = Image.new("RGBA", (_SPRITE, _SPRITE), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    cx = _SPRITE / 2
    # Antenna first so the body covers its base.
    d.line((cx, 150, cx + 18, 52), fill=YELLOW + (255,), width=14)
    _ellipse(d, cx + 20, 46, 26, 26, fill=RED + (255,), outline=INK + (255,), width=5)
    _ellipse(d, cx + 12, 38, 8, 8, fill=(255, 200, 200, 255))  # highlight on the bulb
    # Feet, behind the body.
    for dx in (-62, 62):
        _ellipse(d, cx + dx, 468, 54, 24, fill=ORANGE_DARK + (255,), outline=INK + (255,), width=5)
    # Wings.
    _ellipse(d, cx - 150, 310, 40, 70, fill=TEAL_DARK + (255,), outline=INK + (255,), width=6)
    if wave:
        _rotated_ellipse(d, cx + 175, 225, 40, 70, -40, TEAL_DARK + (255,), INK + (255,), 6)
    else:
        _ellipse(d, cx + 150, 310, 40, 70, fill=TEAL_DARK + (255,), outline=INK + (255,), width=6)
    # Body: an egg, slightly wider at the bottom, with a darker rim for depth.
    d.chord((cx - 160, 140, cx + 160, 470), 180, 360, fill=TEAL + (255,))
    d.ellipse((cx - 170, 240, cx + 170, 470), fill=TEAL + (255,))
    d.rectangle((cx - 160, 300, cx + 160, 320), fill=TEAL + (255,))
    d.arc((cx - 160, 140, cx + 160, 470), 180, 360, fill=INK + (255,), width=7)
    d.arc((cx - 170, 240, cx + 170, 470), 0, 180, fill=INK + (255,), width=7)
    d.line((cx - 160, 305, cx - 167, 345), fill=INK + (255,), width=7)
    d.line((cx + 160, 305, cx + 167, 345), fill=INK + (255,), width=7)
    _ellipse(d, cx - 95, 230, 30, 45, fill=(110, 210, 200, 255))  # glossy highlight
    # Belly panel with a heart.
    _ellipse(d, cx, 375, 100, 78, fill=CREAM + (255,), outline=INK + (255,), width=5)
    _ellipse(d, cx - 17, 365, 20, 20, fill=RED + (255,))
    _ellipse(d, cx + 17, 365, 20, 20, fill=RED + (255,))
    d.polygon([(cx - 36, 372), (cx + 36, 372), (cx, 410)], fill=RED + (255,))
    # Eyes: big white discs, pupils that follow `look`.
    for dx in (-58, 58):
        _ellipse(d, cx + dx, 222, 44, 48, fill=WHITE + (255,), outline=INK + (255,), width=6)
        px = cx + dx + 16 * look
        _ellipse(d, px, 230, 20, 22, fill=INK + (255,))
        _ellipse(d, px - 7, 222, 6, 6, fill=WHITE + (255,))
    # Cheeks and beak.
    for dx in (-108, 108):
        _ellipse(d, cx + dx, 282, 22, 13, fill=PINK + (255,))
    d.polygon([(cx - 46, 270), (cx + 46, 270), (cx, 318)], fill=ORANGE + (255,), outline=INK + (255,))
    d.line((cx - 46, 270, cx + 46, 270), fill=INK + (255,), width=5)
    d.line((cx - 46, 270, cx, 318), fill=INK + (255,), width=5)
    d.line((cx + 46, 270, cx, 318), fill=INK + (255,), width=5)
    d.line((cx - 30, 286, cx + 30, 286), fill=ORANGE_DARK + (255,), width=4)
    return img


def _vertical_gradient(top: tuple[int, int, int], bottom: tuple[int, int, int], size: int) -> Image.Image:
    img = Image.new("RGB", (size, size))
    d = ImageDraw.Draw(img)
    for y in range(size):
        t = y / (size - 1)
        d.line((0, y, size, y), fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)))
    return img


def draw_background(kind: str, rng: random.Random, size: int = _CANVAS) -> tuple[Image.Image, float]:
    """Draw one background.

    Args:
        kind: ``table``, ``sky``, ``grass``, ``wall`` or ``blanket``.
        rng: the seeded random source for texture details.
        size: side of the square canvas in pixels.

    Returns:
        The RGB background and the height (fraction of the canvas) of its floor line, where a
        shadow looks natural.
    """
    d_size = size
    if kind == "table":
        img = _vertical_gradient((236, 226, 210), (214, 200, 182), d_size)  # a pale wall
        d = ImageDraw.Draw(img)
        floor = int(d_size * 0.7)
        d.rectangle((0, floor, d_size, d_size), fill=(176, 118, 70))
        for _ in range(40):  # wood grain
            y = rng.randint(floor, d_size)
            shade = rng.randint(-22, 12)
            d.line(
                (0, y, d_size, y + rng.randint(-6, 6)), fill=(176 + shade, 118 + shade, 70 + shade), width=3
            )
        d.line((0, floor, d_size, floor), fill=(120, 78, 44), width=6)
        return img, 0.88
    if kind == "sky":
        img = _vertical_gradient((120, 180, 245), (205, 230, 255), d_size)
        d = ImageDraw.Draw(img)
        for cx, cy, r in ((0.18, 0.2, 0.09), (0.8, 0.14, 0.07), (0.7, 0.8, 0.1)):
            for k in range(5):
                ox = (k - 2) * r * 0.8 * d_size
                oy = rng.uniform(-0.3, 0.3) * r * d_size
                _ellipse(d, cx * d_size + ox, cy * d_size + oy, r * d_size, r * 0.7 * d_size, fill=WHITE)
        return img.filter(ImageFilter.GaussianBlur(2)), -1.0
    if kind == "grass":
        img = _vertical_gradient((170, 215, 250), (225, 240, 250), d_size)
        d = ImageDraw.Draw(img)
        horizon = int(d_size * 0.55)
        d.rectangle((0, horizon, d_size, d_size), fill=(92, 170, 70))
        for _ in range(500):  # blades of grass
            x = rng.uniform(0, d_size)
            y = rng.uniform(horizon, d_size)
            g = rng.randint(120, 200)
            d.line((x, y, x + rng.uniform(-8, 8), y - rng.uniform(10, 26)), fill=(50, g, 40), width=3)
        for _ in range(14):  # a few daisies
            x, y = rng.uniform(0, d_size), rng.uniform(horizon + 20, d_size)
            _ellipse(d, x, y, 10, 10, fill=WHITE)
            _ellipse(d, x, y, 4, 4, fill=YELLOW)
        return img, 0.85
    if kind == "wall":
        img = Image.new("RGB", (d_size, d_size), (250, 214, 222))  # pastel pink wall with polka dots
        d = ImageDraw.Draw(img)
        step = d_size // 6
        for row in range(7):
            for col in range(7):
                x = col * step + (step // 2 if row % 2 else 0)
                _ellipse(d, x, row * step, 12, 12, fill=(255, 236, 240))
        return img, -1.0
    if kind == "blanket":
        img = Image.new("RGB", (d_size, d_size), (58, 64, 120))  # navy checked blanket
        d = ImageDraw.Draw(img)
        step = d_size // 8
        for i in range(0, d_size, step):
            d.rectangle((i, 0, i + step // 3, d_size), fill=(78, 86, 150))
            d.rectangle((0, i, d_size, i + step // 3), fill=(78, 86, 150))
        # Woolly texture from the seeded rng (Image.effect_noise uses C rand(): not reproducible).
        noise = Image.frombytes("L", (d_size, d_size), rng.randbytes(d_size * d_size)).convert("RGB")
        img = Image.blend(img, noise, 0.08)
        return img, 0.9
    raise ValueError(f"unknown background {kind!r}: choose table, sky, grass, wall or blanket")


def render_shot(shot: Shot, seed: int = 0) -> Image.Image:
    """Render one picture of the toy at ``OUTPUT_SIZE`` pixels.

    Args:
        shot: pose, scale, position and background.
        seed: seed of the texture details.

    Returns:
        An RGB image of ``OUTPUT_SIZE`` x ``OUTPUT_SIZE`` pixels.
    """
    rng = random.Random(f"{seed}:{shot.name}")
    background, floor = draw_background(shot.background, rng)
    sprite = draw_toy(look=shot.look, wave=shot.wave)
    if shot.mirror:
        sprite = sprite.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    side = round(shot.scale * _CANVAS)
    sprite = sprite.resize((side, side), Image.Resampling.LANCZOS)
    sprite = sprite.rotate(shot.angle, resample=Image.Resampling.BICUBIC, expand=True)
    cx, cy = shot.center[0] * _CANVAS, shot.center[1] * _CANVAS
    if floor > 0:  # a soft contact shadow under the feet makes it sit on the surface
        shadow = Image.new("L", background.size, 0)
        foot_y = cy + side * 0.42 * math.cos(math.radians(shot.angle))
        _ellipse(ImageDraw.Draw(shadow), cx, foot_y, side * 0.36, side * 0.06, fill=120)
        shadow = shadow.filter(ImageFilter.GaussianBlur(10))
        background = Image.composite(Image.new("RGB", background.size, (20, 20, 20)), background, shadow)
    canvas = background.convert("RGBA")
    canvas.alpha_composite(sprite, (round(cx - sprite.width / 2), round(cy - sprite.height / 2)))
    return canvas.convert("RGB").resize((OUTPUT_SIZE, OUTPUT_SIZE), Image.Resampling.LANCZOS)


def render_sample_concept(dest: str | os.PathLike, seed: int = 0) -> list[Path]:
    """Render the five sample pictures of the toy as PNG files into ``dest``.

    Each file is written under a temporary name and then renamed, so an interrupted render
    never leaves a half-written image behind.

    Args:
        dest: folder to write into (created if missing). Existing files of the same name are replaced.
        seed: seed of the texture details; the committed images use 0.

    Returns:
        The written files, sorted by name.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for shot in SHOTS:
        path = dest / f"{shot.name}.png"
        # A plain open() (not mkstemp, which makes 0600 files) so the file gets the umask's mode.
        tmp = dest / f".{shot.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                render_shot(shot, seed).save(fh, format="PNG", optimize=True)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        written.append(path)
    logger.info("rendered %d sample images into %s", len(written), dest)
    return sorted(written)

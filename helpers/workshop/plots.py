"""Figures for the workshop: image grids, loss curves, timing charts.

Every function builds and returns a ``matplotlib.figure.Figure`` and never shows it. Figures
are closed in pyplot before they are returned: in a notebook the returned figure is displayed
once (as the cell's value), not a second time by the inline backend, and loops that make many
figures do not pile them up in pyplot's registry.

Every figure carries a one-line description of what it shows (its label, :func:`description`):
in a notebook it is the figure's text form beside the picture, which the handouts give as the
picture's alternative text, for a screen reader or a page whose images do not load.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter
from PIL import Image

from helpers.cluster import scaling
from helpers.core.files import write_path_atomic
from helpers.training.engine import events

__all__ = [
    "image_grid",
    "image_rows",
    "line_groups",
    "live_loss",
    "loss_curve",
    "moving_average",
    "save_figure",
    "timing_bars",
]


class _Figure(Figure):
    """A figure whose text form in IPython (``text/plain`` beside its PNG) is its :func:`description`."""

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(description(self))


def _new_figure(figsize: tuple[float, float]) -> Figure:
    fig = plt.figure(figsize=figsize, FigureClass=_Figure)
    plt.close(fig)  # see the module docstring: return it unregistered
    return fig


def description(fig: Figure) -> str:
    """What ``fig`` shows in one line (set by the function that drew it), else matplotlib's text."""
    return fig.get_label() or repr(fig)


def _described(fig: Figure, text: str) -> Figure:
    fig.set_label(text)
    fig.tight_layout()
    return fig


def _one_line(label: str) -> str:
    return ", ".join(label.splitlines())


def _listed(items: Sequence[str], most: int = 6) -> str:
    shown = ", ".join(map(_one_line, items[:most]))
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def image_grid(
    images: Sequence[Image.Image | str | os.PathLike],
    titles: Sequence[str] | None = None,
    cols: int | None = None,
    size: float = 2.5,
) -> Figure:
    """Show images in a grid, one axis per image, without ticks.

    Args:
        images: PIL images or paths to image files.
        titles: one title per image, or None.
        cols: images per row; default ``min(len(images), 5)``.
        size: width and height of each cell in inches.

    Returns:
        The figure, with exactly ``len(images)`` axes in reading order.
    """
    if not images:
        raise ValueError("image_grid got no images: pass at least one PIL image or image path.")
    if titles is not None and len(titles) != len(images):
        raise ValueError(
            f"image_grid got {len(images)} images but {len(titles)} titles: pass one title per image."
        )
    cols = min(len(images), 5) if cols is None else cols
    if cols < 1:
        raise ValueError(f"cols={cols}: use at least 1 column.")
    rows = math.ceil(len(images) / cols)
    fig = _new_figure((cols * size, rows * size + (0.3 * rows if titles else 0)))
    for k, item in enumerate(images):
        ax = fig.add_subplot(rows, cols, k + 1)
        if isinstance(item, Image.Image):
            ax.imshow(item)
        else:
            with Image.open(item) as img:
                ax.imshow(img.convert("RGB"))
        ax.set_axis_off()
        if titles is not None:
            ax.set_title(titles[k], fontsize=9)
    named = f": {_listed([str(t) for t in titles])}" if titles else ""
    pictures = "1 picture" if len(images) == 1 else f"{len(images)} pictures"
    return _described(fig, f"{pictures} in a grid{named}")


def image_rows(rows: Mapping[str, Sequence[Image.Image]], size: float = 1.6) -> Figure:
    """Rows of pictures, each row labelled on its left: e.g. the same seeds before and after training.

    Args:
        rows: row label -> its pictures (rows may differ in length).
        size: width and height of each picture in inches.

    Returns:
        The figure, with one axis per picture, row by row; the first axis of each row carries the
        row's label as its y-axis label.
    """
    if not rows or not all(rows.values()):
        raise ValueError("image_rows needs at least one row, and every row at least one picture.")
    cols = max(len(images) for images in rows.values())
    fig = _new_figure((cols * size + 1.2, len(rows) * size + 0.2))
    for r, (label, images) in enumerate(rows.items()):
        for c, image in enumerate(images):
            ax = fig.add_subplot(len(rows), cols, r * cols + c + 1)
            ax.imshow(image)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(label, fontsize=9, rotation=0, ha="right", va="center")
    named = "; ".join(f"{_one_line(label)} ({len(images)})" for label, images in rows.items())
    labelled = "1 labelled row" if len(rows) == 1 else f"{len(rows)} labelled rows"
    return _described(fig, f"Pictures in {labelled}: {named}")


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average, the same length as ``values``.

    Point ``k`` is the mean of ``values[max(0, k - window + 1) : k + 1]``, so the first points
    average what is available instead of being dropped.

    Args:
        values: the series to smooth.
        window: number of points averaged; 1 (or 0) returns the values unchanged.

    Returns:
        A float array of ``len(values)`` smoothed values.
    """
    x = np.asarray(values, dtype=float)
    if window <= 1 or x.size == 0:
        return x.copy()
    csum = np.concatenate([[0.0], np.cumsum(x)])
    k = np.arange(1, x.size + 1)
    start = np.maximum(0, k - window)
    return (csum[k] - csum[start]) / (k - start)


def loss_curve(
    history: Sequence[Mapping[str, float]], smooth: int = 0, title: str = "Training loss"
) -> Figure:
    """Plot the training loss per step, with its moving average and the learning rate.

    Args:
        history: one mapping per logged step with ``"step"`` and ``"loss"`` and optionally ``"lr"``
            (the rows of a run's ``history.json``).
        smooth: moving-average window in steps; 0 or 1 draws the raw loss only.
        title: the axes title.

    Returns:
        The figure. Its first axes hold the loss (raw line first, then the average if
        ``smooth > 1``); a second axes (twin x) holds the learning rate if any row has ``"lr"``.
    """
    if not history:
        raise ValueError("loss_curve got an empty history: train for at least one step first.")
    for k, row in enumerate(history):
        missing = [key for key in ("step", "loss") if key not in row]
        if missing:
            raise ValueError(
                f"history[{k}] has no {missing}: each row needs 'step' and 'loss' (got {sorted(row)})."
            )
    steps = np.array([row["step"] for row in history], dtype=float)
    loss = np.array([row["loss"] for row in history], dtype=float)
    fig = _new_figure((7.0, 3.8))
    ax = fig.add_subplot(1, 1, 1)
    smoothed = smooth > 1
    # Per-step diffusion losses are very noisy (random timestep and noise); the average is the signal.
    ax.plot(steps, loss, color="tab:blue", alpha=0.3 if smoothed else 1.0, linewidth=1, label="loss")
    if smoothed:
        ax.plot(
            steps,
            moving_average(loss, smooth),
            color="tab:blue",
            linewidth=2,
            label=f"mean of {smooth} steps",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    lr_rows = [row for row in history if row.get("lr") is not None]
    if lr_rows:
        ax_lr = ax.twinx()
        ax_lr.plot(
            [row["step"] for row in lr_rows],
            [row["lr"] for row in lr_rows],
            color="tab:orange",
            linewidth=1.2,
            linestyle="--",
            label="lr",
        )
        ax_lr.set_ylabel("learning rate", color="tab:orange")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        h, lab = ax_lr.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, loc="upper right", fontsize=8)
    ends = moving_average(loss, smooth) if smoothed else loss
    averaged = f" (mean of {smooth} steps)" if smoothed else ""
    return _described(
        fig,
        f"{title}: loss against step, steps {steps[0]:g} to {steps[-1]:g}, "
        f"from {ends[0]:.4g} to {ends[-1]:.4g}{averaged}",
    )


class LiveLoss:
    """A run's loss curve drawn while it trains: a listener of the run's events (``helpers.training.engine.events``).

    One figure in the notebook, redrawn in place (not appended) at most every ``every_seconds`` and
    at the run's last step, so a cell shows the progress bar and one curve that grows. Its text form
    (what a handout or a log shows instead of the picture) names the last step drawn.
    """

    def __init__(self, smooth: int = 10, every_seconds: float = 5.0):
        self.smooth, self.every_seconds = smooth, every_seconds
        self.history: list[dict] = []
        self._handle = None
        self._drawn_at = -math.inf

    def __call__(self, event: events.Event) -> None:
        if not isinstance(event, events.StepEnded):
            return
        self.history.append(event.history_record())
        last = event.step == event.max_steps
        if last or time.monotonic() - self._drawn_at >= self.every_seconds:
            self.draw(f"loss after step {event.step} of {event.max_steps}: {event.loss:.4f}")

    def draw(self, text: str) -> None:
        """Show the curve so far (the first call displays it, later ones replace it)."""
        fig = loss_curve(self.history, self.smooth if len(self.history) > self.smooth else 0)
        shown = _Picture(fig, text)
        if self._handle is None:
            self._handle = display(shown, display_id=True)
        else:
            self._handle.update(shown)
        self._drawn_at = time.monotonic()


class _Picture:
    """A figure as a notebook shows it (PNG), with a line of text for everything else."""

    def __init__(self, fig: Figure, text: str):
        self.fig, self.text = fig, text

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.fig.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()

    def __repr__(self) -> str:
        return self.text


@contextlib.contextmanager
def live_loss(smooth: int = 10, every_seconds: float = 5.0) -> Iterator[LiveLoss]:
    """Draw the loss of every run trained in this block while it trains (:class:`LiveLoss`)::

    with plots.live_loss(smooth=10):
        result = textual_inversion.train(config)
    """
    listener = LiveLoss(smooth, every_seconds)
    with events.listening(listener):
        yield listener


def timing_bars(
    seconds: Mapping[str, float], title: str, unit: str = "s/image", baseline: str | None = None
) -> Figure:
    """Compare timings as bars, annotated with the value and the speed-up over a baseline.

    Args:
        seconds: label -> time (lower is faster), in display order.
        title: the axes title.
        unit: unit of the values, shown on the axis and in the annotations.
        baseline: label the speed-ups are relative to; default the slowest entry, so every
            annotation reads as "N× faster than the slowest".

    Returns:
        The figure: one axes with one bar per entry, bar heights equal to the inputs, and one
        text annotation per bar, ``"<value> <unit>\\n<speed-up>×"`` with speed-up
        ``seconds[baseline] / seconds[label]``.
    """
    if not seconds:
        raise ValueError("timing_bars got no timings: pass at least one {label: seconds} entry.")
    bad = {k: v for k, v in seconds.items() if not (v > 0 and math.isfinite(v))}
    if bad:
        raise ValueError(
            f"timing_bars needs positive finite times, got {bad}: measure again or drop those entries."
        )
    if baseline is None:
        baseline = max(seconds, key=seconds.__getitem__)
    elif baseline not in seconds:
        raise ValueError(
            f"baseline {baseline!r} is not one of the timings {list(seconds)}: pick one of them."
        )
    labels, values = list(seconds), [float(v) for v in seconds.values()]
    fig = _new_figure((max(4.0, 1.6 * len(labels) + 1.5), 3.8))
    ax = fig.add_subplot(1, 1, 1)
    bars = ax.bar(labels, values, color=["tab:gray" if lab == baseline else "tab:green" for lab in labels])
    for bar, value in zip(bars, values, strict=True):
        ratio = seconds[baseline] / value
        ax.annotate(
            f"{value:.3g} {unit}\n{ratio:.1f}×",
            (bar.get_x() + bar.get_width() / 2, value),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylim(0, max(values) * 1.3)  # room for the annotations above the tallest bar
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.set_xlabel(f"× = speed-up over {baseline!r}")
    bars_text = ", ".join(
        f"{lab} {v:.3g} {unit} ({seconds[baseline] / v:.1f}×)" for lab, v in zip(labels, values, strict=True)
    )
    return _described(fig, f"{title}: bars, lower is faster: {bars_text}")


LINE_STYLES = ("-", "--", ":", "-.")


def line_groups(
    curves: Mapping[tuple[str, str], tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    log: bool = False,
) -> Figure:
    """Lines in groups: one colour per group, one line style per variant (e.g. per VM size, ours
    solid and the reference dashed).

    Args:
        curves: ``(group, variant) -> (xs, ys)``, in display order; variants are styled in order of
            first appearance (solid, dashed, dotted, dash-dot).
        title, xlabel, ylabel: the axes' texts.
        log: both axes logarithmic (base 2 for x).

    Returns:
        The figure: one axes with one line per entry, labelled ``"group: variant"``.
    """
    if not curves:
        raise ValueError("line_groups got no curves: pass at least one {(group, variant): (xs, ys)} entry.")
    groups = list(dict.fromkeys(group for group, _ in curves))
    variants = list(dict.fromkeys(variant for _, variant in curves))
    if len(variants) > len(LINE_STYLES):
        raise ValueError(f"line_groups draws at most {len(LINE_STYLES)} variants, got {variants}.")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig = _new_figure((7.5, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    for (group, variant), (xs, ys) in curves.items():
        ax.plot(xs, ys, marker=".", color=colours[groups.index(group) % len(colours)],
                linestyle=LINE_STYLES[variants.index(variant)], label=f"{group}: {variant}")  # fmt: skip
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 16, not 2^4
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _described(
        fig, f"{title}: {ylabel} against {xlabel}, lines for {_listed([f'{g}: {v}' for g, v in curves])}"
    )


def scaling_figure(
    layouts: Sequence[tuple[scaling.Machine | str, int]] = scaling.FIGURE_LAYOUTS, max_nodes: int = 16
) -> Figure:
    """docs/scaling.md's and notebook 04's figure: predicted images/s against processes for 1..``max_nodes``
    nodes, ours (solid) against the reference (dashed), ours on ccl (dotted, where the model has
    ccl's fitted link), one colour per machine, and the guide's published point."""
    check = scaling.guide_check()
    lines = scaling.curves(layouts, max_nodes)
    if scaling.CCL_LOOPBACK is not None:
        on_ccl = scaling.curves(layouts, max_nodes, backend="ccl")
        lines |= {(group, "ours, ccl"): xy for (group, mode), xy in on_ccl.items() if mode == "ours"}
    fig = line_groups(
        lines,
        title=f"Model: SD v1.5 textual inversion, 512 px, batch 1 per process, 1-{max_nodes} nodes",
        xlabel="processes (nodes x processes per node)",
        ylabel="images / s",
        log=True,
    )
    ax = fig.axes[0]
    ax.plot([check.reference.processes], [check.published_images_per_second], marker="*", markersize=12,
            color="black", linestyle="none", label="guide, published (reference, 16 processes)")  # fmt: skip
    ax.legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0)
    )  # beside the axes: the lines fill them
    return fig


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a figure atomically: to a temporary file beside ``path``, then renamed.

    Args:
        fig: the figure to save.
        path: destination; the format comes from its suffix (``.png``, ``.svg``, ``.pdf``, ...).
        dpi: resolution for raster formats.

    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    if not fmt:
        raise ValueError(
            f"cannot tell the image format of {str(path)!r}: give it a suffix such as .png or .svg."
        )
    write_path_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi, bbox_inches="tight"))
    return path

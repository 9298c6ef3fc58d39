"""helpers.workshop.plots: figures with the right axes, data and annotations; atomic saving."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless, before pyplot is imported anywhere

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from IPython.core.formatters import DisplayFormatter  # noqa: E402
from PIL import Image  # noqa: E402

from helpers.training.engine import events  # noqa: E402
from helpers.workshop import plots  # noqa: E402


def _images(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (16 + k, 12), (20 * k, 100, 200)) for k in range(n)]


def test_image_grid_one_axis_per_image_with_titles():
    before = plt.get_fignums()
    fig = plots.image_grid(_images(7), titles=[f"img {k}" for k in range(7)], cols=3, size=2.0)
    assert len(fig.axes) == 7
    assert [ax.get_title() for ax in fig.axes] == [f"img {k}" for k in range(7)]
    assert [ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes] == [(3, 3)] * 7
    assert fig.axes[4].images[0].get_array().shape == (12, 20, 3)
    assert not fig.axes[0].axison
    assert tuple(fig.get_size_inches()) == pytest.approx((6.0, 3 * 2.0 + 0.9))
    assert plt.get_fignums() == before  # returned, not left open in pyplot


def test_image_grid_accepts_paths_and_defaults_to_one_row(tmp_path):
    paths = []
    for k, img in enumerate(_images(3)):
        img.save(tmp_path / f"{k}.png")
        paths.append(tmp_path / f"{k}.png")
    fig = plots.image_grid(paths)
    assert len(fig.axes) == 3
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes} == {(1, 3)}
    assert [ax.get_title() for ax in fig.axes] == ["", "", ""]


@pytest.mark.parametrize(
    ("args", "match"),
    [(([],), "no images"), ((_images(2), ["one"]), "2 images but 1 titles"), ((_images(2), None, 0), "cols")],
)
def test_image_grid_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        plots.image_grid(*args)


def test_moving_average_exact_values():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert plots.moving_average(values, 2).tolist() == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert plots.moving_average(values, 3).tolist() == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert plots.moving_average(values, 10).tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert plots.moving_average(values, 1).tolist() == values
    assert plots.moving_average(values, 0).tolist() == values


HISTORY = [
    {"step": s, "loss": loss, "lr": lr}
    for s, loss, lr in zip(
        range(1, 7), [0.6, 0.2, 0.4, 0.1, 0.3, 0.05], [1e-4, 2e-4, 3e-4, 3e-4, 3e-4, 3e-4], strict=True
    )
]


def test_loss_curve_raw_smoothed_and_lr():
    fig = plots.loss_curve(HISTORY, smooth=3, title="run 1")
    assert len(fig.axes) == 2  # loss + twin lr axis
    ax, ax_lr = fig.axes
    assert ax.get_title() == "run 1"
    raw, avg = ax.lines
    assert raw.get_xdata().tolist() == [1, 2, 3, 4, 5, 6]
    assert raw.get_ydata().tolist() == [0.6, 0.2, 0.4, 0.1, 0.3, 0.05]
    assert raw.get_alpha() == 0.3
    np.testing.assert_allclose(avg.get_ydata(), [0.6, 0.4, 0.4, 0.7 / 3, 0.8 / 3, 0.45 / 3])
    assert ax_lr.lines[0].get_ydata().tolist() == [1e-4, 2e-4, 3e-4, 3e-4, 3e-4, 3e-4]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss", "mean of 3 steps", "lr"]


def test_loss_curve_without_lr_or_smoothing():
    fig = plots.loss_curve([{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)])
    assert len(fig.axes) == 1
    (line,) = fig.axes[0].lines
    assert line.get_ydata().tolist() == [1.0, 0.5, 1.0 / 3]
    assert line.get_alpha() == 1.0
    assert fig.axes[0].get_title() == "Training loss"


@pytest.mark.parametrize(
    ("history", "match"), [([], "empty"), ([{"step": 1, "loss": 1.0}, {"step": 2}], r"history\[1\]")]
)
def test_loss_curve_rejects_bad_history(history, match):
    with pytest.raises(ValueError, match=match):
        plots.loss_curve(history)


def test_timing_bars_heights_values_and_speedups():
    timings = {"PyTorch fp32": 3.4, "OpenVINO": 1.0, "OpenVINO int8": 0.5}
    fig = plots.timing_bars(timings, "Seconds per image")
    (ax,) = fig.axes
    assert ax.get_title() == "Seconds per image"
    assert [p.get_height() for p in ax.patches] == [3.4, 1.0, 0.5]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(timings)
    assert [t.get_text() for t in ax.texts] == ["3.4 s/image\n1.0×", "1 s/image\n3.4×", "0.5 s/image\n6.8×"]
    assert ax.get_ylabel() == "s/image"

    fig = plots.timing_bars(timings, "t", unit="s/step", baseline="OpenVINO")
    assert [t.get_text() for t in fig.axes[0].texts] == [
        "3.4 s/step\n0.3×",
        "1 s/step\n1.0×",
        "0.5 s/step\n2.0×",
    ]


@pytest.mark.parametrize(
    ("timings", "kwargs", "match"),
    [
        ({}, {}, "no timings"),
        ({"a": 1.0, "b": 0.0}, {}, "positive"),
        ({"a": 1.0}, {"baseline": "z"}, "baseline 'z'"),
    ],
)
def test_timing_bars_rejects_bad_input(timings, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plots.timing_bars(timings, "t", **kwargs)


def test_save_figure_writes_atomically(tmp_path):
    fig = plots.image_grid(_images(2))
    out = plots.save_figure(fig, tmp_path / "sub" / "grid.png")
    assert out == tmp_path / "sub" / "grid.png"
    with Image.open(out) as img:
        assert img.format == "PNG"
    assert [p.name for p in out.parent.iterdir()] == ["grid.png"]


def test_save_figure_failure_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    fig = plots.image_grid(_images(1))

    def broken_savefig(path, **kwargs):
        open(path, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(fig, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        plots.save_figure(fig, target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
    with pytest.raises(ValueError, match="suffix"):
        plots.save_figure(fig, tmp_path / "noext")


def test_live_loss_draws_the_first_step_the_last_and_at_most_every_few_seconds_between(capsys):
    """Outside a notebook each drawing is its text line (in a kernel the one picture is replaced in
    place; tests/workshop/test_notebooks.py checks the executed notebooks)."""
    losses = [0.5, 0.4, 0.45, 0.3, 0.25]
    with plots.live_loss(smooth=2, every_seconds=3600) as live:
        events.publish(events.Saved(1, "checkpoint", Path("x")))  # not a step: ignored
        for step, loss in enumerate(losses, 1):
            events.publish(events.StepEnded(step, len(losses), loss, lr=1e-3, seconds=0.1))
    events.publish(events.StepEnded(6, 6, 0.1, lr=1e-3, seconds=0.1))  # after the block: not heard
    assert capsys.readouterr().out.splitlines() == [
        "loss after step 1 of 5: 0.5000",
        "loss after step 5 of 5: 0.2500",
    ]
    assert [row["loss"] for row in live.history] == losses
    picture = plots._Picture(plots.loss_curve(live.history, 2), "text")
    png = Image.open(io.BytesIO(picture._repr_png_()))
    assert png.format == "PNG" and png.size == (700, 380)  # loss_curve's 7 x 3.8 in at 100 dpi


def test_every_figure_says_what_it_shows_in_one_line_which_ipython_gives_as_its_text():
    """The description is the figure's text form in a notebook; the handouts make it the picture's
    alternative text (tests/workshop/test_notebooks.py checks every handout's pictures)."""
    grid = plots.image_grid(_images(8), titles=[f"seed {k}" for k in range(8)])
    assert plots.description(grid) == (
        "8 pictures in a grid: seed 0, seed 1, seed 2, seed 3, seed 4, seed 5 and 2 more"
    )
    assert plots.description(plots.image_grid(_images(1))) == "1 picture in a grid"
    rows = plots.image_rows({"before": _images(3), "after": _images(2)})
    assert plots.description(rows) == "Pictures in 2 labelled rows: before (3); after (2)"
    one = plots.image_rows({"a photo of <pip>\nPip score 0.00": _images(2)})
    assert plots.description(one) == "Pictures in 1 labelled row: a photo of <pip>, Pip score 0.00 (2)"
    assert plots.description(plots.loss_curve(HISTORY, smooth=3, title="run 1")) == (
        f"run 1: loss against step, steps 1 to 6, from 0.6 to {0.45 / 3:.4g} (mean of 3 steps)"
    )
    assert plots.description(plots.loss_curve(HISTORY)) == (
        "Training loss: loss against step, steps 1 to 6, from 0.6 to 0.05"
    )
    bars = plots.timing_bars({"PyTorch": 3.4, "OpenVINO": 0.5}, "Seconds per image")
    assert plots.description(bars) == (
        "Seconds per image: bars, lower is faster: PyTorch 3.4 s/image (1.0×), OpenVINO 0.5 s/image (6.8×)"
    )
    lines = plots.line_groups(
        {("A", "ours"): ([1, 2], [3, 4]), ("A", "ref"): ([1, 2], [1, 2])}, "T", "x", "y"
    )
    assert plots.description(lines) == "T: y against x, lines for A: ours, A: ref"

    text = DisplayFormatter()  # a kernel's formatters (the inline backend adds the PNG)
    assert text.format(rows)[0]["text/plain"] == "Pictures in 2 labelled rows: before (3); after (2)"
    other = plt.figure(figsize=(2, 1))  # not one of ours: matplotlib's own text
    assert text.format(other)[0]["text/plain"] == "<Figure size 200x100 with 0 Axes>"
    plt.close(other)

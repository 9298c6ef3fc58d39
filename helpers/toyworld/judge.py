"""The judge: a small image classifier that knows the toy world *and Pip*.

It looks at a 64 px picture and gives three probability distributions: which toy it shows
(one of the world's kinds, or ``pip``), its colour and its background. The generator never saw
Pip; the judge did, so its probability of ``pip`` on generated pictures measures how well a
learned word brings Pip back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from helpers.core.errors import InputError
from helpers.toyworld import world

JUDGE_DIR = "judge"
HEADS = {
    "object": (*world.KINDS, world.PIP),
    "colour": tuple(world.COLOURS),
    "background": world.BACKGROUNDS,
}


class Judge(torch.nn.Module):
    """Four conv blocks and a linear head per question (kind-or-Pip, colour, background)."""

    def __init__(self, width: int = 32):
        super().__init__()
        chans = (3, width, width * 2, width * 4, width * 4)
        layers: list[torch.nn.Module] = []
        for cin, cout in zip(chans, chans[1:], strict=False):
            layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                       torch.nn.MaxPool2d(2)]  # fmt: skip
        self.features = torch.nn.Sequential(*layers)
        self.heads = torch.nn.ModuleDict({k: torch.nn.Linear(chans[-1], len(v)) for k, v in HEADS.items()})
        self.width = width

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits of every head for pixels ``[N, 3, 64, 64]`` in [-1, 1]."""
        h = self.features(x).mean(dim=(2, 3))
        return {k: head(h) for k, head in self.heads.items()}

    @staticmethod
    def labels(scenes: Sequence[world.Scene]) -> dict[str, torch.Tensor]:
        """The class index of every head for each scene."""
        return {
            "object": torch.tensor([HEADS["object"].index(s.label) for s in scenes]),
            "colour": torch.tensor([HEADS["colour"].index(s.colour) for s in scenes]),
            "background": torch.tensor([HEADS["background"].index(s.background) for s in scenes]),
        }

    def loss(self, x: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(x)
        return sum(F.cross_entropy(logits[k], labels[k]) for k in HEADS)

    def accuracy(self, x: torch.Tensor, labels: dict[str, torch.Tensor]) -> dict[str, float]:
        """Fraction right per head, and for the Pip-or-not decision alone."""
        logits = self(x)
        acc = {k: float((logits[k].argmax(1) == labels[k]).float().mean()) for k in HEADS}
        pip = HEADS["object"].index(world.PIP)
        acc["pip_vs_rest"] = float(
            ((logits["object"].argmax(1) == pip) == (labels["object"] == pip)).float().mean()
        )
        return acc


def save_judge(judge: Judge, folder: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"width": judge.width, "heads": HEADS}, indent=1))
    save_file({k: v.contiguous() for k, v in judge.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def load_judge(model_dir: str | os.PathLike) -> Judge:
    """The judge shipped beside a toy-world pipeline (``<model_dir>/judge``), in eval mode."""
    from safetensors.torch import load_file

    folder = Path(model_dir) / JUDGE_DIR
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{folder} holds no judge: only the toy-world model has one. "
            f"Fix: score with --model toyworld, or a folder built by `python -m helpers.toyworld build`."
        )
    config = json.loads((folder / "config.json").read_text())
    if {k: tuple(v) for k, v in config["heads"].items()} != HEADS:
        raise InputError(f"{folder}: the judge was built for another world (heads {config['heads']}).")
    judge = Judge(config["width"])
    judge.load_state_dict(load_file(str(folder / "model.safetensors")))
    return judge.eval()


@torch.no_grad()
def judge_images(judge: Judge, images: Sequence) -> dict[str, np.ndarray]:
    """Probabilities ``[N, classes]`` per head for PIL images (resized to 64 px if needed)."""
    from PIL import Image

    arr = np.stack([
        np.asarray(im.convert("RGB").resize((world.SIZE, world.SIZE), Image.Resampling.BICUBIC), dtype=np.float32)
        for im in images
    ])  # fmt: skip
    x = torch.from_numpy(arr).permute(0, 3, 1, 2) / 127.5 - 1.0
    return {k: v.softmax(1).numpy() for k, v in judge(x).items()}

"""The offline tiny model for the training tests: a run's settings, and the parts of one optimisation step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.dreambooth.lora import LORA_WEIGHTS
from helpers.training import data, families, models
from helpers.training import textual_inversion as ti
from helpers.training.config import TrainConfig
from helpers.training.families import sd1


def tiny_settings(output_dir, **overrides) -> dict:
    """A short run of the tiny model on the bundled sample concept, as ``TrainConfig`` fields."""
    values = dict(
        pretrained_model_name_or_path="tiny",
        train_data_dir=str(data.sample_concept_dir()),
        placeholder_token="<dicoo>",
        initializer_token="toy",
        resolution=64,
        max_train_steps=6,
        learning_rate=5e-3,
        output_dir=str(output_dir),
        seed=3,
    )
    return {**values, **overrides}


def tiny_config(tmp_path, name="run", **overrides) -> TrainConfig:
    """:func:`tiny_settings` into ``tmp_path / name``, as a checked ``TrainConfig``."""
    return TrainConfig(**tiny_settings(tmp_path / name, **overrides))


def step_parts(lr: float = 1e-2, seed: int = 0) -> tuple[ti.StepParts, data.ConceptDataset]:
    """A fresh tiny model with one new row ``<x>``, its dataset's cached latents and AdamW over that row."""
    base = models.load_components("tiny")
    ids = ti.add_placeholder_tokens(base.tokenizer, base.text_encoder, "<x>", "toy")
    for module in (base.text_encoder, base.unet, base.vae):
        module.requires_grad_(False)
    ds = data.ConceptDataset(data.sample_concept_dir(), base.tokenizer, "<x>", size=64, repeats=2, seed=seed)
    mean, std = ti.cache_latents(base.vae, ds)
    learned = ti.LearnedEmbeddings(base.text_encoder.get_input_embeddings().weight[ids], ids)
    parts = ti.StepParts(
        unet=base.unet,
        text_encoder=base.text_encoder,
        noise_scheduler=base.noise_scheduler,
        learned=learned,
        optimizer=torch.optim.AdamW(learned.parameters(), lr=lr, weight_decay=0.0),
        latent_mean=mean,
        latent_std=std,
        scaling_factor=base.vae.config.scaling_factor,
        seed=seed,
    )
    return parts, ds


# --- crash safety: what both trainers' tests use (tests/training/ and tests/dreambooth/test_crash_safety.py)

ROOT = Path(__file__).resolve().parents[1]


class Crash(RuntimeError):
    """Stands for whatever stops a run at that point (an error, Ctrl-C, a full disk)."""


def sd1_loss(unet, text_encoder, noise_scheduler, input_ids, latents, noise, timesteps) -> torch.Tensor:
    """The engine's SD v1 loss of one batch (:func:`helpers.training.families.diffusion_loss`)."""
    return families.diffusion_loss(
        sd1.FAMILY, unet, [text_encoder], noise_scheduler, [input_ids], latents, noise, timesteps
    )


def crash_when(monkeypatch, module, name: str, when=lambda *a, **k: True) -> None:
    """Make ``module.name`` raise :class:`Crash` on the first call for which ``when(*args)`` holds."""
    real = getattr(module, name)

    def crashing(*args, **kwargs):
        if when(*args, **kwargs):
            raise Crash(f"simulated crash in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, crashing)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every run of the module that imports this fixture on one thread. Two runs of the same settings
    on 2 threads are not bit-identical on this machine's kernels (seen 2026-11-27: losses equal to 1e-6
    for two steps, then AdamW turns the difference into visibly other weights); on one thread they
    are, so the comparisons can be exact."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # cpu.set_threads reads it at each run's start
        yield


# The subprocess of a kill case: python -m argv[1] (its cli) that kills itself (SIGKILL: no clean-up,
# no finally) when files.move_dir_into_place is about to swap in a folder named argv[2].
KILLER = """
import importlib, os, signal, sys
from pathlib import Path
from helpers.core import files
cli = importlib.import_module(sys.argv[1]).cli
swap = files.move_dir_into_place
def killing(src, path):
    if Path(path).name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
    return swap(src, path)
files.move_dir_into_place = killing
sys.exit(cli(sys.argv[3:]))
"""


def run_killed(module: str, name: str, flags: list[str]) -> None:
    """Run ``module``'s cli with ``flags`` in a subprocess killed as it swaps in the folder ``name``."""
    argv = [sys.executable, "-c", KILLER, module, name, *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


LOCK_HOLDER = """
import sys, time
from helpers.training.engine.folder import FolderLock
FolderLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def lock_holder(output_dir: Path) -> Iterator[subprocess.Popen]:
    """A second real process holding ``output_dir``'s lock (killed with SIGKILL at the end)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(output_dir)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "locked\n"  # EOF (an empty line) if it failed
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=60)


def mapped_rss(path) -> int:
    """Bytes of ``path``'s memory mappings resident in this process."""
    import psutil

    return sum(m.rss for m in psutil.Process().memory_maps() if m.path == str(path))


def lora_updates(out: Path) -> dict[str, torch.Tensor]:
    """What each LoRA layer of a DreamBooth run adds to its weight: ``B @ A`` (alpha = rank, so the scale is 1)."""
    state = load_file(out / LORA_WEIGHTS)
    return {k: state[k] @ state[k.replace(".up.", ".down.")] for k in state if ".up." in k}


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """How far two runs' LoRA updates are apart: the norm of the difference over all layers,
    relative to the norm of ``b``'s update."""
    assert a.keys() == b.keys()
    difference = sum(float((a[k] - b[k]).square().sum()) for k in b)
    return (difference / sum(float(v.square().sum()) for v in b.values())) ** 0.5


def train_here(module: str, args: list[str]) -> None:
    """``python -m <module> <args>`` (``helpers.train`` or ``helpers.dreambooth``) in this process, through
    its ``cli``: for a run whose outputs a test compares, not its process. A fresh interpreter would
    spend about 5 s importing torch and diffusers before its seconds of training."""
    from helpers import train
    from helpers.dreambooth import command

    cli = {"helpers.train": train.cli, "helpers.dreambooth": command.cli}[module]
    assert cli(args) == 0, f"python -m {module} {' '.join(args)} failed"

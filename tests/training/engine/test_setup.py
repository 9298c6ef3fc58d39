"""From settings to a run ready to train (:mod:`helpers.training.engine.setup`), on the tiny model."""

from __future__ import annotations

import math

import pytest
from tiny_parts import tiny_config
from transformers import CLIPTokenizer

from helpers.training import models
from helpers.training.engine import setup


@pytest.fixture(scope="module")
def tiny_dir():
    return models.resolve_model("tiny")


def test_setup_run_builds_modules_rows_latents_optimizer_and_schedule(tmp_path, tiny_dir):
    config = tiny_config(
        tmp_path, max_train_steps=None, num_train_epochs=2, repeats=3, num_vectors=2, train_batch_size=2,
        gradient_accumulation_steps=2, scale_lr=True, learning_rate=1e-3, lr_scheduler="linear",
        lr_warmup_steps=2, mixed_precision="no", report_to="none",
    )  # fmt: skip
    tokenizer = CLIPTokenizer.from_pretrained(tiny_dir, subfolder="tokenizer")
    run = setup.setup_run(config, tiny_dir, tokenizer)

    assert run.tokens == ["<dicoo>", "<dicoo>_1"]
    assert run.token_ids == tokenizer.convert_tokens_to_ids(run.tokens)
    assert run.precision.mixed_precision == "no" and run.accelerator.mixed_precision == "no"
    assert run.vectors.shape == (2, run.text_encoder.get_input_embeddings().weight.shape[1])
    assert run.vectors.requires_grad
    assert not any(p.requires_grad for p in [*run.unet.parameters(), *run.text_encoder.parameters()])
    assert run.parts.allreduce is None  # one process: no all-reduce
    images = len(run.sampler)  # sample pictures x repeats
    assert images % 3 == 0 and len(run.loader) == math.ceil(images / 2)
    assert run.steps_per_epoch == math.ceil(math.ceil(images / 2) / 2)
    assert (run.max_steps, run.num_epochs) == (2 * run.steps_per_epoch, 2)
    assert list(run.startup) == ["prepacked_convs", "latent_cache"]
    assert run.parts.latent_mean.shape[1:] == (4, 8, 8)  # cached latents of the 64 px pictures
    # scale_lr: lr x batch 2 x accumulation 2 x 1 process; linear warm-up over 2 steps, then down to 0
    optimizer = run.parts.optimizer
    assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(4e-3)
    assert optimizer.param_groups[0]["lr"] == 0.0  # warm-up starts at 0
    lrs = []
    for _ in range(run.max_steps):
        optimizer.step()
        run.parts.lr_scheduler.step()
        lrs.append(run.parts.lr_scheduler.get_last_lr()[0])
    assert lrs[0] == pytest.approx(2e-3) and lrs[1] == pytest.approx(4e-3) and lrs[-1] == 0.0

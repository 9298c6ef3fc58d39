"""The offline tiny model for the training tests: a run's settings, and the parts of one optimisation step."""

from __future__ import annotations

import torch

from helpers.training import data, models
from helpers.training import textual_inversion as ti
from helpers.training.config import TrainConfig


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

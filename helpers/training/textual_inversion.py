"""The textual-inversion engine: learn new token embeddings for a concept, lean enough for CPUs.

What differs from diffusers' ``examples/textual_inversion/textual_inversion.py`` (same maths):

* Only the new rows are parameters. The 49,409 x 768 embedding matrix stays frozen; a small
  module (:class:`LearnedEmbeddings`) holds the ``num_vectors x hidden`` trainable values and
  substitutes them into the token-embedding output through a forward hook. So AdamW keeps state
  for those rows only, nothing is restored after each step, and data-parallel training
  all-reduces ``num_vectors x hidden`` floats per step instead of the whole matrix (152 MB).
* The VAE encoder runs once per image view (each image, flipped or not) before training; each
  step samples the latent from the cached mean and std, which is the same distribution as
  re-encoding. The latents are also kept on disk (:mod:`helpers.training.engine.latents`), so a re-run
  with the same pictures and VAE does not even load the VAE; the results stay the same bit for bit.
* Every random draw of a sample (latent noise, diffusion noise, timestep) comes from a generator
  keyed by (seed, epoch, sample index). The run is therefore reproducible, a resumed run equals an
  uninterrupted one, and 2 processes x batch 1 compute the same update as 1 process x batch 2.

:func:`train` is the run loop (:mod:`helpers.training.engine.loop`) with this module's
:class:`TextualInversion` method: its checks, set-up (:func:`~helpers.training.engine.setup.setup_run`),
one :func:`training_step` per optimisation step, and its outputs. The parts live in
:mod:`helpers.training.engine`; the names the tests and ``bench/`` use are importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helpers.core.outputs import LEARNED_EMBEDS, MODEL_INDEX, SAMPLES
from helpers.ranks import status
from helpers.training import data, families, models
from helpers.training.config import TrainConfig
from helpers.training.engine import TrainingInputError, events, limits, loop, tracking
from helpers.training.engine.checkpoints import checkpoint_step
from helpers.training.engine.encoder_rows import save_encoder_embeds
from helpers.training.engine.folder import TEXTUAL_INVERSION, checkpoint_settings, inspect_output_dir
from helpers.training.engine.rows import (
    EmbeddingHook,
    LearnedEmbeddings,
    add_placeholder_tokens,
    check_tokens,
)
from helpers.training.engine.saving import (
    PipelineCopy,
    remove_full_pipeline,
    save_full_pipeline,
    save_learned_embeds,
    save_samples,
    storage_errors,
    write_json,
)
from helpers.training.engine.setup import Run, setup_run
from helpers.training.engine.step import (
    AllreduceCounter,
    EpochSampler,
    StepParts,
    cache_latents,
    check_gradient_reaches,
    draw_sample_noise,
    micro_batch_forward,
    sample_generator,
    training_step,
)
from helpers.training.inputs import CheckedInputs, check_inputs

__all__ = [
    "AllreduceCounter",
    "CheckedInputs",
    "EmbeddingHook",
    "EpochSampler",
    "LearnedEmbeddings",
    "Run",
    "StepParts",
    "TextualInversion",
    "TrainResult",
    "TrainingInputError",
    "add_placeholder_tokens",
    "cache_latents",
    "check_gradient_reaches",
    "check_inputs",
    "check_tokens",
    "checkpoint_settings",
    "checkpoint_step",
    "draw_sample_noise",
    "inspect_output_dir",
    "sample_generator",
    "setup_run",
    "train",
    "training_step",
    "write_json",
]


@dataclass
class TrainResult:
    """What a finished run produced.

    Attributes:
        output_dir: the run's folder.
        learned_embeds_path: ``output_dir/learned_embeds.safetensors``.
        pipeline_dir: ``output_dir`` itself when the full pipeline was saved into it
            (``save_as_full_pipeline``), else None.
        placeholder_tokens: the tokens learned (``<tok>``, ``<tok>_1``, ...).
        history: one record per step (step, loss, lr, seconds).
        summary: what ``run_summary.json`` holds.
    """

    output_dir: Path
    learned_embeds_path: Path
    pipeline_dir: Path | None
    placeholder_tokens: list[str]
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def train(config: TrainConfig) -> TrainResult:
    """Run textual inversion as configured (:func:`helpers.training.engine.loop.train`); return what was produced.

    Works the same in one process and under ``accelerate launch`` / ``torchrun`` / ``mpirun`` / Ray.
    Only the main process writes outputs, holding ``output_dir``'s lock from before the models load.
    """
    return loop.train(METHOD, config)


class TextualInversion(loop.Method):
    """Textual inversion as a method of the run loop (:class:`helpers.training.engine.loop.Method`):
    the new tokens' rows are trained; the outputs are ``learned_embeds.safetensors`` (also every
    ``save_steps``), samples and, with ``save_as_full_pipeline``, the pipeline in ``output_dir``."""

    name, title = "textual_inversion", "textual inversion"
    layout = TEXTUAL_INVERSION
    weights_name = "the learned embeddings"
    identical_key = "embeddings_identical_across_ranks"

    def check_inputs(self, config: TrainConfig) -> CheckedInputs:
        """:func:`check_inputs`, then the model resolved, its family read (an unsupported one is
        refused), its tokenizers loaded and the tokens checked in each."""
        checked = check_inputs(config)  # the folder, images and checkpoint, before any model work
        model_dir = models.resolve_model(config.pretrained_model_name_or_path, config.revision)
        family = families.family_of(model_dir)  # model_index.json only
        limits.check_resolution(config.resolution, config.train_batch_size, model_dir)  # its JSON only
        tokenizers = families.load_tokenizers(model_dir, family)
        templates = data.prompt_templates(config.learnable_property)
        for tokenizer in tokenizers:
            check_tokens(
                tokenizer, config.placeholder_token, config.initializer_token, config.num_vectors, templates
            )
        return dataclasses.replace(checked, model_dir=model_dir, tokenizer=tokenizers[0], family=family,
                                   tokenizer_2=tokenizers[1] if len(tokenizers) > 1 else None)  # fmt: skip

    def setup(self, config: TrainConfig, checked: CheckedInputs) -> Run:
        return setup_run(config, checked.model_dir, checked.tokenizer, checked.family, checked.tokenizer_2)

    @contextlib.contextmanager
    def running(self, run: Run) -> Iterator[None]:
        """The full pipeline's unchanged weights go to disk while the steps run, not after them."""
        writes = run.config.save_as_full_pipeline and run.accelerator.is_main_process  # at the end
        run.copied = PipelineCopy(run.model_dir, run.output_dir) if writes else None
        try:
            yield
        finally:
            if run.copied is not None:
                run.copied.discard()

    def step(self, run: Run, micro_batches: list[dict], epoch: int, step: int) -> torch.Tensor:
        return torch.tensor([training_step(run.parts, micro_batches, epoch, step)])

    def forward(self, run: Run, micro_batch: dict, epoch: int) -> Callable[[], torch.Tensor]:
        return micro_batch_forward(run.parts, micro_batch, epoch)

    def images_per_step(self, run: Run) -> int:
        config = run.config
        return config.train_batch_size * config.gradient_accumulation_steps * run.accelerator.num_processes

    def trained(self, run: Run) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for v in run.parts.all_vectors])

    def write_weights(self, run: Run, folder: Path) -> None:
        """``learned_embeds.safetensors`` (and SDXL's ``learned_embeds_2.safetensors``) into ``folder``."""
        save_encoder_embeds(folder, run.family, run.config.placeholder_token, run.parts.all_vectors)

    def after_step(self, run: Run, step: int) -> None:
        """The embeddings every ``save_steps`` (one file per encoder), samples every ``validation_steps``."""
        config, accelerator = run.config, run.accelerator
        if step % config.save_steps == 0 and accelerator.is_main_process:
            for name, vectors in zip(run.family.learned_embeds_files, run.parts.all_vectors, strict=True):
                path = run.output_dir / name.replace(".safetensors", f"-steps-{step}.safetensors")
                save_learned_embeds(path, config.placeholder_token, vectors)
                events.publish(events.Saved(step, "weights", path))
        if config.validation_prompt and config.num_validation_images and step % config.validation_steps == 0:
            dest = run.output_dir / SAMPLES / f"step-{step}"
            if accelerator.is_main_process:
                tracking.log_images(accelerator, step, save_samples(run, dest))
            else:
                status.beat(status.WAITING, step)  # rank 0 samples meanwhile
            accelerator.wait_for_everyone()
            events.publish(events.Saved(step, "samples", dest))

    def write_outputs(self, run: Run, steps: int) -> None:
        """The final samples, then the full pipeline (or, resumed without the flag, its removal)."""
        config, output_dir = run.config, run.output_dir
        for *_, hook, _ in run.encoders:
            hook.remove()
        if config.validation_prompt and config.num_validation_images:
            tracking.log_images(run.accelerator, steps, save_samples(run, output_dir / SAMPLES / "final"))
        if config.save_as_full_pipeline:
            with storage_errors(output_dir, "the full pipeline", discard=run.copied.folder):
                save_full_pipeline(run, output_dir, run.copied)
        elif (output_dir / MODEL_INDEX).exists():  # resumed without the flag: not this run's rows
            remove_full_pipeline(output_dir)

    def summary_extras(self, run: Run) -> dict:
        return {
            "placeholder_tokens": run.tokens,
            "trainable_parameters": sum(v.numel() for v in run.parts.all_vectors),
            "full_matrix_allreduce_bytes_per_step": sum(
                encoder.get_input_embeddings().weight.numel() * 4 for _, encoder, *_ in run.encoders
            ),
        }

    def result(self, run: Run, history: list[dict], summary: dict) -> TrainResult:
        pipeline_dir = run.output_dir if run.config.save_as_full_pipeline else None
        return TrainResult(
            run.output_dir, run.output_dir / LEARNED_EMBEDS, pipeline_dir, run.tokens, history, summary
        )


METHOD = TextualInversion()

"""The textual-inversion engine: learn new token embeddings for a concept, lean enough for CPUs.

What differs from diffusers' ``examples/textual_inversion/textual_inversion.py`` (same maths):

* Only the new rows are parameters. The 49,409 x 768 embedding matrix stays frozen; a small
  module (:class:`LearnedEmbeddings`) holds the ``num_vectors x hidden`` trainable values and
  substitutes them into the token-embedding output through a forward hook. So AdamW keeps state
  for those rows only, nothing is restored after each step, and data-parallel training
  all-reduces ``num_vectors x hidden`` floats per step instead of the whole matrix (152 MB).
* The VAE encoder runs once per image view (each image, flipped or not) before training; each
  step samples the latent from the cached mean and std, which is the same distribution as
  re-encoding.
* Every random draw of a sample (latent noise, diffusion noise, timestep) comes from a generator
  keyed by (seed, epoch, sample index). The run is therefore reproducible, a resumed run equals an
  uninterrupted one, and 2 processes x batch 1 compute the same update as 1 process x batch 2.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from safetensors.torch import save_file
from tqdm.auto import tqdm

from helpers import cpu, data, faults, models, supervise
from helpers.config import TrainConfig
from helpers.files import write_text_atomic

logger = get_logger(__name__)

LEARNED_EMBEDS = "learned_embeds.safetensors"
SUMMARY = "run_summary.json"
HISTORY = "history.json"


class TrainingInputError(ValueError):
    """A problem with the inputs of a run, found before any heavy work."""


@dataclass
class TrainResult:
    """What a finished run produced."""

    output_dir: Path
    learned_embeds_path: Path
    pipeline_dir: Path | None
    placeholder_tokens: list[str]
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


# --- placeholder tokens ------------------------------------------------------------------------


def placeholder_tokens_for(placeholder_token: str, num_vectors: int) -> list[str]:
    """``<tok>``, ``<tok>_1``, ... as diffusers names the tokens of a multi-vector embedding."""
    if num_vectors < 1:
        raise TrainingInputError(f"num_vectors={num_vectors}: must be at least 1")
    return [placeholder_token] + [f"{placeholder_token}_{i}" for i in range(1, num_vectors)]


def check_tokens(tokenizer, placeholder_token: str, initializer_token: str, num_vectors: int) -> int:
    """Check the new tokens are new and the initializer is one token; return its id.

    Raises:
        TrainingInputError: with the fix, before any model weights are loaded.
    """
    existing = [
        t for t in placeholder_tokens_for(placeholder_token, num_vectors) if t in tokenizer.get_vocab()
    ]
    if existing:
        raise TrainingInputError(
            f"placeholder_token {placeholder_token!r}: {', '.join(existing)} already in the tokenizer's "
            f"vocabulary, so it would not be a new concept. Fix: choose a new token such as '<my-concept>'."
        )
    ids = tokenizer.encode(initializer_token, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise TrainingInputError(
            f"initializer_token {initializer_token!r} is {len(ids)} tokens ({pieces}), not one. "
            f"Fix: choose a single common word close to the concept, e.g. 'toy' or 'cat'."
        )
    return ids[0]


def add_placeholder_tokens(
    tokenizer, text_encoder, placeholder_token: str, initializer_token: str, num_vectors: int = 1
) -> list[int]:
    """Add the placeholder tokens to the tokenizer and their rows (initialised) to the embedding.

    Returns:
        The ids of the new tokens (contiguous, in order).
    """
    init_id = check_tokens(tokenizer, placeholder_token, initializer_token, num_vectors)
    tokens = placeholder_tokens_for(placeholder_token, num_vectors)
    tokenizer.add_tokens(tokens)
    token_ids = tokenizer.convert_tokens_to_ids(tokens)
    text_encoder.resize_token_embeddings(len(tokenizer))
    weight = text_encoder.get_input_embeddings().weight
    with torch.no_grad():
        weight[token_ids] = weight[init_id].clone()
    return token_ids


class LearnedEmbeddings(torch.nn.Module):
    """The trainable rows of the new tokens: the only parameters of a textual-inversion run."""

    def __init__(self, initial: torch.Tensor, token_ids: Sequence[int]):
        super().__init__()
        if list(token_ids) != list(range(token_ids[0], token_ids[0] + len(token_ids))):
            raise ValueError(f"placeholder token ids must be contiguous, got {list(token_ids)}")
        self.first_id = int(token_ids[0])
        self.vectors = torch.nn.Parameter(initial.detach().clone().float())

    def forward(self, input_ids: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Replace the embeddings of placeholder positions by the trainable vectors."""
        offset = input_ids - self.first_id
        is_new = (offset >= 0) & (offset < self.vectors.shape[0])
        rows = self.vectors[offset.clamp(0, self.vectors.shape[0] - 1)].to(token_embeds.dtype)
        return torch.where(is_new.unsqueeze(-1), rows, token_embeds)


class _EmbeddingHook:
    """Forward hook on the frozen token embedding that routes through ``LearnedEmbeddings``."""

    def __init__(self, text_encoder, learned: torch.nn.Module):
        self.learned = learned
        self.handle = text_encoder.get_input_embeddings().register_forward_hook(self)

    def __call__(self, module, args, output):
        return self.learned(args[0], output)

    def remove(self) -> None:
        self.handle.remove()


def write_rows(text_encoder, token_ids: Sequence[int], vectors: torch.Tensor) -> None:
    """Copy learned vectors into the text encoder's embedding matrix (for saving and sampling)."""
    with torch.no_grad():
        text_encoder.get_input_embeddings().weight[list(token_ids)] = vectors.detach().to(
            text_encoder.get_input_embeddings().weight.dtype
        )


# --- data and latents --------------------------------------------------------------------------


class EpochSampler(torch.utils.data.Sampler[int]):
    """A seeded shuffle that is the same on every process and changes with the epoch."""

    def __init__(self, length: int, seed: int):
        self.length, self.seed, self.epoch = length, seed, 0

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.length, generator=gen).tolist())

    def __len__(self) -> int:
        return self.length


class _Indexed(torch.utils.data.Dataset):
    """Adds each item's dataset index, the key of its random draws."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {"index": i, **self.dataset[i]}


@torch.no_grad()
def cache_latents(
    vae, dataset: data.ConceptDataset, batch_size: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode every view of the dataset once; return the latent distributions' mean and std."""
    means, stds = [], []
    for start in range(0, dataset.num_views, batch_size):
        views = range(start, min(start + batch_size, dataset.num_views))
        pixels = torch.stack([dataset.view_pixels(v) for v in views]).to(vae.dtype)
        dist = vae.encode(pixels).latent_dist
        means.append(dist.mean.float())
        stds.append(dist.std.float())
    return torch.cat(means), torch.cat(stds)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator of one sample's random draws, keyed so any split of the work agrees."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + index)


def draw_sample_noise(
    latent_mean: torch.Tensor, latent_std: torch.Tensor, num_train_timesteps: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sample's latent (sampled from its cached distribution), diffusion noise and timestep."""
    latent = latent_mean + latent_std * torch.randn(latent_mean.shape, generator=generator)
    noise = torch.randn(latent_mean.shape, generator=generator)
    timestep = torch.randint(0, num_train_timesteps, (1,), generator=generator)
    return latent, noise, timestep


def draw_batch(
    latent_mean: torch.Tensor,
    latent_std: torch.Tensor,
    indices: Sequence[int] | torch.Tensor,
    view_indices: Sequence[int] | torch.Tensor,
    num_train_timesteps: int,
    seed: int,
    epoch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's latents, diffusion noise and timesteps ``[B]``, each sample from its keyed generator.

    Args:
        latent_mean, latent_std: the cached latent distributions of every view (:func:`cache_latents`).
        indices: dataset index of each sample (the key of its draws).
        view_indices: which cached view each sample shows.
    """
    draws = [
        draw_sample_noise(
            latent_mean[int(v)],
            latent_std[int(v)],
            num_train_timesteps,
            sample_generator(seed, epoch, int(i)),
        )
        for i, v in zip(indices, view_indices, strict=True)
    ]
    latents, noise, timesteps = (torch.stack(x) for x in zip(*draws, strict=True))
    return latents, noise, timesteps.squeeze(1)


def diffusion_loss(
    unet,
    text_encoder,
    noise_scheduler,
    input_ids: torch.Tensor,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
) -> torch.Tensor:
    """The denoising loss of one batch (latents already scaled by the VAE's scaling factor)."""
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = text_encoder(input_ids)[0]
    pred = unet(noisy, timesteps, encoder_hidden_states).sample
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    return F.mse_loss(pred.float(), target.float(), reduction="mean")


# --- outputs -----------------------------------------------------------------------------------


def save_learned_embeds(path: str | os.PathLike, placeholder_token: str, vectors: torch.Tensor) -> Path:
    """Write ``{placeholder_token: [num_vectors, hidden]}``, the format ``load_textual_inversion`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({placeholder_token: vectors.detach().float().cpu().contiguous()}, str(tmp))
    os.replace(tmp, path)
    return path


def _write_json(path: Path, value: Any) -> None:
    write_text_atomic(path, json.dumps(value, indent=2))


def _replace_dir(tmp: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)


def _checkpoints(output_dir: Path) -> list[Path]:
    found = [
        p
        for p in (output_dir / "checkpoints").glob("checkpoint-*")
        if re.fullmatch(r"checkpoint-\d+", p.name)
    ]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def resolve_checkpoint(output_dir: Path, resume_from_checkpoint: str) -> Path:
    if resume_from_checkpoint == "latest":
        found = _checkpoints(output_dir)
        if not found:
            raise TrainingInputError(
                f"resume_from_checkpoint='latest' but {output_dir / 'checkpoints'} holds no checkpoint. "
                f"Fix: start without resume_from_checkpoint, or point it at a checkpoint folder."
            )
        return found[-1]
    path = Path(resume_from_checkpoint)
    if not re.fullmatch(r"checkpoint-\d+", path.name) or not path.is_dir():
        raise TrainingInputError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a checkpoint folder (…/checkpoints/checkpoint-N). "
            f"Fix: pass an existing checkpoint folder or 'latest'."
        )
    return path


def check_inputs(config: TrainConfig, tokenizer) -> list[Path]:
    """Every cheap check of a run, before model weights are loaded. Returns the image files."""
    if config.train_data_dir is None:
        raise TrainingInputError(
            "train_data_dir is not set. Fix: pass a folder of 3-5 images of your concept, "
            f"or the bundled sample: --train_data_dir {data.sample_concept_dir()}"
        )
    images = data.validate_image_folder(config.train_data_dir, min_size=config.resolution)
    check_tokens(tokenizer, config.placeholder_token, config.initializer_token, config.num_vectors)
    output_dir = Path(config.output_dir)
    if (output_dir / SUMMARY).exists() and not (config.overwrite_output_dir or config.resume_from_checkpoint):
        raise TrainingInputError(
            f"output_dir {output_dir} already holds a finished run ({SUMMARY}). "
            f"Fix: choose another output_dir, or pass --overwrite_output_dir to replace it."
        )
    if config.resume_from_checkpoint:
        resolve_checkpoint(output_dir, config.resume_from_checkpoint)
    return images


# --- the run -----------------------------------------------------------------------------------


class _AllreduceCounter:
    """Counts the bytes all-reduced per step: around the engine's own all-reduce of the gradient
    (:meth:`all_reduce_mean`), or as a DDP communication hook (:meth:`hook`, ``bench.allreduce``)."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    def _count(self, tensor: torch.Tensor, last: bool) -> None:
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += int(last)

    def all_reduce_mean(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its mean over the ranks, synchronously, as DDP does with gradients
        (divide by the world size, then sum)."""
        import torch.distributed as dist

        self._count(tensor, last=True)
        tensor.div_(dist.get_world_size())
        dist.all_reduce(tensor)

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._count(bucket.buffer(), bucket.is_last())
        return allreduce_hook(None, bucket)


def train(config: TrainConfig) -> TrainResult:
    """Run textual inversion as configured; return what was produced.

    Works the same in one process and under ``accelerate launch`` / ``torchrun`` / ``mpirun``.
    Only the main process writes outputs.
    """
    from transformers import CLIPTokenizer

    model_dir = models.resolve_model(config.pretrained_model_name_or_path, config.revision)
    tokenizer = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
    check_inputs(config, tokenizer)

    precision = cpu.choose_precision(config.mixed_precision)
    accelerator = Accelerator(
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        mixed_precision=precision.mixed_precision,
        cpu=True,
    )
    cpu.set_threads()
    logger.info(f"precision: {precision.reason}", main_process_only=True)
    if precision.warning:
        logger.warning(precision.warning, main_process_only=True)

    # With bf16 the UNet, only ever read, is loaded in bf16, as diffusers' script casts it: no step
    # re-casts its 860 M weights (autocast would, and hold the casts for the backward). Saving the
    # full pipeline takes the UNet from the base model, untouched.
    dtype = cpu.compute_dtype(precision.mixed_precision)
    supervise.beat("loading")  # each phase of a start counts as progress for helpers.launch
    parts = models.load_components(model_dir, unet_dtype=dtype)
    supervise.beat("loaded")
    text_encoder, vae, unet, noise_scheduler = (
        parts.text_encoder,
        parts.vae,
        parts.unet,
        parts.noise_scheduler,
    )
    del parts  # holds the VAE: it must go when the latents are cached
    token_ids = add_placeholder_tokens(
        tokenizer, text_encoder, config.placeholder_token, config.initializer_token, config.num_vectors
    )
    tokens = placeholder_tokens_for(config.placeholder_token, config.num_vectors)
    for module in (text_encoder, vae, unet):
        module.requires_grad_(False)
    vae.eval()
    text_encoder.train(config.gradient_checkpointing)
    unet.train(config.gradient_checkpointing)  # diffusers checkpoints only in training mode
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        text_encoder.gradient_checkpointing_enable()
    if config.use_ipex:
        cpu.apply_ipex(unet, text_encoder, dtype)

    dataset = data.ConceptDataset(
        config.train_data_dir,
        tokenizer,
        " ".join(tokens),
        learnable_property=config.learnable_property,
        size=config.resolution,
        repeats=config.repeats,
        center_crop=config.center_crop,
        seed=config.seed,
    )
    latent_mean, latent_std = cache_latents(vae, dataset)
    supervise.beat("latents cached")
    scaling = vae.config.scaling_factor
    del vae  # never needed again: the encoder ran once per view

    learned = LearnedEmbeddings(text_encoder.get_input_embeddings().weight[token_ids], token_ids)
    if config.scale_lr:
        lr = (
            config.learning_rate
            * config.gradient_accumulation_steps
            * config.train_batch_size
            * accelerator.num_processes
        )
    else:
        lr = config.learning_rate
    optimizer = torch.optim.AdamW(
        learned.parameters(),
        lr=lr,
        betas=(config.adam_beta1, config.adam_beta2),
        weight_decay=config.adam_weight_decay,
        eps=config.adam_epsilon,
    )
    sampler = EpochSampler(len(dataset), config.seed)
    loader = torch.utils.data.DataLoader(
        _Indexed(dataset),
        batch_size=config.train_batch_size,
        sampler=sampler,
        num_workers=config.dataloader_num_workers,
    )
    steps_per_epoch = math.ceil(
        math.ceil(len(loader) / accelerator.num_processes) / config.gradient_accumulation_steps
    )
    max_steps = config.max_train_steps or config.num_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_steps / steps_per_epoch)

    from diffusers.optimization import get_scheduler

    lr_scheduler = get_scheduler(
        config.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=config.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=max_steps * accelerator.num_processes,
        num_cycles=config.lr_num_cycles,
    )
    # The 3 KB of learned rows are not wrapped in DDP: after each synchronising backward one
    # synchronous all-reduce averages their gradient (see all_reduce_mean). A DDP reducer holds the
    # process group and, freed with the GIL held, joined gloo's threads while one of them waited for
    # the GIL: the exit deadlock of issue 11. evaluation_mode=True: mixed precision and checkpointing
    # as a prepared model, no DDP.
    learned = accelerator.prepare_model(learned, evaluation_mode=True)
    optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    counter = _AllreduceCounter()
    hook = _EmbeddingHook(text_encoder, learned)
    vectors = learned.vectors
    output_dir = Path(config.output_dir)
    run = _Run(
        accelerator, config, output_dir, model_dir, text_encoder, tokenizer, unet, token_ids, vectors, hook
    )

    global_step, first_epoch, skip_batches = 0, 0, 0
    if config.resume_from_checkpoint:
        ckpt = resolve_checkpoint(output_dir, config.resume_from_checkpoint)
        accelerator.load_state(str(ckpt))
        global_step = int(ckpt.name.split("-")[1])
        first_epoch = global_step // steps_per_epoch
        skip_batches = (global_step % steps_per_epoch) * config.gradient_accumulation_steps
        logger.info(f"resumed from {ckpt} at step {global_step}", main_process_only=True)
    if accelerator.is_main_process:
        if config.overwrite_output_dir and not config.resume_from_checkpoint:
            _clear_previous_run(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "train_config.yaml")
    accelerator.wait_for_everyone()
    history = _load_history(output_dir, global_step) if global_step else []

    progress = tqdm(
        total=max_steps,
        initial=global_step,
        desc="textual inversion",
        unit="step",
        disable=not accelerator.is_local_main_process,
    )
    step_start, local_loss, micro = time.perf_counter(), 0.0, 0
    checked_grad = False
    # Each step allocates and frees gigabytes; keeping freed memory avoids re-faulting it in (cpu.py).
    with cpu.keep_freed_memory():
        for epoch in range(first_epoch, num_epochs):
            sampler.epoch = epoch
            batches = (
                accelerator.skip_first_batches(loader, skip_batches)
                if epoch == first_epoch and skip_batches
                else loader
            )
            for batch in batches:
                with accelerator.accumulate(learned):
                    latents, noise, timesteps = draw_batch(
                        latent_mean,
                        latent_std,
                        batch["index"],
                        batch["view_index"],
                        noise_scheduler.config.num_train_timesteps,
                        config.seed,
                        epoch,
                    )
                    with accelerator.autocast():
                        loss = diffusion_loss(
                            unet,
                            text_encoder,
                            noise_scheduler,
                            batch["input_ids"],
                            latents * scaling,
                            noise,
                            timesteps,
                        )
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and accelerator.num_processes > 1:
                        # a rank blocked here waits for a slower one; helpers.launch blames that one
                        supervise.beat(supervise.WAITING, global_step + 1)
                        counter.all_reduce_mean(vectors.grad)  # micro-steps accumulate locally
                    if not checked_grad:
                        _check_gradient_reaches(vectors)
                        checked_grad = True
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                local_loss += loss.detach().item()
                micro += 1
                if not accelerator.sync_gradients:
                    continue
                global_step += 1
                mean_loss = accelerator.reduce(torch.tensor(local_loss / micro), reduction="mean").item()
                seconds = time.perf_counter() - step_start
                history.append(
                    {
                        "step": global_step,
                        "loss": mean_loss,
                        "lr": lr_scheduler.get_last_lr()[0],
                        "seconds": seconds,
                    }
                )
                progress.update(1)
                progress.set_postfix(loss=f"{mean_loss:.4f}")
                supervise.beat("training", global_step)  # helpers.launch's stall detection
                faults.stall_after_step(accelerator.process_index, global_step)  # test-only
                _periodic_saves(run, global_step, history)
                local_loss, micro, step_start = 0.0, 0, time.perf_counter()
                if global_step >= max_steps:
                    break
            if global_step >= max_steps:
                break
    progress.close()

    gathered = accelerator.gather(vectors.detach()[None])
    identical = bool(all(torch.equal(gathered[0], g) for g in gathered))
    del gathered  # a collective's output: gloo's thread must not be the one to free it at teardown
    timed = [h["seconds"] for h in history[1:]] or [h["seconds"] for h in history]  # step 1 includes warm-up
    seconds_per_step = sum(timed) / max(len(timed), 1)
    images_per_step = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    summary = {
        "world_size": accelerator.num_processes,
        "steps": global_step,
        "final_loss": history[-1]["loss"] if history else None,
        "seconds_per_step": seconds_per_step,
        "steps_per_second": 1.0 / seconds_per_step if seconds_per_step else None,
        "images_per_second": images_per_step / seconds_per_step if seconds_per_step else None,
        "precision": precision.mixed_precision,
        "precision_reason": precision.reason,
        "placeholder_tokens": tokens,
        "trainable_parameters": vectors.numel(),
        "allreduce_bytes_per_step": counter.bytes // max(counter.calls, 1),
        "allreduce_calls": counter.calls,  # one per optimizer step, none per accumulated micro-batch
        "full_matrix_allreduce_bytes_per_step": text_encoder.get_input_embeddings().weight.numel() * 4,
        "embeddings_identical_across_ranks": identical,
        "threads_per_process": torch.get_num_threads(),
    }
    hook.remove()
    learned_path = output_dir / LEARNED_EMBEDS
    pipeline_dir = output_dir / "pipeline" if config.save_as_full_pipeline else None
    supervise.beat("saving" if accelerator.is_main_process else supervise.WAITING, global_step)
    if accelerator.is_main_process:
        save_learned_embeds(learned_path, config.placeholder_token, vectors)
        _write_json(output_dir / HISTORY, history)
        if config.validation_prompt and config.num_validation_images:
            _validate(run, output_dir / "samples" / "final")
        if pipeline_dir is not None:
            save_full_pipeline(run, pipeline_dir)
        _write_json(output_dir / SUMMARY, summary)  # written last: marks a finished run
    # Teardown in a safe order: every collective's output dropped (above), every rank past the
    # barrier (no collective in flight), then the process group destroyed. Measured with torch
    # 2.13: once torch._dynamo is imported (any optimizer step does) gloo's threads outlive
    # destroy_process_group until the interpreter exits, so nothing may be left for them to free.
    accelerator.wait_for_everyone()
    faults.delay_in_collective_thread(accelerator.process_index)  # test-only: issue 11's exit race
    accelerator.end_training()  # destroys the process group (MPICH aborts a rank that skips it)
    return TrainResult(output_dir, learned_path, pipeline_dir, tokens, history, summary)


def _clear_previous_run(output_dir: Path) -> None:
    """Remove what an earlier run wrote (only the engine's own files, nothing else in the folder)."""
    for name in ("checkpoints", "samples", "pipeline"):
        shutil.rmtree(output_dir / name, ignore_errors=True)
    for pattern in ("learned_embeds*.safetensors", f"{HISTORY}*", SUMMARY, "train_config.yaml"):
        for path in output_dir.glob(pattern):
            path.unlink()


def _check_gradient_reaches(vectors: torch.Tensor) -> None:
    """Guard against setups (e.g. IPEX weight prepacking) that silently cut the gradient."""
    if vectors.grad is None or not torch.isfinite(vectors.grad).all() or not vectors.grad.abs().sum() > 0:
        raise RuntimeError(
            "the gradient did not reach the placeholder embedding (it is None, zero or not finite), so "
            "training would change nothing. If use_ipex is on, run without it; otherwise report this bug."
        )


def _load_history(output_dir: Path, upto_step: int) -> list[dict]:
    path = output_dir / HISTORY
    partial = output_dir / f"{HISTORY}.partial"
    source = partial if partial.exists() else path
    if not source.exists():
        return []
    return [h for h in json.loads(source.read_text()) if h["step"] <= upto_step]


@dataclass
class _Run:
    """What saving and sampling need of a run in progress."""

    accelerator: Accelerator
    config: TrainConfig
    output_dir: Path
    model_dir: Path
    text_encoder: Any
    tokenizer: Any
    unet: Any
    token_ids: list[int]
    vectors: torch.Tensor
    hook: _EmbeddingHook


def _periodic_saves(run: _Run, step: int, history: list[dict]) -> None:
    config, accelerator = run.config, run.accelerator
    if step % config.save_steps == 0 and accelerator.is_main_process:
        path = run.output_dir / f"learned_embeds-steps-{step}.safetensors"
        save_learned_embeds(path, config.placeholder_token, run.vectors)
    if step % config.checkpointing_steps == 0:
        save_checkpoint(accelerator, config, run.output_dir, step, run.vectors, history)
    if config.validation_prompt and config.num_validation_images and step % config.validation_steps == 0:
        if accelerator.is_main_process:
            _validate(run, run.output_dir / "samples" / f"step-{step}")
        else:
            supervise.beat(supervise.WAITING, step)  # rank 0 samples meanwhile
        accelerator.wait_for_everyone()


def save_checkpoint(
    accelerator, config: TrainConfig, output_dir: Path, step: int, vectors: torch.Tensor, history: list[dict]
) -> Path:
    """Save a resumable checkpoint (accelerate state + embeddings), pruning old ones."""
    final = output_dir / "checkpoints" / f"checkpoint-{step}"
    tmp = final.with_name(f".{final.name}.tmp")
    if accelerator.is_main_process and config.checkpoints_total_limit:
        existing = _checkpoints(output_dir)
        # make room for the one about to be saved
        for old in existing[: max(0, len(existing) - config.checkpoints_total_limit + 1)]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        save_learned_embeds(tmp / LEARNED_EMBEDS, config.placeholder_token, vectors)
        _write_json(output_dir / f"{HISTORY}.partial", history)
        _replace_dir(tmp, final)
    accelerator.wait_for_everyone()
    return final


def _sampling_pipeline(run: _Run):
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=AutoencoderKL.from_pretrained(run.model_dir, subfolder="vae"),
        text_encoder=run.text_encoder,
        tokenizer=run.tokenizer,
        unet=run.unet,
        scheduler=DPMSolverMultistepScheduler.from_pretrained(run.model_dir, subfolder="scheduler"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


@torch.no_grad()
def _validate(run: _Run, dest: Path) -> list[Path]:
    """Generate sample images with the current embedding (main process only)."""
    config, unet, text_encoder = run.config, run.unet, run.text_encoder
    write_rows(text_encoder, run.token_ids, run.vectors)
    learned = run.hook.learned
    run.hook.learned = lambda ids, out: out  # the rows are in the matrix now
    was_training = (unet.training, text_encoder.training)
    unet.eval()
    text_encoder.eval()
    try:
        pipe = _sampling_pipeline(run)
        pipe.set_progress_bar_config(disable=True)
        gen = torch.Generator().manual_seed(config.seed)
        prompts = [config.validation_prompt] * config.num_validation_images
        with run.accelerator.autocast():  # the UNet may hold bf16 weights
            images = pipe(prompts, num_inference_steps=25, generator=gen, callback_on_step_end=_beat).images
    finally:
        unet.train(was_training[0])
        text_encoder.train(was_training[1])
        run.hook.learned = learned
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=_mkdir(dest.parent)))
    for i, image in enumerate(images):
        image.save(tmp / f"{i:02d}.png")
    _replace_dir(tmp, dest)
    return [dest / f"{i:02d}.png" for i in range(len(images))]


def _beat(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
    """Sampling can outlast helpers.launch's stall limit: each denoising step counts as progress."""
    supervise.beat("validating", step)
    return callback_kwargs


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_full_pipeline(run: _Run, dest: Path) -> Path:
    """Save a complete diffusers pipeline with the extended tokenizer and text encoder."""
    from diffusers import StableDiffusionPipeline

    write_rows(run.text_encoder, run.token_ids, run.vectors)
    # Training never changes the UNet: reuse it unless it was cast to bf16, then load the original.
    unet = {"unet": run.unet} if run.unet.dtype == torch.float32 else {}
    base = StableDiffusionPipeline.from_pretrained(
        run.model_dir,
        text_encoder=run.text_encoder,
        tokenizer=run.tokenizer,
        safety_checker=None,
        requires_safety_checker=False,
        **unet,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=_mkdir(dest.parent)))
    try:
        base.save_pretrained(tmp, safe_serialization=True)
        _replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest

"""One optimisation step and what it draws on: data order, cached latents, keyed random draws, the loss.

:func:`training_step` is the engine's step and the one ``bench/`` times: whatever changes here is
what the benchmarks measure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from helpers.ranks import status
from helpers.training import data, families
from helpers.training.engine import TrainingDivergedError
from helpers.training.families import Family, ImageSizes, sd1

# --- data and latents --------------------------------------------------------------------------

SEED_SPACE = 2**64  # torch seeds are unsigned 64-bit: keys of large seeds wrap, smaller keys are unchanged


class EpochSampler(torch.utils.data.Sampler[int]):
    """A seeded shuffle that is the same on every process and changes with the epoch."""

    def __init__(self, length: int, seed: int):
        self.length, self.seed, self.epoch = length, seed, 0

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % SEED_SPACE)
        return iter(torch.randperm(self.length, generator=gen).tolist())

    def __len__(self) -> int:
        return self.length


class IndexedDataset(torch.utils.data.Dataset):
    """Adds each item's dataset index (``"index"``), the key of its random draws."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {"index": i, **self.dataset[i]}


LATENT_BATCH = 4
"""Views per VAE call. The encoder's rounding depends on the batch (measured: 2e-6 between batches
of 1 and 4), so the persistent latent cache (:mod:`helpers.training.engine.latents`) keeps whole batches."""


def pixel_layout(dtype: torch.dtype) -> torch.memory_format:
    """The memory layout of the pixels the VAE encodes in ``dtype``: channels-last in bf16, where
    oneDNN's convolutions then skip reordering their activations at every layer (measured on a Xeon
    with AMX, 4 views: 2.9 -> 1.2 s at 256 px, 16.8 -> 6.8 s at 512 px; 1.25x on an AVX-512 EPYC).
    fp32 keeps the plain layout: there it bought 1.09x, and its different rounding (2.5e-5 on the
    tiny model's latents) flipped the sign of one small element of the placeholder's gradient
    between the launcher tests' 2 x batch 1 and 1 x batch 2 runs (AdamW's first step is about
    lr x sign: the rows then differed by 2 lr). The layout is part of the latent cache's key."""
    return torch.channels_last if dtype == torch.bfloat16 else torch.contiguous_format


def view_batches(num_views: int, batch_size: int = LATENT_BATCH) -> list[range]:
    """The views each VAE call of :func:`cache_latents` encodes, in order."""
    return [range(s, min(s + batch_size, num_views)) for s in range(0, num_views, batch_size)]


@torch.no_grad()
def encode_views(
    vae, dataset: data.ConceptDataset, views: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One VAE call on these views; the latent distributions' mean and std (float32)."""
    pixels = torch.stack([dataset.view_pixels(v) for v in views]).to(vae.dtype)
    pixels = pixels.contiguous(memory_format=pixel_layout(vae.dtype))
    dist = vae.encode(pixels).latent_dist
    return dist.mean.float().contiguous(), dist.std.float().contiguous()  # as a cache entry reads back


def cache_latents(
    vae, dataset: data.ConceptDataset, batch_size: int = LATENT_BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode every view of the dataset once; return the latent distributions' mean and std."""
    encoded = [encode_views(vae, dataset, views) for views in view_batches(dataset.num_views, batch_size)]
    return torch.cat([m for m, _ in encoded]), torch.cat([s for _, s in encoded])


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator of one sample's random draws, keyed so any split of the work agrees."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_033 + index) % SEED_SPACE)


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


# --- the step ----------------------------------------------------------------------------------


class AllreduceCounter:
    """Averages a gradient over the processes and counts the bytes that took.

    The engine calls :meth:`all_reduce_mean` on the learned rows' gradient once per optimisation
    step; ``bench.allreduce`` registers :meth:`hook` as a DDP communication hook to count what DDP
    sends for the same step. ``bytes`` and ``calls`` (one per optimisation step) accumulate.
    """

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

    def average(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace the gradients of ``params`` by their mean over the ranks: one flat buffer, one
        all-reduce (:meth:`all_reduce_mean`); a missing gradient counts as zeros."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce_mean(flat)
        for p, g in zip(params, torch.split(flat, [p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p).clone()

    def hook(self, state, bucket):
        """A DDP communication hook: counts the bucket, then all-reduces it as DDP's default hook."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._count(bucket.buffer(), bucket.is_last())
        return allreduce_hook(None, bucket)


@dataclass(frozen=True)
class Names:
    """How a method names what it trains, in the messages of a run that diverged or got no gradient.

    Attributes:
        trains_well: where its learning rate trains well, in words.
        gradient: the gradient of what is trained.
        values: what is trained.
        reaches: what the gradient must reach.
    """

    trains_well: str
    gradient: str
    values: str
    reaches: str


TEXTUAL_INVERSION = Names(
    "textual inversion trains well at 1e-4 to 5e-3",
    "the gradient of the learned rows",
    "the learned embeddings",
    "the placeholder embedding",
)


@dataclass(kw_only=True)
class Update:
    """What the update after a step's micro-batches touches, for every method.

    Attributes:
        optimizer: over what is trained only.
        lr_scheduler: stepped after the optimizer, if any.
        allreduce: averages the gradients over the processes; None in one process (or under DDP).
        max_grad_norm: clip the gradients' norm to this (0: no clipping).
        mixed_precision: ``"no"`` or ``"bf16"``, named when a step diverges.
        names: what the messages call what is trained.
        gradient_checked: whether the first step's gradient was checked to reach what is trained.
    """

    optimizer: torch.optim.Optimizer
    lr_scheduler: Any | None = None
    allreduce: AllreduceCounter | None = None
    max_grad_norm: float = 0.0
    mixed_precision: str = "no"
    names: Names = TEXTUAL_INVERSION
    gradient_checked: bool = False


@dataclass(kw_only=True)
class StepParts(Update):
    """Everything one textual-inversion step touches: the frozen modules, the rows, the latents, the update.

    The engine builds it from the accelerator's objects (:func:`helpers.training.engine.setup.setup_run`);
    ``bench.common`` from plain ones. The rows take part through an :class:`~helpers.training.engine.rows.EmbeddingHook`
    installed on ``text_encoder`` by whoever built the parts.

    Attributes:
        unet, text_encoder, noise_scheduler: the frozen modules and the training noise schedule.
        learned: the :class:`~helpers.training.engine.rows.LearnedEmbeddings` (or a wrapper with ``.module``).
        latent_mean, latent_std: every view's cached latent distribution (:func:`cache_latents`).
        scaling_factor: the VAE's latent scaling factor.
        seed: the run's seed, the first key of every random draw.
        autocast: the forward pass's precision context (``accelerator.autocast``).
        backward: how to back-propagate a micro-batch's loss (``accelerator.backward`` divides it
            by the accumulation steps); plain ``loss.backward()`` by default.
        family: how prompts are encoded and the UNet called (:mod:`helpers.training.families`).
        text_encoder_2, learned_2: SDXL's second encoder and its rows (hooked in the same way).
        view_sizes: each cached view's :class:`~helpers.training.families.ImageSizes` (SDXL's
            ``time_ids``, so every example of a batch, a short last one too, gets its own).
    """

    unet: torch.nn.Module
    text_encoder: torch.nn.Module
    noise_scheduler: Any
    learned: torch.nn.Module
    latent_mean: torch.Tensor
    latent_std: torch.Tensor
    scaling_factor: float
    seed: int
    autocast: Callable[[], AbstractContextManager] = nullcontext
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    family: Family = sd1.FAMILY
    text_encoder_2: torch.nn.Module | None = None
    learned_2: torch.nn.Module | None = None
    view_sizes: Sequence[ImageSizes] = ()

    @property
    def vectors(self) -> torch.nn.Parameter:
        """The learned rows themselves (``num_vectors x hidden``), unwrapped."""
        return getattr(self.learned, "module", self.learned).vectors

    @property
    def all_vectors(self) -> list[torch.nn.Parameter]:
        """Every encoder's learned rows, in the family's order."""
        learned = [self.learned] if self.learned_2 is None else [self.learned, self.learned_2]
        return [getattr(m, "module", m).vectors for m in learned]

    def loss_inputs(self, batch: dict) -> tuple[tuple, tuple, list[ImageSizes]]:
        """The text encoders, a batch's token ids for each, and each example's sizes (SDXL's; none for SD v1)."""
        if self.text_encoder_2 is None:
            return (self.text_encoder,), (batch["input_ids"],), []
        sizes = [self.view_sizes[int(v)] for v in batch["view_index"]]
        return (self.text_encoder, self.text_encoder_2), (batch["input_ids"], batch["input_ids_2"]), sizes


def training_step(parts: StepParts, micro_batches: Sequence[dict], epoch: int, step: int) -> float:
    """One textual-inversion optimisation step: each micro-batch's loss and backward, then :func:`apply_update`.

    For each micro-batch: its loss (:func:`micro_batch_forward`) and ``parts.backward``. With several
    processes the learned rows' gradient is then averaged by one synchronous all-reduce of
    ``num_vectors x hidden`` floats (the frozen matrix has no gradient).

    Args:
        parts: the modules, rows, optimizer and latents.
        micro_batches: this process's batches of the step (``gradient_accumulation_steps`` of them,
            fewer at the end of an epoch), each with ``index``, ``view_index`` and ``input_ids``.
        epoch: the epoch, the second key of the random draws.
        step: the number of the step being taken (1 for the first), for progress reports.

    Returns:
        The mean loss of this process's micro-batches.

    Raises:
        TrainingDivergedError: see :func:`apply_update`.
    """
    if not micro_batches:
        raise ValueError("training_step needs at least one micro-batch")
    losses = []
    for batch in micro_batches:
        loss = micro_batch_forward(parts, batch, epoch)()
        parts.backward(loss)
        losses.append(loss.detach().item())
    apply_update(parts, parts.all_vectors, losses, step)
    return sum(losses) / len(losses)


def micro_batch_forward(parts: StepParts, batch: dict, epoch: int) -> Callable[[], torch.Tensor]:
    """One micro-batch's inputs, and its forward from them to its loss, to be called.

    The inputs: its latents, noise and timesteps drawn from generators keyed by (seed, epoch,
    dataset index), its token ids and sizes. The forward: the diffusion loss under ``parts.autocast``
    (what the loop also runs once on fake tensors, to lay the weights out: :func:`helpers.training.engine.prepack.lay_out`).
    """
    latents, noise, timesteps = draw_batch(
        parts.latent_mean,
        parts.latent_std,
        batch["index"],
        batch["view_index"],
        parts.noise_scheduler.config.num_train_timesteps,
        parts.seed,
        epoch,
    )
    encoders, input_ids, sizes = parts.loss_inputs(batch)

    def forward() -> torch.Tensor:
        with parts.autocast():
            scaled = latents * parts.scaling_factor
            return families.diffusion_loss(
                parts.family,
                parts.unet,
                encoders,
                parts.noise_scheduler,
                input_ids,
                scaled,
                noise,
                timesteps,
                sizes,
            )

    return forward


def apply_update(
    update: Update, params: list[torch.nn.Parameter], losses: Sequence[float], step: int
) -> None:
    """The update after a step's micro-batches were back-propagated, the same for every method.

    With several processes the gradients are averaged by one synchronous all-reduce; then the
    first step checks the gradient reached ``params``, the gradients are clipped (if asked) and
    optimizer and scheduler step. A loss, gradient or value that is not finite stops the run at
    once (all processes see the same averaged gradient and values, so all stop at the same step).

    Raises:
        TrainingDivergedError: the loss, a gradient or a value is not finite; the message names
            the step and the likely cause.
    """
    if update.allreduce is not None:
        # a rank blocked here waits for a slower one; helpers.launch blames that one
        status.beat(status.WAITING, step)
        update.allreduce.average(params)
    bad = [x for x in losses if not math.isfinite(x)]
    if bad:
        raise diverged(update, step, "the loss", bad[0])
    for grad in (p.grad for p in params if p.grad is not None):
        if not torch.isfinite(grad).all():
            raise diverged(update, step, update.names.gradient, _first_bad(grad))
    if update.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, update.max_grad_norm)
    if not update.gradient_checked:
        check_gradient_reaches(params, update.names.reaches)
        update.gradient_checked = True
    update.optimizer.step()
    if update.lr_scheduler is not None:
        update.lr_scheduler.step()
    update.optimizer.zero_grad()
    for values in params:
        if not torch.isfinite(values).all():
            raise diverged(update, step, update.names.values, _first_bad(values))


def _first_bad(tensor: torch.Tensor) -> float:
    return tensor.detach()[~torch.isfinite(tensor.detach())].flatten()[0].item()


def diverged(update: Update, step: int, what: str, value: float) -> TrainingDivergedError:
    """The error that stops a run whose ``what`` became ``value`` (inf or nan) at ``step``."""
    lr = update.optimizer.param_groups[0]["lr"]
    causes = [f"the learning rate {lr:g} is too high ({update.names.trains_well})"]
    if update.mixed_precision == "bf16":
        causes.append("bf16 precision (try --mixed_precision no)")
    return TrainingDivergedError(
        f"training diverged at step {step}: {what} is not finite ({value}). Likely cause: "
        f"{' or '.join(causes)}. Nothing was saved as a finished run. Fix: lower --learning_rate and "
        f"start again with --overwrite_output_dir (or resume a checkpoint saved before step {step})."
    )


def check_gradient_reaches(
    params: torch.Tensor | Sequence[torch.Tensor], what: str = "the placeholder embedding"
) -> None:
    """Guard against setups (e.g. IPEX weight prepacking) that silently cut the gradient.

    Raises:
        RuntimeError: the gradient of ``params`` (a tensor or several) is None, zero or not finite.
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    total = sum(float(p.grad.abs().sum()) for p in params if p.grad is not None)
    if not math.isfinite(total) or not total > 0:
        raise RuntimeError(
            f"the gradient did not reach {what} (it is None, zero or not finite), so training would "
            "change nothing. If use_ipex is on, run without it; otherwise report this bug."
        )

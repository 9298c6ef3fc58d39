"""From checked settings to a run ready to train: accelerator, modules, rows, cached latents, schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

from helpers.core import cpu
from helpers.ranks import backend, status
from helpers.training import data, models
from helpers.training.config import PREPACK_DEFAULT_BELOW_RESOLUTION, TrainConfig, prepacks
from helpers.training.engine import attention, events, latents, loop, prepack, tracking
from helpers.training.engine.encoder_rows import add_placeholder_rows
from helpers.training.engine.rows import EmbeddingHook, LearnedEmbeddings, placeholder_tokens_for
from helpers.training.engine.saving import PipelineCopy
from helpers.training.engine.step import AllreduceCounter, EpochSampler, IndexedDataset, StepParts
from helpers.training.families import Family, ImageSizes, load_text_encoders, sd1, sdxl

logger = get_logger(__name__)


@dataclass(kw_only=True)
class Run(loop.Run):
    """A textual-inversion run ready to train, and what saving and sampling need of it
    (the fields of every run: :class:`helpers.training.engine.loop.Run`).

    Attributes:
        tokenizer, text_encoder, unet: with the placeholder tokens added (the UNet may be bf16).
        token_ids, tokens: the new tokens' ids and names.
        hook: routes the text encoder's embedding through the learned rows while training.
        parts: what :func:`~helpers.training.engine.step.training_step` needs.
        copied: the base model's files being copied for ``save_as_full_pipeline`` (main process).
        family: the model's family (:mod:`helpers.training.families`).
        tokenizer_2, text_encoder_2, token_ids_2, hook_2: SDXL's second encoder, as the first's.
    """

    tokenizer: Any
    text_encoder: Any
    unet: Any
    token_ids: list[int]
    tokens: list[str]
    hook: EmbeddingHook
    parts: StepParts
    copied: PipelineCopy | None = None
    family: Family = sd1.FAMILY
    tokenizer_2: Any = None
    text_encoder_2: Any = None
    token_ids_2: list[int] = dataclasses.field(default_factory=list)
    hook_2: EmbeddingHook | None = None

    @property
    def vectors(self) -> torch.nn.Parameter:
        """The learned rows (of the first text encoder)."""
        return self.parts.vectors

    @property
    def encoders(self) -> list[tuple[Any, Any, list[int], EmbeddingHook, torch.nn.Parameter]]:
        """``(tokenizer, text_encoder, token_ids, hook, vectors)`` of every text encoder, in the family's order."""
        firsts = [(self.tokenizer, self.text_encoder, self.token_ids, self.hook)]
        if self.text_encoder_2 is not None:
            firsts.append((self.tokenizer_2, self.text_encoder_2, self.token_ids_2, self.hook_2))
        return [(*f, v) for f, v in zip(firsts, self.parts.all_vectors, strict=True)]


def make_accelerator(
    precision: cpu.PrecisionChoice,
    gradient_accumulation_steps: int,
    report_to: str = "none",
    project_config: ProjectConfiguration | None = None,
) -> Accelerator:
    """accelerate's ``Accelerator`` on the CPU with this run's precision, in any process.

    accelerate keeps one state per process and refuses a second ``Accelerator`` with another
    precision ("AcceleratorState has already been initialized"). A second run in the same single
    process (a notebook kernel that trains twice, a test session) asks for that, for example bf16
    chosen by ``auto`` and then ``no``. Without a process group there is nothing in that state to
    keep, so it is cleared first; in a multi-process job (process group up) it is left alone.
    The process group's backend is the one the launcher chose (:func:`helpers.ranks.backend.init_backend`).
    ``report_to`` and ``project_config``: the trackers (:mod:`helpers.training.engine.tracking`).
    """
    backend.init_backend()
    if not torch.distributed.is_initialized():
        AcceleratorState._reset_state(reset_partial_state=True)  # public API has no other way
        GradientState._reset_state()
    return Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=precision.mixed_precision,
        cpu=True,
        log_with=tracking.log_with(report_to),
        project_config=project_config,
    )


def training_steps(config: TrainConfig, num_batches: int, num_processes: int) -> tuple[int, int]:
    """``(optimizer steps per epoch, optimizer steps in all)`` of a run.

    Args:
        config: its settings (a ``DreamBoothConfig`` has the same fields): ``gradient_accumulation_steps``,
            ``max_train_steps`` and, when that is not set, ``num_train_epochs``.
        num_batches: batches of one epoch over all processes (the loader's length before
            accelerate splits it).
        num_processes: processes of the job; each takes its share of the batches.
    """
    steps_per_epoch = math.ceil(math.ceil(num_batches / num_processes) / config.gradient_accumulation_steps)
    return steps_per_epoch, config.max_train_steps or config.num_train_epochs * steps_per_epoch


def make_lr_scheduler(config: TrainConfig, optimizer, max_steps: int, num_processes: int, power: float = 1.0):
    """The learning-rate schedule of a run: diffusers' ``get_scheduler`` as its training scripts call it.

    accelerate's prepared scheduler steps once per process at every optimizer step, so the warm-up
    and the length are counted in steps of all processes (``x num_processes``), as diffusers does.

    Args:
        config: its settings (a ``DreamBoothConfig`` has the same fields): ``lr_scheduler``,
            ``lr_warmup_steps``, ``lr_num_cycles``.
        optimizer: the optimizer it schedules (not prepared yet).
        max_steps: optimizer steps in all (:func:`training_steps`).
        num_processes: processes of the job.
        power: of the ``polynomial`` schedule (DreamBooth's ``lr_power``; 1.0 is diffusers' default).
    """
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        config.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=config.lr_warmup_steps * num_processes,
        num_training_steps=max_steps * num_processes,
        num_cycles=config.lr_num_cycles,
        power=power,
    )


def setup_run(
    config: TrainConfig, model_dir: Path, tokenizer, family: Family = sd1.FAMILY, tokenizer_2=None
) -> Run:
    """Load the modules, add the tokens, cache the latents, build optimizer, loader and schedule.

    Args:
        config: checked settings (:func:`helpers.training.textual_inversion.check_inputs`).
        model_dir: the base model's local folder.
        tokenizer: its tokenizer (the placeholder tokens are added to it).
        family: the model's family; SDXL trains rows in both encoders.
        tokenizer_2: SDXL's second tokenizer (the tokens are added to it too).
    """
    precision, accelerator = start_accelerator(config)
    tokenizers = (tokenizer,) if tokenizer_2 is None else (tokenizer, tokenizer_2)
    encoders, unet, noise_scheduler, token_ids = _load_modules(
        config, model_dir, tokenizers, family, precision
    )
    startup = _prepack(config, unet, encoders)
    tokens = placeholder_tokens_for(config.placeholder_token, config.num_vectors)
    dataset, cached, startup["latent_cache"] = _cached_dataset(
        config, model_dir, tokenizers, tokens, precision
    )
    learned = [
        LearnedEmbeddings(e.get_input_embeddings().weight[ids], ids)
        for e, ids in zip(encoders, token_ids, strict=True)
    ]
    learned, schedule = _optimization(config, accelerator, learned, dataset)
    counter = AllreduceCounter()
    second = len(encoders) > 1
    parts = StepParts(
        unet=unet, text_encoder=encoders[0], noise_scheduler=noise_scheduler, learned=learned[0],
        optimizer=schedule["optimizer"], latent_mean=cached.mean, latent_std=cached.std,
        scaling_factor=cached.scaling_factor, seed=config.seed, lr_scheduler=schedule["lr_scheduler"],
        autocast=accelerator.autocast, backward=accelerator.backward,
        allreduce=counter if accelerator.num_processes > 1 else None, mixed_precision=precision.mixed_precision,
        family=family, text_encoder_2=encoders[1] if second else None,
        learned_2=learned[1] if second else None, view_sizes=_view_sizes(dataset) if second else (),
    )  # fmt: skip
    return Run(
        config=config, accelerator=accelerator, precision=precision, model_dir=model_dir,
        output_dir=Path(config.output_dir), **schedule, counter=counter, startup=startup, tokenizer=tokenizer,
        prepacked=sum(startup.get("prepacked_convs", {}).get(k, 0) for k in ("convolutions", "linears")),
        text_encoder=encoders[0], unet=unet, token_ids=token_ids[0], tokens=tokens,
        hook=EmbeddingHook(encoders[0], learned[0]), parts=parts,
        family=family, tokenizer_2=tokenizer_2, text_encoder_2=parts.text_encoder_2,
        token_ids_2=token_ids[1] if second else [],
        hook_2=EmbeddingHook(encoders[1], learned[1]) if second else None,
    )  # fmt: skip


def _view_sizes(dataset: data.ConceptDataset) -> list[ImageSizes]:
    """Each view's sizes as SDXL's UNet is told them: the picture's own size, the crop the view took."""
    return [
        sdxl.view_sizes(
            dataset.original_size(v), dataset.size, dataset.center_crop, dataset.view_source(v)[1]
        )
        for v in range(dataset.num_views)
    ]


def start_accelerator(config: TrainConfig) -> tuple[cpu.PrecisionChoice, Accelerator]:
    """The precision for this CPU, the accelerator, the threads (a ``DreamBoothConfig`` has the same fields)."""
    precision = cpu.choose_precision(config.mixed_precision)
    accelerator = make_accelerator(
        precision,
        config.gradient_accumulation_steps,
        config.report_to,
        tracking.project_configuration(config.output_dir, config.logging_dir),
    )
    cpu.set_threads()
    logger.info(f"precision: {precision.reason}", main_process_only=True)
    if precision.warning:
        logger.warning(precision.warning, main_process_only=True)
    return precision, accelerator


def _prepack(config: TrainConfig, unet, text_encoders) -> dict:
    """Lay the frozen weights out for oneDNN once, as asked; return the start-up record (``prepacked_convs``)."""
    # None (the default): below 512 px, where the copies fit; True: asked for, so memory short is an input error
    convs, linears = (prepacks(f, config.resolution) for f in (config.prepack_convs, config.prepack_linears))
    if config.use_ipex:
        return {}  # IPEX lays weights out its own way
    # The text encoders' copies pay at any size where bf16 computes over their fp32 weights: their 77
    # tokens do not grow with the pictures, the copies replace the casts autocast makes of every
    # weight each step, and cost about nothing (two bf16 copies, the fp32 file pages going back).
    casts = any(next(e.parameters()).dtype != next(unet.parameters()).dtype for e in text_encoders)
    encoders = linears or (casts and config.prepack_linears is None)
    if not (convs or encoders):
        if config.prepack_convs is None and config.prepack_linears is None:
            why = f"not at {config.resolution} px (it pays below {PREPACK_DEFAULT_BELOW_RESOLUTION} px)"
            logger.info(f"frozen weights not laid out once: {why}", main_process_only=True)
            return {"prepacked_convs": dataclasses.asdict(prepack.PackResult(0, 0, why))}
        return {}
    packed = prepack.pack_unet(
        unet,
        convs=convs,
        linears=linears,
        text_encoders=text_encoders if encoders else (),
        required=[flag for flag in ("convs", "linears") if getattr(config, f"prepack_{flag}")],
    )
    packed.log(logger, main_process_only=True)
    return {"prepacked_convs": dataclasses.asdict(packed)}


def _cached_dataset(
    config: TrainConfig, model_dir: Path, tokenizers: tuple, tokens: list[str], precision: cpu.PrecisionChoice
) -> tuple[data.ConceptDataset, latents.CachedLatents, dict | None]:
    """The concept's pictures under the new tokens, their cached latents, and the cache's start-up record."""
    dataset = data.ConceptDataset(
        config.train_data_dir,
        tokenizers[0],
        " ".join(tokens),
        learnable_property=config.learnable_property,
        size=config.resolution,
        repeats=config.repeats,
        center_crop=config.center_crop,
        seed=config.seed,
        tokenizer_2=tokenizers[1] if len(tokenizers) > 1 else None,
    )
    # The VAE is loaded only when latents are missing, and freed once they are encoded. bf16 runs
    # encode in bf16, as diffusers' script does (2x faster than fp32 here; docs/architecture.md).
    cache_dir = latents.cache_root(config.latent_cache, config.latent_cache_dir)
    vae_dtype = cpu.compute_dtype(precision.mixed_precision)

    def load_vae(*args) -> Any:
        vae = models.load_frozen_vae(*args)
        events.publish(events.WeightsLoaded())  # the last weight read: what follows is training's memory
        return vae

    cached = latents.cached_latents(cache_dir, model_dir, dataset, vae_loader=load_vae, dtype=vae_dtype)
    if not cached.vae_loaded:
        events.publish(events.WeightsLoaded())
    report = cached.report(cache_dir) if cache_dir else None
    status.beat("latents cached")
    return dataset, cached, report


def _optimization(config: TrainConfig, accelerator: Accelerator, learned: list, dataset) -> tuple[list, dict]:
    """AdamW over the learned rows (every encoder's), the loader, the schedule; all prepared by
    accelerate. Returns the prepared rows (one module per text encoder) and
    :class:`~helpers.training.engine.loop.Run`'s fields for the rest."""
    lr = config.learning_rate
    if config.scale_lr:
        lr *= config.gradient_accumulation_steps * config.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(
        [p for rows in learned for p in rows.parameters()],
        lr=lr,
        betas=(config.adam_beta1, config.adam_beta2),
        weight_decay=config.adam_weight_decay,
        eps=config.adam_epsilon,
    )
    sampler = EpochSampler(len(dataset), config.seed)
    loader = torch.utils.data.DataLoader(
        IndexedDataset(dataset),
        batch_size=config.train_batch_size,
        sampler=sampler,
        num_workers=config.dataloader_num_workers,
    )
    steps_per_epoch, max_steps = training_steps(config, len(loader), accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(config, optimizer, max_steps, accelerator.num_processes)
    # The 3 KB of learned rows are not wrapped in DDP: after each synchronising backward one
    # synchronous all-reduce averages their gradient (see AllreduceCounter). A DDP reducer holds the
    # process group and, freed with the GIL held, joined gloo's threads while one of them waited for
    # the GIL: the exit deadlock of issue 11. evaluation_mode=True: mixed precision and checkpointing
    # as a prepared model, no DDP.
    learned = [accelerator.prepare_model(rows, evaluation_mode=True) for rows in learned]
    optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    return learned, dict(optimizer=optimizer, lr_scheduler=lr_scheduler, sampler=sampler, loader=loader,
                         steps_per_epoch=steps_per_epoch, max_steps=max_steps)  # fmt: skip


def _load_modules(
    config: TrainConfig, model_dir: Path, tokenizers: tuple, family: Family, precision: cpu.PrecisionChoice
):
    """Text encoders (trainable rows added to each), UNet, noise schedule; everything frozen. Not the
    VAE (:mod:`helpers.training.engine.latents` loads it only when latents are missing)."""
    # With bf16 the UNet, only ever read, is loaded in bf16, as diffusers' script casts it: no step
    # re-casts its 860 M weights (autocast would, and hold the casts for the backward). Saving the
    # full pipeline takes the UNet from the base model, untouched.
    dtype = cpu.compute_dtype(precision.mixed_precision)
    status.beat("loading")  # each phase of a start counts as progress for helpers.launch
    parts = models.load_components(model_dir, unet_dtype=dtype, load_vae=False, tokenizer=tokenizers[0])
    # SDXL's second encoder trains in fp32 too (diffusers' SDXL script holds it in the mixed precision)
    encoders = (parts.text_encoder, *load_text_encoders(model_dir, family, first=1))
    status.beat("loaded")
    unet, noise_scheduler = parts.unet, parts.noise_scheduler
    del parts
    token_ids = add_placeholder_rows(
        tokenizers, encoders, config.placeholder_token, config.initializer_token, config.num_vectors
    )
    for module in (*encoders, unet):
        module.requires_grad_(False)
    if processor := attention.processor_for(dtype):
        unet.set_attn_processor(processor)
    for module in (*encoders, unet):  # diffusers checkpoints only in training mode
        module.train(config.gradient_checkpointing)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        for encoder in encoders:
            encoder.gradient_checkpointing_enable()
    if config.use_ipex:
        cpu.apply_ipex(unet, dtype)
    return encoders, unet, noise_scheduler, token_ids

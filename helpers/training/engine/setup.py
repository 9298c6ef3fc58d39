"""From checked settings to a run ready to train: accelerator, modules, rows, cached latents, schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

from helpers.core import cpu
from helpers.ranks import backend, status
from helpers.training import data, models
from helpers.training.config import TrainConfig
from helpers.training.engine import attention, latents, prepack, tracking
from helpers.training.engine.rows import (
    EmbeddingHook,
    LearnedEmbeddings,
    add_placeholder_tokens,
    placeholder_tokens_for,
)
from helpers.training.engine.step import AllreduceCounter, EpochSampler, IndexedDataset, StepParts

logger = get_logger(__name__)


@dataclass
class Run:
    """A run ready to train, and what saving and sampling need of it.

    Attributes:
        config: the settings.
        accelerator: the processes, precision and prepared objects.
        precision: the precision chosen for this CPU (:func:`helpers.core.cpu.choose_precision`).
        model_dir: the local folder of the base model.
        output_dir: where the run writes.
        tokenizer, text_encoder, unet: with the placeholder tokens added (the UNet may be bf16).
        token_ids, tokens: the new tokens' ids and names.
        hook: routes the text encoder's embedding through the learned rows while training.
        parts: what :func:`~helpers.training.engine.step.training_step` needs.
        counter: the all-reduce byte counter (all-reduces only with several processes).
        sampler, loader: the data order and the prepared loader.
        steps_per_epoch, max_steps, num_epochs: the schedule.
        startup: what start-up did (prepacked convolutions, the latent cache), recorded in ``run_summary.json``.
    """

    config: TrainConfig
    accelerator: Accelerator
    precision: cpu.PrecisionChoice
    model_dir: Path
    output_dir: Path
    tokenizer: Any
    text_encoder: Any
    unet: Any
    token_ids: list[int]
    tokens: list[str]
    hook: EmbeddingHook
    parts: StepParts
    counter: AllreduceCounter
    sampler: EpochSampler
    loader: Any
    steps_per_epoch: int
    max_steps: int
    num_epochs: int
    startup: dict = field(default_factory=dict)

    @property
    def vectors(self) -> torch.nn.Parameter:
        """The learned rows."""
        return self.parts.vectors


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


def setup_run(config: TrainConfig, model_dir: Path, tokenizer) -> Run:
    """Load the modules, add the tokens, cache the latents, build optimizer, loader and schedule.

    Args:
        config: checked settings (:func:`helpers.training.textual_inversion.check_inputs`).
        model_dir: the base model's local folder.
        tokenizer: its tokenizer (the placeholder tokens are added to it).
    """
    precision, accelerator = _start_accelerator(config)
    text_encoder, unet, noise_scheduler, token_ids = _load_modules(config, model_dir, tokenizer, precision)
    startup = _prepack(config, unet, text_encoder)
    tokens = placeholder_tokens_for(config.placeholder_token, config.num_vectors)
    dataset, cached, startup["latent_cache"] = _cached_dataset(
        config, model_dir, tokenizer, tokens, precision
    )
    learned = LearnedEmbeddings(text_encoder.get_input_embeddings().weight[token_ids], token_ids)
    opt = _optimization(config, accelerator, learned, dataset)
    counter = AllreduceCounter()
    parts = StepParts(
        unet=unet,
        text_encoder=text_encoder,
        noise_scheduler=noise_scheduler,
        learned=opt.learned,
        optimizer=opt.optimizer,
        latent_mean=cached.mean,
        latent_std=cached.std,
        scaling_factor=cached.scaling_factor,
        seed=config.seed,
        lr_scheduler=opt.lr_scheduler,
        autocast=accelerator.autocast,
        backward=accelerator.backward,
        allreduce=counter if accelerator.num_processes > 1 else None,
        mixed_precision=precision.mixed_precision,
    )
    return Run(
        config=config, accelerator=accelerator, precision=precision, model_dir=model_dir,
        output_dir=Path(config.output_dir), tokenizer=tokenizer, text_encoder=text_encoder, unet=unet,
        token_ids=token_ids, tokens=tokens, hook=EmbeddingHook(text_encoder, opt.learned), parts=parts,
        counter=counter, sampler=opt.sampler, loader=opt.loader, steps_per_epoch=opt.steps_per_epoch,
        max_steps=opt.max_steps, num_epochs=math.ceil(opt.max_steps / opt.steps_per_epoch), startup=startup,
    )  # fmt: skip


def _start_accelerator(config: TrainConfig) -> tuple[cpu.PrecisionChoice, Accelerator]:
    """The precision for this CPU, the accelerator (every rank waiting for the others), the threads."""
    precision = cpu.choose_precision(config.mixed_precision)
    accelerator = make_accelerator(
        precision,
        config.gradient_accumulation_steps,
        config.report_to,
        tracking.project_configuration(config.output_dir, config.logging_dir),
    )
    # Every rank has read the output folder's state (check_inputs) before the main process
    # changes it (prepare_output_dir). Starting the process group usually waits for all ranks
    # anyway; under Ray Train the group exists before train() is called, so wait here.
    accelerator.wait_for_everyone()
    cpu.set_threads()
    logger.info(f"precision: {precision.reason}", main_process_only=True)
    if precision.warning:
        logger.warning(precision.warning, main_process_only=True)
    return precision, accelerator


def _prepack(config: TrainConfig, unet, text_encoder) -> dict:
    """Lay the frozen weights out for oneDNN once, as asked; return the start-up record (``prepacked_convs``)."""
    # None (the default): where the copies fit; True: asked for, so memory short is an input error
    convs, linears = config.prepack_convs is not False, config.prepack_linears is not False
    if not (convs or linears) or config.use_ipex:
        return {}  # IPEX lays weights out its own way
    packed = prepack.pack_unet(
        unet,
        convs=convs,
        linears=linears,
        text_encoder=text_encoder,
        required=[flag for flag in ("convs", "linears") if getattr(config, f"prepack_{flag}")],
    )
    packed.log(logger, main_process_only=True)
    return {"prepacked_convs": dataclasses.asdict(packed)}


def _cached_dataset(
    config: TrainConfig, model_dir: Path, tokenizer, tokens: list[str], precision: cpu.PrecisionChoice
) -> tuple[data.ConceptDataset, latents.CachedLatents, dict | None]:
    """The concept's pictures under the new tokens, their cached latents, and the cache's start-up record."""
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
    # The VAE is loaded only when latents are missing, and freed once they are encoded. bf16 runs
    # encode in bf16, as diffusers' script does (2x faster than fp32 here; docs/architecture.md).
    cache_dir = latents.cache_root(config.latent_cache, config.latent_cache_dir)
    vae_dtype = cpu.compute_dtype(precision.mixed_precision)
    cached = latents.cached_latents(cache_dir, model_dir, dataset, dtype=vae_dtype)
    report = cached.report(cache_dir) if cache_dir else None
    status.beat("latents cached")
    return dataset, cached, report


class _Optimization(NamedTuple):
    """The prepared learned rows, optimizer, data order, loader and learning-rate schedule."""

    learned: Any
    optimizer: Any
    lr_scheduler: Any
    sampler: EpochSampler
    loader: Any
    steps_per_epoch: int
    max_steps: int


def _optimization(config: TrainConfig, accelerator: Accelerator, learned, dataset) -> _Optimization:
    """AdamW over the learned rows, the loader, the schedule; all prepared by accelerate."""
    lr = config.learning_rate
    if config.scale_lr:
        lr *= config.gradient_accumulation_steps * config.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(
        learned.parameters(),
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
    learned = accelerator.prepare_model(learned, evaluation_mode=True)
    optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    return _Optimization(learned, optimizer, lr_scheduler, sampler, loader, steps_per_epoch, max_steps)


def _load_modules(config: TrainConfig, model_dir: Path, tokenizer, precision: cpu.PrecisionChoice):
    """Text encoder (trainable rows added), UNet, noise schedule; everything frozen. Not the VAE
    (:mod:`helpers.training.engine.latents` loads it only when latents are missing)."""
    # With bf16 the UNet, only ever read, is loaded in bf16, as diffusers' script casts it: no step
    # re-casts its 860 M weights (autocast would, and hold the casts for the backward). Saving the
    # full pipeline takes the UNet from the base model, untouched.
    dtype = cpu.compute_dtype(precision.mixed_precision)
    status.beat("loading")  # each phase of a start counts as progress for helpers.launch
    parts = models.load_components(model_dir, unet_dtype=dtype, load_vae=False, tokenizer=tokenizer)
    status.beat("loaded")
    text_encoder, unet = parts.text_encoder, parts.unet
    noise_scheduler = parts.noise_scheduler
    del parts
    token_ids = add_placeholder_tokens(
        tokenizer, text_encoder, config.placeholder_token, config.initializer_token, config.num_vectors
    )
    for module in (text_encoder, unet):
        module.requires_grad_(False)
    if processor := attention.processor_for(dtype):
        unet.set_attn_processor(processor)
    text_encoder.train(config.gradient_checkpointing)
    unet.train(config.gradient_checkpointing)  # diffusers checkpoints only in training mode
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        text_encoder.gradient_checkpointing_enable()
    if config.use_ipex:
        cpu.apply_ipex(unet, dtype)
    return text_encoder, unet, noise_scheduler, token_ids

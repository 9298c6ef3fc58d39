"""The DreamBooth-LoRA training loop, built from the textual-inversion engine's pieces.

The maths is diffusers' ``train_dreambooth_lora.py``: each step denoises a batch of subject
pictures under the instance prompt and, with prior preservation, as many class pictures under the
class prompt, in one UNet call (subject first, class second); the loss is the subject half's MSE
plus ``prior_loss_weight`` times the class half's. What differs, for CPUs:

* The VAE encodes every picture once before training; a step samples its latent from the cached
  mean and std (:func:`helpers.training.engine.step.cache_latents`), and the VAE is freed.
* With a frozen text encoder the two prompts are encoded once, before training.
* LoRA trains the attention's linear layers, so the UNet's convolutions stay frozen and run with
  weights laid out for oneDNN once (:mod:`helpers.training.engine.prepack`, ``--no-prepack_convs`` to turn
  it off), as in the textual-inversion engine.
* Every random draw of a sample (latent, noise, timestep) comes from a generator keyed by
  (seed, epoch, sample): the subject's by its item ``i``, the class picture's by ``items + i``
  (:func:`helpers.training.engine.step.draw_batch`); the shuffle is keyed by (seed, epoch). So a
  resumed run equals an uninterrupted one, and 2 processes x batch 1 equal 1 process x batch 2.
* Only the LoRA matrices are parameters. They are not wrapped in DDP: after each synchronising
  backward their gradients go into one flat buffer, averaged over the processes by one
  all-reduce (3.2 MB for SD v1.5 at rank 4, instead of the UNet's 3.4 GB), then clipped.
* Outputs are written by the main process only, each atomically; ``run_summary.json`` last
  (:mod:`helpers.dreambooth.saving`). The output folder's states, its lock, the checkpoints, the
  resume checks and the divergence stop are those of the textual-inversion engine.

``train(config)`` = :func:`check_inputs` -> :func:`setup_run` -> :func:`~helpers.dreambooth.saving.resume`
-> :func:`train_loop` (one :func:`training_step` per micro-batch) -> :func:`~helpers.dreambooth.saving.write_outputs`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from helpers.core import cpu
from helpers.core.outputs import SAMPLES
from helpers.dreambooth import class_images, saving
from helpers.dreambooth.config import DreamBoothConfig
from helpers.dreambooth.data import DreamBoothPairs, ImageViews
from helpers.dreambooth.lora import add_lora
from helpers.ranks import status
from helpers.training import data, models
from helpers.training.engine import TrainingDivergedError, prepack, tracking
from helpers.training.engine.checkpoints import check_not_past_the_end, resolve_checkpoint
from helpers.training.engine.folder import check_checkpoint_matches, check_output_dir, hold_output_dir
from helpers.training.engine.setup import make_accelerator, make_lr_scheduler, training_steps
from helpers.training.engine.step import EpochSampler, cache_latents, draw_batch

logger = get_logger(__name__)


@dataclass
class DreamBoothResult:
    """What a finished run produced."""

    output_dir: Path
    lora_weights_path: Path
    pipeline_dir: Path | None
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


# --- the loss ------------------------------------------------------------------------------------


def prior_preservation_loss(
    model_pred: torch.Tensor,
    target: torch.Tensor,
    with_prior_preservation: bool,
    prior_loss_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """DreamBooth's loss of one batch: ``(total, subject part, class part or None)``.

    With prior preservation the batch is the subject pictures followed by as many class pictures;
    each half's MSE is a mean over its own elements, and ``total = subject + weight x class``.
    """
    if not with_prior_preservation:
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss, loss, None
    pred, pred_prior = torch.chunk(model_pred, 2, dim=0)
    tgt, tgt_prior = torch.chunk(target, 2, dim=0)
    instance = F.mse_loss(pred.float(), tgt.float(), reduction="mean")
    prior = F.mse_loss(pred_prior.float(), tgt_prior.float(), reduction="mean")
    return instance + prior_loss_weight * prior, instance, prior


def dreambooth_loss(
    unet,
    noise_scheduler,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    with_prior_preservation: bool,
    prior_loss_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Noise the latents, predict with the UNet, and return :func:`prior_preservation_loss`.

    Args:
        latents: scaled latents ``[B, 4, h, w]`` (with prior preservation: subject half, then class half).
        noise, timesteps: the draws of each sample.
        encoder_hidden_states: the prompts' text-encoder outputs, one row per sample.
    """
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    pred = unet(noisy, timesteps, encoder_hidden_states).sample
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    return prior_preservation_loss(pred, target, with_prior_preservation, prior_loss_weight)


# --- inputs ----------------------------------------------------------------------------------------


def check_inputs(config: DreamBoothConfig) -> Path | None:
    """Every cheap check of a run, before any model loads and before anything is written.

    The output folder as the textual-inversion engine checks it
    (:func:`helpers.training.engine.folder.check_output_dir`: not in use, no finished or interrupted
    run these settings would clobber), the pictures, and the checkpoint to resume (complete, of
    the same run, not past the last step).

    Returns:
        The checkpoint to resume, if any.

    Raises:
        InputError: a missing or unusable folder, a folder in use or holding another run, no checkpoint.
    """
    folder = check_output_dir(config, saving.DREAMBOOTH)
    data.validate_image_folder(config.instance_data_dir, min_size=config.resolution)
    if config.with_prior_preservation:
        class_images.check_folder(config)
        class_images.image_files(config.class_data_dir, min_size=config.resolution)  # corrupt files, now
    if not config.resume_from_checkpoint:
        return None
    ckpt = resolve_checkpoint(folder.path, config.resume_from_checkpoint)
    check_checkpoint_matches(ckpt, config, saving.DREAMBOOTH)
    if config.max_train_steps is not None:
        check_not_past_the_end(ckpt, config.max_train_steps)
    return ckpt


# --- the run -------------------------------------------------------------------------------------


class GradientAverager:
    """Averages the LoRA gradients over the processes: one flat buffer, one synchronous all-reduce.

    Attributes:
        bytes, calls: what it all-reduced so far (one call per optimizer step).
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params, self.bytes, self.calls = params, 0, 0

    def __call__(self) -> None:
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(dist.get_world_size())  # as DDP: divide, then sum
        dist.all_reduce(flat)
        self.bytes += flat.numel() * flat.element_size()
        self.calls += 1
        for p, g in zip(self.params, torch.split(flat, [p.numel() for p in self.params]), strict=True):
            p.grad = g.view_as(p).clone()


@dataclass
class Run:
    """Everything a run in progress holds: settings, models, cached inputs, optimizer, counters."""

    config: DreamBoothConfig
    accelerator: Accelerator
    precision: cpu.PrecisionChoice
    model_dir: Path
    output_dir: Path
    unet: Any
    text_encoder: Any
    tokenizer: Any
    noise_scheduler: Any
    params: list[torch.nn.Parameter]
    latent_mean: torch.Tensor  # cached latents: subject pictures, then class pictures
    latent_std: torch.Tensor
    scaling: float
    prompt_ids: dict[str, torch.Tensor]
    fixed_states: dict[str, torch.Tensor] | None  # the encoded prompts, when the text encoder is frozen
    pairs: DreamBoothPairs
    sampler: EpochSampler
    loader: Any
    optimizer: Any
    lr_scheduler: Any
    averager: GradientAverager
    steps_per_epoch: int
    max_steps: int
    class_images: class_images.ClassImages | None = None
    started: float = field(default_factory=time.perf_counter)
    prepacked_convs: dict | None = None  # what prepack.pack_unet did, when prepack_convs is on
    step: int = 0  # the optimisation step being taken (1 for the first)

    @property
    def prior(self) -> bool:
        return self.config.with_prior_preservation

    @property
    def trained_text_encoder(self):
        """The text encoder if it has LoRA layers, else None."""
        return self.text_encoder if self.config.train_text_encoder else None


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    return tokenizer(prompt, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids  # fmt: skip


def _generation_dtype(config: DreamBoothConfig, training_dtype: torch.dtype) -> torch.dtype:
    if config.prior_generation_precision is None:
        return training_dtype
    return torch.bfloat16 if config.prior_generation_precision == "bf16" else torch.float32


def setup_run(config: DreamBoothConfig) -> Run:
    """Precision, the accelerator, class images, models with LoRA layers, cached latents and prompts, optimizer."""
    started = time.perf_counter()
    model_dir = models.resolve_model(config.pretrained_model_name_or_path, config.revision)
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
    dtype = cpu.compute_dtype(precision.mixed_precision)
    made = None
    if config.with_prior_preservation:
        made = class_images.ensure_class_images(
            config, model_dir, accelerator, _generation_dtype(config, dtype)
        )

    status.beat("loading")  # each phase of a start counts as progress for helpers.launch
    parts = models.load_components(model_dir, unet_dtype=dtype)  # the text encoder is always fp32
    status.beat("loaded")
    unet, text_encoder, vae = parts.unet, parts.text_encoder, parts.vae
    for module in (vae, unet, text_encoder):
        module.requires_grad_(False)
    vae.eval()
    params = add_lora(unet, text_encoder if config.train_text_encoder else None, config.rank, config.seed)
    packed = None
    # LoRA trains the attention's linear layers: the convolutions stay frozen (None: where they fit)
    if config.prepack_convs is not False:
        packed = prepack.pack_unet(unet, required=["convs"] if config.prepack_convs else [])
        packed.log(logger, main_process_only=True)
    unet.train(config.gradient_checkpointing)  # diffusers checkpoints only in training mode
    text_encoder.train(config.gradient_checkpointing and config.train_text_encoder)
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if config.train_text_encoder:
            text_encoder.gradient_checkpointing_enable()

    views = [ImageViews(data.validate_image_folder(config.instance_data_dir), config.resolution)]
    if config.with_prior_preservation:
        files = class_images.image_files(config.class_data_dir)[: config.num_class_images]
        views.append(ImageViews(files, config.resolution))
    cached = [cache_latents(vae, v) for v in views]
    cpu.drop_module_file_pages(vae)  # not kept; loaded from a mapped file, it would stay resident
    status.beat("latents cached")
    prompt_ids = {"instance": _prompt_ids(parts.tokenizer, config.instance_prompt)}
    if config.with_prior_preservation:
        prompt_ids["class"] = _prompt_ids(parts.tokenizer, config.class_prompt)
    fixed_states = None
    if not config.train_text_encoder:  # a frozen text encoder: each prompt is encoded once
        with torch.no_grad():
            fixed_states = {k: text_encoder(v)[0] for k, v in prompt_ids.items()}
        cpu.drop_module_file_pages(text_encoder)  # unread until saving; its pages come back from the file

    pairs = DreamBoothPairs(views[0].num_views, views[1].num_views if len(views) > 1 else 0)
    lr = config.learning_rate
    if config.scale_lr:
        lr *= config.gradient_accumulation_steps * config.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)  # fmt: skip
    sampler = EpochSampler(len(pairs), config.seed)
    loader = torch.utils.data.DataLoader(
        pairs, batch_size=config.train_batch_size, sampler=sampler, num_workers=config.dataloader_num_workers
    )
    steps_per_epoch, max_steps = training_steps(config, len(loader), accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(config, optimizer, max_steps, accelerator.num_processes, config.lr_power)
    optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
    return Run(
        config, accelerator, precision, model_dir, Path(config.output_dir), unet, text_encoder, parts.tokenizer,
        parts.noise_scheduler, params, torch.cat([m for m, _ in cached]), torch.cat([s for _, s in cached]),
        vae.config.scaling_factor, prompt_ids, fixed_states, pairs, sampler, loader, optimizer, lr_scheduler,
        GradientAverager(params), steps_per_epoch, max_steps, made, started,
        packed and dataclasses.asdict(packed),
    )  # fmt: skip  # the VAE is not kept: it encoded each picture once, above


def _encoder_states(run: Run, n: int) -> torch.Tensor:
    """The prompts' text states for ``n`` subject items (and ``n`` class items): subject rows first."""
    keys = ["instance", "class"] if run.prior else ["instance"]
    if run.fixed_states is not None:
        return torch.cat([run.fixed_states[k].expand(n, -1, -1) for k in keys])
    return run.text_encoder(torch.cat([run.prompt_ids[k].expand(n, -1) for k in keys]))[0]


def training_step(
    run: Run, batch: dict[str, torch.Tensor], epoch: int, check_gradient: bool = False
) -> tuple[float, float, float | None]:
    """One micro-batch: keyed draws, the loss, backward; at a synchronising micro-batch also the
    all-reduce of the LoRA gradients, clipping and the optimizer step.

    Args:
        check_gradient: check that the gradient reached the LoRA matrices (the first step does).

    Returns:
        This process's losses ``(total, subject, class or None)`` of the micro-batch.
    """
    accelerator, config = run.accelerator, run.config
    with accelerator.accumulate(run.unet):
        index, views = batch["index"], batch["instance_view"]
        if run.prior:  # the class picture of item i draws with the key len(pairs) + i
            index = torch.cat([index, index + len(run.pairs)])
            views = torch.cat([views, batch["class_view"]])
        latents, noise, timesteps = draw_batch(run.latent_mean, run.latent_std, index, views,
                                               run.noise_scheduler.config.num_train_timesteps, config.seed, epoch)  # fmt: skip
        with accelerator.autocast():
            loss, instance, prior = dreambooth_loss(
                run.unet, run.noise_scheduler, latents * run.scaling, noise, timesteps,
                _encoder_states(run, len(batch["index"])), run.prior, config.prior_loss_weight,
            )  # fmt: skip
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            if accelerator.num_processes > 1:
                status.beat(
                    status.WAITING
                )  # a rank here waits for a slower one; helpers.launch blames that one
                run.averager()  # micro-batches accumulate locally; one all-reduce per step
            # after the all-reduce, so every process sees the same gradient and stops at the same step
            check_finite(run, loss, "the loss")
            check_finite(
                run, [p.grad for p in run.params if p.grad is not None], "the gradient of the LoRA matrices"
            )
            if config.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(run.params, config.max_grad_norm)
        if check_gradient:
            check_gradient_reaches(run.params)
        run.optimizer.step()
        run.lr_scheduler.step()
        run.optimizer.zero_grad()
        if accelerator.sync_gradients:
            check_finite(run, run.params, "the LoRA matrices")
    return loss.item(), instance.item(), None if prior is None else prior.item()


LORA_LEARNING_RATES = "1e-5 to 1e-3"
"""Where DreamBooth-LoRA trains well (diffusers' example uses 1e-4), named when a run diverges."""


def check_finite(run: Run, tensors: torch.Tensor | list[torch.Tensor], what: str) -> None:
    """Stop the run at once if ``what`` holds an inf or NaN, as the textual-inversion engine does.

    Raises:
        TrainingDivergedError: naming the step, the value, the likely cause and the fix.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    bad = next((t.detach() for t in tensors if not torch.isfinite(t.detach()).all()), None)
    if bad is None:
        return
    value = bad[~torch.isfinite(bad)].flatten()[0].item()
    lr = run.optimizer.param_groups[0]["lr"]
    causes = [f"the learning rate {lr:g} is too high (DreamBooth-LoRA trains well at {LORA_LEARNING_RATES})"]
    if run.precision.mixed_precision == "bf16":
        causes.append("bf16 precision (try --mixed_precision no)")
    at = f" at step {run.step}" if run.step else ""
    raise TrainingDivergedError(
        f"training diverged{at}: {what} is not finite ({value}). Likely cause: {' or '.join(causes)}. "
        f"Nothing was saved as a finished run. Fix: lower --learning_rate and start again with "
        f"--overwrite_output_dir (or resume a checkpoint saved before this step)."
    )


def check_gradient_reaches(params: list[torch.nn.Parameter]) -> None:
    """Guard against setups that silently cut the gradient: it must reach the LoRA matrices."""
    total = sum(float(p.grad.abs().sum()) for p in params if p.grad is not None)
    if not math.isfinite(total) or total <= 0:
        raise RuntimeError(
            "the gradient did not reach the LoRA matrices (it is None, zero or not finite), so training "
            "would change nothing. Report this bug with the model and settings used."
        )


def train_loop(run: Run, global_step: int, history: list[dict]) -> int:
    """Train from ``global_step`` to ``max_steps``: history, progress, checkpoints, validation.

    Returns:
        The last step.
    """
    accelerator, config = run.accelerator, run.config
    first_epoch = global_step // run.steps_per_epoch
    skip = (global_step % run.steps_per_epoch) * config.gradient_accumulation_steps
    num_epochs = math.ceil(run.max_steps / run.steps_per_epoch)
    progress = tqdm(total=run.max_steps, initial=global_step, desc="dreambooth-lora", unit="step",
                    disable=not accelerator.is_local_main_process)  # fmt: skip
    start, sums, micro, checked = time.perf_counter(), torch.zeros(3), 0, global_step > 0
    # A step allocates and frees gigabytes at SD v1.5 size (cpu.py). The bar is closed however the
    # loop ends, so an error is printed on a line of its own.
    with progress, cpu.keep_freed_memory():
        for epoch in range(first_epoch, num_epochs):
            run.sampler.epoch = epoch
            batches = (
                accelerator.skip_first_batches(run.loader, skip)
                if epoch == first_epoch and skip
                else run.loader
            )
            for batch in batches:
                run.step = global_step + 1
                losses = training_step(run, batch, epoch, check_gradient=not checked)
                checked = True
                sums += torch.tensor([x if x is not None else 0.0 for x in losses])
                micro += 1
                if not accelerator.sync_gradients:
                    continue
                global_step += 1
                means = accelerator.reduce(sums / micro, reduction="mean").tolist()
                record = {"step": global_step, "loss": means[0], "instance_loss": means[1]}
                if run.prior:
                    record["prior_loss"] = means[2]
                record.update(lr=run.lr_scheduler.get_last_lr()[0], seconds=time.perf_counter() - start)
                history.append(record)
                tracking.log_step(
                    accelerator,
                    global_step,
                    {k: v for k, v in record.items() if k not in ("step", "seconds")},
                )
                progress.update(1)
                progress.set_postfix(loss=f"{means[0]:.4f}")
                status.beat("training", global_step)  # helpers.launch's stall detection
                if global_step % config.checkpointing_steps == 0:
                    saving.save_checkpoint(run, global_step, history)
                sums, micro, start = torch.zeros(3), 0, time.perf_counter()
                if global_step >= run.max_steps:
                    break
            if global_step >= run.max_steps:
                break
            if (
                config.validation_prompt
                and config.num_validation_images
                and epoch % config.validation_epochs == 0
            ):
                saving.validate_on_main(run, run.output_dir / SAMPLES / f"epoch-{epoch}", global_step)
    return global_step


def train(config: DreamBoothConfig) -> DreamBoothResult:
    """Run DreamBooth-LoRA as configured; return what was produced.

    Works the same in one process and under ``helpers.launch`` (mpirun, torchrun): every process
    calls it; only the main process writes outputs, holding ``output_dir``'s lock from before the
    models load (:func:`helpers.training.engine.folder.hold_output_dir`).
    """
    ckpt = check_inputs(config)
    with hold_output_dir(config, saving.DREAMBOOTH):  # one run per folder
        return _train(config, ckpt)


def _train(config: DreamBoothConfig, ckpt: Path | None) -> DreamBoothResult:
    run = setup_run(config)
    start = saving.resume(run, ckpt)
    history = saving.prepare_output_dir(run, start)
    tracking.start(run.accelerator, "dreambooth_lora", dataclasses.asdict(config))
    # A run never trains past max_steps: resumed at its last step, it only writes the outputs.
    global_step = train_loop(run, start, history) if start < run.max_steps else start
    summary = saving.write_outputs(run, global_step, history)
    # Teardown as the textual-inversion engine does: every rank past the barrier, then the group destroyed.
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return DreamBoothResult(
        run.output_dir, saving.lora_path(run), saving.pipeline_path(run), history, summary
    )

"""DreamBooth-LoRA as a method of the run loop (:mod:`helpers.training.engine.loop`).

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
* Only the LoRA matrices are parameters. They are not wrapped in DDP: after a step's micro-batches
  their gradients go into one flat buffer, averaged over the processes by one all-reduce (3.2 MB
  for SD v1.5 at rank 4, instead of the UNet's 3.4 GB), then clipped
  (:func:`helpers.training.engine.step.apply_update`, as for textual inversion).
* The run's life (folder, lock, resume, checkpoints, divergence stop, summary) is the run loop's;
  what this method writes is in :mod:`helpers.dreambooth.saving`.

``train(config)`` = the run loop with :data:`METHOD`: :func:`check_inputs`, :func:`setup_run`,
one :func:`training_step` per optimisation step, then the LoRA file, samples and fused pipeline.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger

from helpers.core import cpu
from helpers.dreambooth import class_images, saving
from helpers.dreambooth.config import DreamBoothConfig
from helpers.dreambooth.data import DreamBoothPairs, ImageViews
from helpers.dreambooth.inputs import CheckedInputs, check_inputs
from helpers.dreambooth.lora import add_lora
from helpers.ranks import status
from helpers.training import data, families, models
from helpers.training.config import prepacks
from helpers.training.engine import events, limits, loop, prepack
from helpers.training.engine.setup import make_lr_scheduler, start_accelerator, training_steps
from helpers.training.engine.step import EpochSampler, Names, Update, apply_update, cache_latents, draw_batch
from helpers.training.families import Conditioning, Family, ImageSizes, sd1

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


# --- the run -------------------------------------------------------------------------------------

LORA = Names(
    "DreamBooth-LoRA trains well at 1e-5 to 1e-3",
    "the gradient of the LoRA matrices",
    "the LoRA matrices",
    "the LoRA matrices",
)
"""What the messages of a run that diverged (or got no gradient) call the LoRA."""


@dataclass(kw_only=True)
class Run(loop.Run):
    """A DreamBooth-LoRA run ready to train (the fields of every run: :class:`helpers.training.engine.loop.Run`).

    Attributes:
        unet, text_encoder, tokenizer, noise_scheduler: the models, with LoRA layers.
        family: the model's family; SDXL's second encoder is ``text_encoder_2`` (``tokenizer_2``).
        view_sizes: each cached picture's sizes (SDXL's ``time_ids``), subject pictures then class pictures.
        params: the LoRA matrices, the only parameters.
        update: what the update after each step touches (:func:`~helpers.training.engine.step.apply_update`).
        latent_mean, latent_std, scaling: the cached latents, subject pictures then class pictures.
        prompt_ids: the prompts' token ids, one tensor per tokenizer; fixed_states: their encodings
            when the text encoders are frozen.
        pairs: the items a batch draws (subject view, class view).
        class_images: what making the class pictures did, with prior preservation.
        started: ``time.perf_counter()`` when the run was set up.
        prepacked_convs: what prepack.pack_unet did, when prepack_convs is on.
    """

    unet: Any
    text_encoder: Any
    tokenizer: Any
    noise_scheduler: Any
    params: list[torch.nn.Parameter]
    update: Update
    latent_mean: torch.Tensor
    latent_std: torch.Tensor
    scaling: float
    prompt_ids: dict[str, list[torch.Tensor]]
    fixed_states: dict[str, Conditioning] | None
    pairs: DreamBoothPairs
    class_images: class_images.ClassImages | None = None
    started: float = field(default_factory=time.perf_counter)
    prepacked_convs: dict | None = None
    family: Family = sd1.FAMILY
    tokenizer_2: Any = None
    text_encoder_2: Any = None
    view_sizes: list[ImageSizes] = field(default_factory=list)

    @property
    def prior(self) -> bool:
        return self.config.with_prior_preservation

    @property
    def trained_text_encoder(self):
        """The text encoder if it has LoRA layers, else None."""
        return self.text_encoder if self.config.train_text_encoder else None

    @property
    def trained_text_encoder_2(self):
        """SDXL's second text encoder if it has LoRA layers, else None."""
        return self.text_encoder_2 if self.config.train_text_encoder else None

    @property
    def text_encoders(self) -> tuple:
        """The text encoders, in the family's order."""
        return (
            (self.text_encoder,) if self.text_encoder_2 is None else (self.text_encoder, self.text_encoder_2)
        )


def _generation_dtype(config: DreamBoothConfig, training_dtype: torch.dtype) -> torch.dtype:
    if config.prior_generation_precision is None:
        return training_dtype
    return torch.bfloat16 if config.prior_generation_precision == "bf16" else torch.float32


def setup_run(config: DreamBoothConfig) -> Run:
    """Precision, the accelerator, class images, models with LoRA layers, cached latents and prompts, optimizer."""
    started = time.perf_counter()
    model_dir = models.resolve_model(config.pretrained_model_name_or_path, config.revision)
    family = families.family_of(model_dir)
    per_step = config.train_batch_size * (2 if config.with_prior_preservation else 1)  # class pictures too
    limits.check_resolution(config.resolution, per_step, model_dir)  # its JSON only, before any model loads
    precision, accelerator = start_accelerator(config)
    dtype = cpu.compute_dtype(precision.mixed_precision)
    made = None
    if config.with_prior_preservation:
        made = class_images.ensure_class_images(
            config, model_dir, accelerator, _generation_dtype(config, dtype)
        )
    parts, encoder_2, params, packed = _load_models(config, model_dir, family, dtype)
    unet, vae = parts.unet, parts.vae
    tokenizers = (parts.tokenizer, *families.load_tokenizers(model_dir, family)[1:])
    encoders = (parts.text_encoder,) if encoder_2 is None else (parts.text_encoder, encoder_2)
    views = [ImageViews(data.validate_image_folder(config.instance_data_dir), config.resolution)]
    if config.with_prior_preservation:
        files = class_images.image_files(config.class_data_dir)[: config.num_class_images]
        views.append(ImageViews(files, config.resolution))
    cached = [cache_latents(vae, v) for v in views]
    cpu.drop_module_file_pages(vae)  # not kept; loaded from a mapped file, it would stay resident
    status.beat("latents cached")
    prompts = {"instance": config.instance_prompt}
    if config.with_prior_preservation:
        prompts["class"] = config.class_prompt
    prompt_ids = {k: families.tokenize(tokenizers, [p]) for k, p in prompts.items()}
    fixed_states = None
    if not config.train_text_encoder:  # frozen text encoders: each prompt is encoded once
        with torch.no_grad():
            fixed_states = {k: family.encode_prompt(encoders, ids) for k, ids in prompt_ids.items()}
        for encoder in encoders:  # unread until saving; their pages come back from the file
            cpu.drop_module_file_pages(encoder)
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
    counter = loop.AllreduceCounter()
    update = Update(optimizer=optimizer, lr_scheduler=lr_scheduler, max_grad_norm=config.max_grad_norm,
                    allreduce=counter if accelerator.num_processes > 1 else None,
                    mixed_precision=precision.mixed_precision, names=LORA)  # fmt: skip
    return Run(
        config=config, accelerator=accelerator, precision=precision, model_dir=model_dir,
        output_dir=Path(config.output_dir), optimizer=optimizer, lr_scheduler=lr_scheduler, sampler=sampler,
        loader=loader, steps_per_epoch=steps_per_epoch, max_steps=max_steps, counter=counter, unet=unet,
        text_encoder=parts.text_encoder, tokenizer=parts.tokenizer, noise_scheduler=parts.noise_scheduler,
        params=params, update=update,
        latent_mean=torch.cat([m for m, _ in cached]), latent_std=torch.cat([s for _, s in cached]),
        scaling=vae.config.scaling_factor, prompt_ids=prompt_ids, fixed_states=fixed_states, pairs=pairs,
        class_images=made, started=started, prepacked_convs=packed and dataclasses.asdict(packed),
        prepacked=packed.convolutions + packed.linears if packed else 0,
        family=family, tokenizer_2=tokenizers[1] if encoder_2 is not None else None, text_encoder_2=encoder_2,
        view_sizes=[size for v in views for size in v.sizes()],
    )  # fmt: skip  # the VAE is not kept: it encoded each picture once, above


def _load_models(config: DreamBoothConfig, model_dir: Path, family: Family, dtype: torch.dtype):
    """The model's parts (UNet in ``dtype``, frozen), SDXL's second text encoder (else None), the LoRA
    layers added; ``(parts, text_encoder_2, params, packed)``."""
    status.beat("loading")  # each phase of a start counts as progress for helpers.launch
    parts = models.load_components(model_dir, unet_dtype=dtype)  # the text encoders are always fp32
    encoder_2 = next(iter(families.load_text_encoders(model_dir, family, first=1)), None)
    status.beat("loaded")
    events.publish(events.WeightsLoaded())
    unet, text_encoder, vae = parts.unet, parts.text_encoder, parts.vae
    encoders = (text_encoder,) if encoder_2 is None else (text_encoder, encoder_2)
    for module in (vae, unet, *encoders):
        module.requires_grad_(False)
    vae.eval()
    train_text = config.train_text_encoder
    params = add_lora(unet, text_encoder if train_text else None, config.rank, config.seed,
                      text_encoder_2=encoder_2 if train_text else None)  # fmt: skip
    packed = None
    # LoRA trains the attention's linear layers: the convolutions stay frozen (None: below 512 px,
    # where they fit)
    if prepacks(config.prepack_convs, config.resolution):
        packed = prepack.pack_unet(unet, required=["convs"] if config.prepack_convs else [])
        packed.log(logger, main_process_only=True)
    unet.train(config.gradient_checkpointing)  # diffusers checkpoints only in training mode
    for encoder in encoders:
        encoder.train(config.gradient_checkpointing and train_text)
        if config.gradient_checkpointing and train_text:
            encoder.gradient_checkpointing_enable()
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return parts, encoder_2, params, packed


def conditioning(run: Run, n: int) -> Conditioning:
    """The prompts' conditioning for ``n`` subject items (and ``n`` class items): subject rows first,
    from the encodings made once where the text encoders are frozen."""
    keys = ["instance", "class"] if run.prior else ["instance"]
    if run.fixed_states is not None:
        states = [run.fixed_states[k] for k in keys]
        pooled = None
        if states[0].pooled_prompt_embeds is not None:
            pooled = torch.cat([c.pooled_prompt_embeds.expand(n, -1) for c in states])
        return Conditioning(torch.cat([c.prompt_embeds.expand(n, -1, -1) for c in states]), pooled)
    ids = [
        torch.cat([run.prompt_ids[k][e].expand(n, -1) for k in keys]) for e in range(len(run.text_encoders))
    ]
    return run.family.encode_prompt(run.text_encoders, ids)


def training_step(
    run: Run, micro_batches: list[dict[str, torch.Tensor]], epoch: int, step: int
) -> torch.Tensor:
    """One optimisation step: each micro-batch's keyed draws, loss and backward, then
    :func:`~helpers.training.engine.step.apply_update` (the all-reduce, clipping, optimizer).

    Returns:
        This process's mean losses ``[total, subject(, class)]`` over the micro-batches.
    """
    sums = torch.zeros(3)
    for batch in micro_batches:
        loss, instance, prior = micro_batch_forward(run, batch, epoch)()
        run.accelerator.backward(loss)  # divided by the accumulation steps
        sums += torch.tensor([loss.item(), instance.item(), 0.0 if prior is None else prior.item()])
    means = sums / len(micro_batches)
    apply_update(run.update, run.params, means[:1].tolist(), step)
    return means if run.prior else means[:2]


def micro_batch_forward(run: Run, batch: dict[str, torch.Tensor], epoch: int) -> Callable[[], tuple]:
    """One micro-batch's keyed draws, and its forward from them to its losses ``(total, subject,
    class or None)``, to be called: the prompts' conditioning, the family's prediction and target,
    prior preservation."""
    index, views = batch["index"], batch["instance_view"]
    if run.prior:  # the class picture of item i draws with the key len(pairs) + i
        index = torch.cat([index, index + len(run.pairs)])
        views = torch.cat([views, batch["class_view"]])
    latents, noise, timesteps = draw_batch(run.latent_mean, run.latent_std, index, views,
                                           run.noise_scheduler.config.num_train_timesteps, run.config.seed, epoch)  # fmt: skip
    sizes = [run.view_sizes[int(v)] for v in views] if run.view_sizes else ()

    def forward() -> tuple:
        with run.accelerator.autocast():
            cond = conditioning(run, len(batch["index"]))
            pred, target = families.prediction_and_target(
                run.family,
                run.unet,
                run.noise_scheduler,
                latents * run.scaling,
                noise,
                timesteps,
                cond,
                sizes,
            )
            return prior_preservation_loss(pred, target, run.prior, run.config.prior_loss_weight)

    return forward


# --- the method ----------------------------------------------------------------------------------


def train(config: DreamBoothConfig) -> DreamBoothResult:
    """Run DreamBooth-LoRA as configured (:func:`helpers.training.engine.loop.train`); return what was produced.

    Works the same in one process and under ``helpers.launch`` (mpirun, torchrun, Ray): every
    process calls it; only the main process writes outputs, holding ``output_dir``'s lock from
    before the models load (:func:`helpers.training.engine.folder.hold_output_dir`).
    """
    return loop.train(METHOD, config)


class DreamBoothLora(loop.Method):
    """DreamBooth-LoRA as a method of the run loop (:class:`helpers.training.engine.loop.Method`):
    the LoRA matrices are trained; the outputs are ``pytorch_lora_weights.safetensors``, samples
    after each ``validation_epochs`` and, with ``save_as_full_pipeline``, the fused ``pipeline/``."""

    name, title = "dreambooth_lora", "dreambooth-lora"
    layout = saving.DREAMBOOTH
    weights_name = "the LoRA weights"
    identical_key = "lora_identical_across_ranks"

    def check_inputs(self, config: DreamBoothConfig) -> CheckedInputs:
        """:func:`check_inputs`, then the model resolved and its family read (from its
        ``model_index.json``: a family this package cannot train is refused)."""
        checked = check_inputs(config)
        model_dir = models.resolve_model(config.pretrained_model_name_or_path, config.revision)
        return dataclasses.replace(checked, family=families.family_of(model_dir))

    def setup(self, config: DreamBoothConfig, checked: CheckedInputs) -> Run:
        return setup_run(config)

    def load_checkpoint(self, run: Run, ckpt: Path) -> None:
        saving.load_lora_checkpoint(run, ckpt)

    def step(self, run: Run, micro_batches: list[dict], epoch: int, step: int) -> torch.Tensor:
        return training_step(run, micro_batches, epoch, step)

    def forward(self, run: Run, micro_batch: dict, epoch: int) -> Callable[[], tuple]:
        return micro_batch_forward(run, micro_batch, epoch)

    def loss_parts(self, run: Run) -> tuple[str, ...]:
        return ("instance_loss", "prior_loss") if run.prior else ("instance_loss",)

    def images_per_step(self, run: Run) -> int:
        config = run.config
        pictures = (
            config.train_batch_size * config.gradient_accumulation_steps * run.accelerator.num_processes
        )
        return pictures * (2 if run.prior else 1)

    def trained(self, run: Run) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in run.params])

    def write_weights(self, run: Run, folder: Path) -> None:
        saving.write_weights(run, folder)

    def after_epoch(self, run: Run, epoch: int, step: int) -> None:
        config = run.config
        if (
            config.validation_prompt
            and config.num_validation_images
            and epoch % config.validation_epochs == 0
        ):
            dest = run.output_dir / saving.SAMPLES / f"epoch-{epoch}"
            saving.validate_on_main(run, dest, step)
            events.publish(events.Saved(step, "samples", dest))

    def write_outputs(self, run: Run, steps: int) -> None:
        saving.write_outputs(run, steps)

    def summary_extras(self, run: Run) -> dict:
        return saving.summary_extras(run)

    def result(self, run: Run, history: list[dict], summary: dict) -> DreamBoothResult:
        return DreamBoothResult(
            run.output_dir, saving.lora_path(run), saving.pipeline_path(run), history, summary
        )


METHOD = DreamBoothLora()

"""Build the toy-world models: a tiny Stable Diffusion v1 pipeline trained here, its judge, and its SDXL twin.

``python -m helpers.toyworld build --output_dir DIR`` (``--family sd1``, the default) renders the
world, then trains in phases:

1. **VAE** (``AutoencoderKL``, 4x downsampling: 64 px scenes become 16x16x4 latents).
2. **Latents**: every scene encoded once; the scaling factor makes their standard deviation 1.
3. **Text encoder + UNet** together (``CLIPTextModel`` with the real CLIP vocabulary,
   ``UNet2DConditionModel``), on the latents with captions, one in ten empty for guidance,
   with an exponential moving average of the weights (the EMA weights are what ships).
4. **Judge**: a small classifier of the toy's kind (or Pip), colour and background, trained on
   renders *including Pip*, half of them passed through the VAE so it judges generated images
   as well as clean ones.
5. **Evaluation and saving**: the pipeline (``StableDiffusionPipeline.save_pretrained`` layout),
   the judge and ``manifest.json`` with the command, seed, versions, sha256 of every file, final
   losses and the judge's scores.

``--family sdxl`` builds ``toyworld-xl``, a ``StableDiffusionXLPipeline`` of the same world, *grafted*
from a finished SD v1 build (``--base_model``, by default the shipped ``toyworld``) rather than
trained from scratch (:mod:`helpers.toyworld.graft`): the VAE, scheduler, tokenizer (twice) and judge
are the base's files, byte for byte; the two text encoders and the ``text_time`` UNet start from the
base's weights, arranged so that they compute what the base computed; then only the generator
phase runs (both encoders and the UNet, the same loss, captions, EMA and empty captions), for far
fewer steps. Its phases: scenes, latents (the base's VAE), generator.

Every random draw is keyed by (seed, phase, step), and each phase checkpoints its state in
``DIR.build/`` beside the output: an interrupted build resumes where it stopped and ends with the
same weights. The output folder appears only when the build is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from helpers.core import cpu
from helpers.core.errors import InputError, one_line
from helpers.core.files import replace_dir_atomic, write_path_atomic, write_text_atomic
from helpers.toyworld import graft, world
from helpers.toyworld.evaluate import evaluate
from helpers.toyworld.judge import JUDGE_DIR, Judge, load_judge, save_judge
from helpers.training.models import (
    SD_SCHEDULER_CONFIG,
    TINY_TEXT_CONFIG,
    build_clip_tokenizer,
    load_frozen_vae,
)

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PHASES = ("scenes", "vae", "latents", "generator", "judge")
TEXT_CONFIG = dict(TINY_TEXT_CONFIG, intermediate_size=64)  # CLIP's text tower, 32 wide, 2 layers
UNET_CONFIG = dict(
    sample_size=world.SIZE // 4,
    in_channels=4,
    out_channels=4,
    # no attention at 16x16: there it costs more than it gives; cross-attention at 8x8 and 4x4
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64, 96),
    layers_per_block=1,
    attention_head_dim=16,
    cross_attention_dim=TEXT_CONFIG["hidden_size"],
    norm_num_groups=16,
)
VAE_CONFIG = dict(
    sample_size=world.SIZE,
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(16, 32, 64),
    layers_per_block=1,
    norm_num_groups=16,
    mid_block_add_attention=False,
)


@dataclass
class BuildConfig:
    """Every knob of the SD v1 build (the defaults are what ships as ``toyworld``)."""

    family: ClassVar[str] = "sd1"
    phases: ClassVar[tuple[str, ...]] = PHASES

    output_dir: str = "toyworld"
    seed: int = 0
    num_scenes: int = 8000
    vae_steps: int = 1500
    vae_batch_size: int = 16
    vae_learning_rate: float = 1e-3
    unet_steps: int = 6000
    unet_batch_size: int = 32
    unet_learning_rate: float = 1e-3
    ema_decay: float = 0.999
    judge_steps: int = 600
    judge_batch_size: int = 64
    eval_images: int = 48
    checkpoint_every: int = 250


@dataclass
class XLBuildConfig:
    """Every knob of the SDXL build, grafted from an SD v1 build (the defaults are what ships as ``toyworld-xl``).

    The scenes and captions are drawn as the base's build drew them (the same ``seed`` and
    ``num_scenes`` give the same world); there is no VAE or judge to train.
    """

    family: ClassVar[str] = "sdxl"
    phases: ClassVar[tuple[str, ...]] = ("scenes", "latents", "generator")

    output_dir: str = "toyworld-xl"
    seed: int = 0
    base_model: str = "toyworld"  # the SD v1 toy world it is grafted from: "toyworld" or a built folder
    num_scenes: int = 8000
    unet_steps: int = 800
    unet_batch_size: int = 32
    unet_learning_rate: float = 2e-4
    ema_decay: float = 0.999
    eval_images: int = 48
    checkpoint_every: int = 250


CONFIGS: dict[str, type] = {"sd1": BuildConfig, "sdxl": XLBuildConfig}
"""The build's configuration class of each family (``--family``)."""


def _gen(cfg: BuildConfig, phase: str, step: int) -> torch.Generator:
    key = hashlib.sha256(f"{cfg.seed}:{phase}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))


def _to_tensor(images) -> torch.Tensor:
    """PIL images -> float tensor [N, 3, H, W] in [-1, 1]."""
    arr = np.stack([np.asarray(im, dtype=np.uint8) for im in images])
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 127.5 - 1.0


class _Phase:
    """A resumable phase: its state lives in ``<output>.build/<name>.pt``, saved atomically.

    ``state["seconds"]`` adds up the time spent in the phase over every run that worked on it,
    so an interrupted and resumed build still reports what it cost.
    """

    def __init__(self, work: Path, name: str):
        self.path = work / f"{name}.pt"
        self._since = time.perf_counter()

    def load(self) -> dict | None:
        """The phase's saved state (None if there is none); plain tensors and numbers only.

        ``weights_only=True``: the folder is on disk beside the output, and a file planted there
        must not run code. A file refused or unreadable is one line naming it and the fix.
        """
        if not self.path.exists():
            return None
        try:
            return torch.load(self.path, weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError) as err:
            raise InputError(
                f"{self.path} cannot be loaded: it is damaged or not plain tensors ({one_line(err).split('; ')[0][:160]}). "
                "Fix: delete it to redo that phase of the build"
            ) from None

    def save(self, state: dict) -> None:
        now = time.perf_counter()
        state["seconds"] = state.get("seconds", 0.0) + now - self._since
        self._since = now
        write_path_atomic(self.path, lambda tmp: torch.save(state, tmp))


def render_scenes(cfg: BuildConfig, work: Path) -> tuple[torch.Tensor, list[world.Scene]]:
    """The training scenes (never Pip) as uint8 pixels, cached in ``.build/scenes.pt``."""
    rng = random.Random(f"toyworld-scenes:{cfg.seed}")
    scenes = [world.random_scene(rng) for _ in range(cfg.num_scenes)]
    cache = _Phase(work, "scenes")
    state = cache.load()
    if state is None or state["num_scenes"] != cfg.num_scenes:
        pixels = torch.empty(cfg.num_scenes, 3, world.SIZE, world.SIZE, dtype=torch.uint8)
        for i, scene in enumerate(tqdm(scenes, desc="render scenes", unit="scene", mininterval=2)):
            pixels[i] = torch.from_numpy(np.array(world.render(scene, seed=i))).permute(2, 0, 1)
        state = {"num_scenes": cfg.num_scenes, "pixels": pixels}
        cache.save(state)
    return state["pixels"], scenes


def _pixels(uint8: torch.Tensor) -> torch.Tensor:
    return uint8.float() / 127.5 - 1.0


def _lr(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def _update(opt, loss: torch.Tensor, lr: float, state: dict, bar, clip: list | None = None) -> None:
    """One optimizer step at learning rate ``lr``; the loss goes into the phase's log and progress bar."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    opt.step()
    state["losses"].append(loss.detach().item())
    bar.update(1)
    bar.set_postfix(loss=f"{np.mean(state['losses'][-100:]):.4f}")


def _checkpoint_due(cfg: BuildConfig, step: int, total: int) -> bool:
    return (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total


def train_vae(cfg: BuildConfig, work: Path, pixels: torch.Tensor):
    """Phase 1: the autoencoder (L1 + MSE reconstruction, a tiny KL term as in Stable Diffusion)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(cfg.seed)
    vae = AutoencoderKL(**VAE_CONFIG)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_learning_rate, weight_decay=0.0)
    phase = _Phase(work, "vae")
    state = phase.load() or {"step": 0, "losses": []}
    if state["step"]:
        vae.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    bar = tqdm(total=cfg.vae_steps, initial=state["step"], desc="1/4 VAE", unit="step")
    for step in range(state["step"], cfg.vae_steps):
        g = _gen(cfg, "vae", step)
        idx = torch.randint(0, len(pixels), (cfg.vae_batch_size,), generator=g)
        x = _pixels(pixels[idx])
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=g)
        rec = vae.decode(z).sample
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + 1e-6 * dist.kl().mean()
        _update(opt, loss, _lr(step, cfg.vae_steps, cfg.vae_learning_rate), state, bar)
        if _checkpoint_due(cfg, step, cfg.vae_steps):
            state.update(step=step + 1, model=vae.state_dict(), optimizer=opt.state_dict())
            phase.save(state)
    bar.close()
    vae.eval().requires_grad_(False)
    return vae, state["losses"]


@torch.no_grad()
def encode_latents(
    cfg: BuildConfig, work: Path, vae, pixels: torch.Tensor, desc: str = "2/4 latents"
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Phase 2: every scene's latent distribution, and the scaling factor that gives std 1."""
    phase = _Phase(work, "latents")
    state = phase.load()
    if state is None:
        means, stds = [], []
        for start in tqdm(range(0, len(pixels), 256), desc=desc, unit="batch"):
            dist = vae.encode(_pixels(pixels[start : start + 256])).latent_dist
            means.append(dist.mean)
            stds.append(dist.std)
        mean, std = torch.cat(means), torch.cat(stds)
        state = {"mean": mean, "std": std, "scaling_factor": float(1.0 / mean.std())}
        phase.save(state)
    return state["mean"], state["std"], state["scaling_factor"]


def tokenize_captions(
    cfg: BuildConfig, tokenizer, scenes: list[world.Scene], variants: int = 4
) -> torch.Tensor:
    """``variants`` random captions per scene, tokenized: int ids ``[N, variants, 77]``."""
    rng = random.Random(f"toyworld-captions:{cfg.seed}")
    texts = [world.caption(s, rng) for s in scenes for _ in range(variants)]
    ids = tokenizer(
        texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    ).input_ids
    return ids.view(len(scenes), variants, -1)


Modules = dict[str, torch.nn.Module]
Predict = Callable[[Modules, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]
"""``predict(modules, input_ids, noisy_latents, timesteps, generator) -> noise prediction``: a
family's text encoder(s) and UNet called on one batch (``generator`` for any further draws)."""


def fit_generator(
    cfg, work: Path, latents: tuple[torch.Tensor, torch.Tensor, float], captions,
    make: Callable[[], Modules], predict: Predict, warmup: int, desc: str,
) -> tuple[Modules, list[float]]:  # fmt: skip
    """The generator phase of either family: text encoder(s) and UNet together on the cached latents.

    ``make()`` gives the modules to train, by name (the names key the phase's checkpoint); it runs
    inside the phase, so its time counts. The denoising loss on keyed batches (scene, caption
    variant, noise, timestep), AdamW with gradient clipping, warm-up then cosine, and an
    exponential moving average of every weight; returns the modules holding the EMA weights.
    """
    # imported here: diffusers costs 6.6 s CPU on top of this module (measured with time.process_time);
    # `python -m helpers.toyworld render-sample` and --help import it and need none
    from diffusers import DDPMScheduler

    mean, std, scaling = latents
    phase = _Phase(work, "generator")
    modules = make()
    params = [p for module in modules.values() for p in module.parameters()]
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=cfg.unet_learning_rate, weight_decay=0.01)
    scheduler = DDPMScheduler.from_config(SD_SCHEDULER_CONFIG)
    state = phase.load() or {"step": 0, "losses": []}
    if state["step"]:
        for name, module in modules.items():
            module.load_state_dict(state[name])
        opt.load_state_dict(state["optimizer"])
        for e, saved in zip(ema, state["ema"], strict=True):
            e.copy_(saved)
    for module in modules.values():
        module.train()
    bar = tqdm(total=cfg.unet_steps, initial=state["step"], desc=desc, unit="step")
    for step in range(state["step"], cfg.unet_steps):
        g = _gen(cfg, "generator", step)
        idx = torch.randint(0, len(mean), (cfg.unet_batch_size,), generator=g)
        variant = torch.randint(0, captions.shape[1], (cfg.unet_batch_size,), generator=g)
        z = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)) * scaling
        noise = torch.randn(z.shape, generator=g)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (cfg.unet_batch_size,), generator=g)
        pred = predict(modules, captions[idx, variant], scheduler.add_noise(z, noise, t), t, g)
        loss = F.mse_loss(pred, noise)
        lr = _lr(step, cfg.unet_steps, cfg.unet_learning_rate, warmup=warmup)
        _update(opt, loss, lr, state, bar, clip=params)
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params, strict=True):
                e.lerp_(p.detach(), 1 - decay)
        if _checkpoint_due(cfg, step, cfg.unet_steps):
            weights = {name: module.state_dict() for name, module in modules.items()}
            state.update(step=step + 1, **weights, optimizer=opt.state_dict(), ema=[e.clone() for e in ema])
            phase.save(state)
    bar.close()
    with torch.no_grad():
        for e, p in zip(ema, params, strict=True):
            p.copy_(e)
    for module in modules.values():
        module.eval()
    return modules, state["losses"]


def train_generator(
    cfg: BuildConfig, work: Path, latents: tuple[torch.Tensor, torch.Tensor, float], captions
):
    """Phase 3: text encoder and UNet together, from seeded random weights; returns the EMA copies."""

    def make() -> Modules:
        from diffusers import UNet2DConditionModel  # at call time: see fit_generator
        from transformers import CLIPTextConfig, CLIPTextModel

        torch.manual_seed(cfg.seed + 1)
        unet = UNet2DConditionModel(**UNET_CONFIG)
        torch.manual_seed(cfg.seed + 2)
        return {"unet": unet, "text_encoder": CLIPTextModel(CLIPTextConfig(vocab_size=49408, **TEXT_CONFIG))}

    def predict(modules: Modules, ids, noisy, t, g) -> torch.Tensor:
        hidden = modules["text_encoder"](ids)[0]
        return modules["unet"](noisy, t, hidden).sample

    modules, losses = fit_generator(
        cfg, work, latents, captions, make, predict, warmup=200, desc="3/4 text encoder + UNet"
    )
    return modules["text_encoder"], modules["unet"], losses


def _judge_batch(cfg: BuildConfig, step: int, vae, size: int, held_out: bool = False):
    """Fresh renders (Pip one time in six) with labels; half of them through the VAE and back."""
    rng = random.Random(f"toyworld-judge:{cfg.seed}:{'test' if held_out else 'train'}:{step}")
    scenes = [world.pip_scene(rng) if rng.random() < 1 / 6 else world.random_scene(rng) for _ in range(size)]
    x = _to_tensor([world.render(s, seed=rng.randrange(1 << 30)) for s in scenes])
    half = size // 2
    with torch.no_grad():
        x[:half] = vae.decode(vae.encode(x[:half]).latent_dist.mean).sample.clamp(-1, 1)
    return x, Judge.labels(scenes)


def train_judge(cfg: BuildConfig, work: Path, vae) -> tuple[Judge, dict[str, float]]:
    """Phase 4: the judge, and its accuracy on held-out renders (clean and through the VAE)."""
    torch.manual_seed(cfg.seed + 3)
    judge = Judge()
    opt = torch.optim.AdamW(judge.parameters(), lr=2e-3, weight_decay=1e-4)
    phase = _Phase(work, "judge")
    state = phase.load() or {"step": 0, "losses": []}
    if state["step"]:
        judge.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    judge.train()
    bar = tqdm(total=cfg.judge_steps, initial=state["step"], desc="4/4 judge", unit="step")
    for step in range(state["step"], cfg.judge_steps):
        x, labels = _judge_batch(cfg, step, vae, cfg.judge_batch_size)
        g = _gen(cfg, "judge", step)
        x = x + 0.08 * torch.rand(len(x), 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)
        loss = judge.loss(x, labels)
        _update(opt, loss, _lr(step, cfg.judge_steps, 2e-3), state, bar)
        if _checkpoint_due(cfg, step, cfg.judge_steps):
            state.update(step=step + 1, model=judge.state_dict(), optimizer=opt.state_dict())
            phase.save(state)
    bar.close()
    judge.eval()
    x, labels = _judge_batch(cfg, 0, vae, 600, held_out=True)
    with torch.no_grad():
        acc = judge.accuracy(x, labels)
    return judge, {**acc, "final_loss": _tail_mean(state["losses"], 50)}


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def file_hashes(folder: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file below ``folder`` except the manifest, by relative path."""
    folder = Path(folder)
    return {
        p.relative_to(folder).as_posix(): _sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST and not p.relative_to(folder).parts[0].startswith(".")
    }


def _versions() -> dict[str, str]:
    import diffusers
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__}  # fmt: skip


@dataclass
class Built:
    """What a family's phases made: how to save it, its judge, its entries in the manifest."""

    save: Callable[[Path], None]  # writes the pipeline and the judge into a folder
    judge: Judge
    records: dict[str, Any]  # the manifest's entries after build_seconds (final losses first)


def _tail_mean(losses: list[float], n: int) -> float | None:
    """The mean of the last ``n`` losses (None if the phase took no step)."""
    return float(np.mean(losses[-n:])) if losses else None


def train_sd1(cfg: BuildConfig, work: Path, pixels: torch.Tensor, scenes: list[world.Scene]) -> Built:
    """The SD v1 build's phases after the scenes: VAE, latents, generator, judge."""
    # imported here: the pipeline classes cost 6.6 s CPU on top of this module (measured with
    # time.process_time); `python -m helpers.toyworld render-sample` and --help import it and need none
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    vae, vae_losses = train_vae(cfg, work, pixels)
    latents = encode_latents(cfg, work, vae, pixels)
    vae.register_to_config(scaling_factor=latents[2])
    tokenizer = build_clip_tokenizer()
    captions = tokenize_captions(cfg, tokenizer, scenes)
    text, unet, unet_losses = train_generator(cfg, work, latents, captions)
    judge, judge_scores = train_judge(cfg, work, vae)

    def save(folder: Path) -> None:
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet,
            scheduler=PNDMScheduler.from_config(SD_SCHEDULER_CONFIG),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )  # fmt: skip
        pipe.save_pretrained(folder, safe_serialization=True)
        save_judge(judge, folder / JUDGE_DIR)

    final = {"vae": _tail_mean(vae_losses, 50), "text_encoder_unet": _tail_mean(unet_losses, 200),
             "judge": judge_scores.pop("final_loss")}  # fmt: skip
    return Built(save, judge, {"final_losses": final, "judge_held_out_accuracy": judge_scores})


def train_sdxl(
    cfg: XLBuildConfig, work: Path, pixels: torch.Tensor, scenes: list[world.Scene], base: Path
) -> Built:
    """The SDXL build's phases after the scenes: latents (the base's VAE), the grafted generator."""
    from transformers import CLIPTokenizer  # at call time: see train_sd1

    vae = load_frozen_vae(base)
    mean, std, _ = encode_latents(cfg, work, vae, pixels, desc="1/2 latents")
    latents = (mean, std, vae.config.scaling_factor)  # the base's, which its pipeline decodes with
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    captions = tokenize_captions(cfg, tokenizer, scenes)
    fit: dict[str, Any] = {}

    def make() -> Modules:
        modules, fit_record = graft.graft(base, tokenizer, cfg.seed)
        fit.update(fit_record)
        return modules

    modules, losses = fit_generator(cfg, work, latents, captions, make, graft.predict, warmup=graft.WARMUP_STEPS,
                                    desc="2/2 text encoders + UNet (SDXL)")  # fmt: skip
    records = {
        "final_losses": {"text_encoders_unet": _tail_mean(losses, 200)},
        "graft": {
            "base_model": cfg.base_model,
            "base_manifest_sha256": _sha256(base / MANIFEST),
            **fit,
            "loss_first_50_steps": float(np.mean(losses[:50])) if losses else None,
        },
    }
    return Built(lambda folder: graft.save_pipeline(base, modules, folder), load_judge(base), records)


def build(cfg: BuildConfig | XLBuildConfig, argv: list[str] | None = None) -> Path:
    """Run (or resume) every phase of ``cfg``'s family and write the finished model into ``cfg.output_dir``.

    The folder is complete or absent: the pipeline, judge and manifest are written to a
    temporary sibling and swapped in for any earlier build (:func:`helpers.core.files.replace_dir_atomic`);
    the phases' state stays in the sibling ``<output_dir>.build/`` until the build finishes.

    Raises:
        InputError: an SDXL build's base model is not an SD v1 toy world with a judge, or the
            build folder holds an interrupted build with other settings (before any work).
    """
    base = graft.check_base(cfg.base_model) if cfg.family == "sdxl" else None
    out = Path(cfg.output_dir)
    work = Path(f"{out}.build")
    work.mkdir(parents=True, exist_ok=True)
    settings = asdict(cfg) | {"output_dir": None}
    saved = work / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != settings:
        raise InputError(
            f"{work} holds an interrupted build with other settings. "
            f"Fix: use the same settings to resume it, or delete {work} to start over."
        )
    write_text_atomic(saved, json.dumps(settings, indent=1))
    cpu.set_threads()  # OMP_NUM_THREADS if set (a shared machine), else the physical cores
    pixels, scenes = render_scenes(cfg, work)
    if base is None:
        built = train_sd1(cfg, work, pixels, scenes)
    else:
        built = train_sdxl(cfg, work, pixels, scenes, base)
    phase_seconds = {
        name: round((_Phase(work, name).load() or {}).get("seconds", 0.0), 1) for name in cfg.phases
    }

    finishing = time.perf_counter()  # saving and evaluating: not part of any phase

    def fill(folder: Path) -> None:
        built.save(folder)
        scores = evaluate(folder, built.judge, num_images=cfg.eval_images, seed=cfg.seed)
        manifest = {
            "command": "python -m helpers.toyworld build " + shlex.join(argv or []),
            "settings": settings,
            "versions": _versions(),
            "machine": f"{cpu.report().model_name}, {os.cpu_count()} cores",
            "phase_seconds": phase_seconds,  # summed over every run that worked on the phase
            "build_seconds": round(sum(phase_seconds.values()) + time.perf_counter() - finishing, 1),
            **built.records,
            "generator_scores": scores,
            "files": file_hashes(folder),
        }
        write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=2))

    replace_dir_atomic(out, fill)  # the model appears complete or not at all
    shutil.rmtree(work)
    return out

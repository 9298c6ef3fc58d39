"""From settings to a run ready to train (:mod:`helpers.training.engine.setup`), on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_parts import tiny_config
from transformers import CLIPTokenizer

from helpers.core import cpu
from helpers.training import models
from helpers.training.engine import prepack, setup


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


class _Settings:
    lr_scheduler, lr_warmup_steps, lr_num_cycles = "cosine_with_restarts", 3, 2


def test_lr_scheduler_is_diffusers_counting_the_steps_of_every_process(monkeypatch):
    import diffusers.optimization

    calls = []
    real = diffusers.optimization.get_scheduler
    monkeypatch.setattr(
        diffusers.optimization, "get_scheduler", lambda *a, **k: calls.append((a, k)) or real(*a, **k)
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = setup.make_lr_scheduler(_Settings(), optimizer, max_steps=10, num_processes=2, power=2.0)
    assert calls == [(("cosine_with_restarts",), dict(optimizer=optimizer, num_warmup_steps=6,
                                                      num_training_steps=20, num_cycles=2, power=2.0))]  # fmt: skip
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)


def test_training_steps_count_optimizer_steps_per_process():
    config = type(
        "Settings", (), {"gradient_accumulation_steps": 2, "max_train_steps": None, "num_train_epochs": 3}
    )
    # 9 batches over 2 processes: 5 each, 3 optimizer steps of 2 micro-batches
    assert setup.training_steps(config(), num_batches=9, num_processes=2) == (3, 9)
    config.max_train_steps = 4
    assert setup.training_steps(config(), num_batches=9, num_processes=2) == (3, 4)


def test_weights_are_laid_out_once_by_default_below_512_px_only(tmp_path, tiny_dir):
    """Measured: the copies pay at 256 px and not at 512 px, where they only cost memory and a
    longer first step (helpers.training.config.PREPACK_DEFAULT_BELOW_RESOLUTION)."""
    from accelerate import PartialState

    from helpers.training.config import prepacks

    PartialState()  # the engine logs through accelerate, as in a run
    assert [prepacks(None, px) for px in (64, 256, 511, 512, 1024)] == [True, True, True, False, False]
    assert prepacks(True, 1024) and not prepacks(False, 64)  # a flag given is obeyed
    unet = models.load_components(tiny_dir, load_vae=False).unet.requires_grad_(False)  # frozen, as in a run
    record = setup._prepack(tiny_config(tmp_path, resolution=512), unet, [])
    assert record == {
        "prepacked_convs": {
            "convolutions": 0,
            "bytes": 0,
            "reason": "not at 512 px (it pays below 512 px)",
            "linears": 0,
        }
    }
    assert setup._prepack(tiny_config(tmp_path, resolution=512, prepack_convs=False), unet, []) == {}
    packed = setup._prepack(tiny_config(tmp_path, resolution=64), unet, [])["prepacked_convs"]
    assert packed["convolutions"] > 0 and packed["linears"] > 0 and packed["reason"] is None


@pytest.mark.skipif(not cpu.can_lay_out_bf16_weights(), reason="this CPU cannot lay bf16 weights out")
def test_a_bf16_run_lays_its_fp32_text_encoder_out_at_every_size(tmp_path, tiny_dir):
    """bf16 over the encoder's fp32 weights: the copies replace a cast of every weight each step, and
    its 77 tokens do not grow with the pictures, so at 512 px its linear layers are laid out and the
    UNet's not; an fp32 run, or --no-prepack_linears, lays nothing out there."""
    from accelerate import PartialState

    PartialState()
    parts = models.load_components(tiny_dir, unet_dtype=torch.bfloat16, load_vae=False)
    unet, encoder = (m.requires_grad_(False) for m in (parts.unet, parts.text_encoder))
    linears = [m for m in encoder.modules() if prepack.packable_linear(m)]
    config = tiny_config(tmp_path, resolution=512, mixed_precision="bf16")
    packed = setup._prepack(config, unet, [encoder])["prepacked_convs"]
    assert (packed["convolutions"], packed["linears"], packed["reason"]) == (0, len(linears), None)
    # the fp32 biases' pages go back too, for bf16 copies of half their size: a few bytes less memory
    said = prepack.PackResult(**packed).describe()
    assert (
        packed["bytes"] < 0 and said == f"{len(linears)} linear layers use weights laid out once (+0.00 GiB)"
    )
    assert [m for m in (*encoder.modules(), *unet.modules()) if prepack._packed_by(m)] == linears
    for module in linears:
        prepack.unpack(module)
    assert setup._prepack(tiny_config(tmp_path, resolution=512, prepack_linears=False), unet, [encoder]) == {}
    fp32 = models.load_components(tiny_dir, load_vae=False).unet.requires_grad_(False)
    assert (
        setup._prepack(config, fp32, [encoder])["prepacked_convs"]["reason"]
        == "not at 512 px (it pays below 512 px)"
    )

"""The textual-inversion engine on the offline tiny pipeline."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tiny_parts import sd1_loss, step_parts, tiny_config

from helpers.core import cpu
from helpers.training import data, families, models
from helpers.training import textual_inversion as ti
from helpers.training.config import TrainConfig
from helpers.training.engine import events
from helpers.training.engine.step import encode_views, pixel_layout


@pytest.fixture(scope="module")
def components():
    return models.load_components("tiny")


# --- the step ------------------------------------------------------------------------------------


def _fixed_batch(tok, ids, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = ["a photo of a <x>", "a rendering of the <x>"]
    input_ids = tok(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
    return [
        (
            input_ids,
            torch.randn(2, 4, 8, 8, generator=gen),
            torch.randn(2, 4, 8, 8, generator=gen),
            torch.randint(0, 1000, (2,), generator=gen),
        )
        for _ in range(steps)
    ]


def test_only_new_rows_train_and_match_full_matrix_with_restore():
    """Ours (only the new row is a parameter) equals the reference: whole matrix in AdamW,
    every other row restored after each step, weight decay 0."""
    steps = 5
    base = models.load_components("tiny")
    tok = models.build_clip_tokenizer()
    ids = ti.add_placeholder_tokens(tok, base.text_encoder, "<x>", "toy")
    batches = _fixed_batch(tok, ids, steps)
    ref_te = models.load_components("tiny").text_encoder
    ref_te.resize_token_embeddings(len(tok))
    ref_te.load_state_dict(base.text_encoder.state_dict())
    frozen_before = base.text_encoder.get_input_embeddings().weight.detach().clone()

    # reference: full matrix trainable, restore all but the new row
    ref_te.requires_grad_(False)
    emb = ref_te.get_input_embeddings().weight
    emb.requires_grad_(True)
    opt = torch.optim.AdamW([emb], lr=1e-2, weight_decay=0.0)
    keep = torch.ones(len(tok), dtype=torch.bool)
    keep[ids] = False
    original = emb.detach().clone()
    base.unet.requires_grad_(False)
    for input_ids, latents, noise, t in batches:
        loss = sd1_loss(base.unet, ref_te, base.noise_scheduler, input_ids, latents, noise, t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            emb[keep] = original[keep]

    # ours
    te = base.text_encoder
    te.requires_grad_(False)
    learned = ti.LearnedEmbeddings(te.get_input_embeddings().weight[ids], ids)
    hook = ti.EmbeddingHook(te, learned)
    opt = torch.optim.AdamW(learned.parameters(), lr=1e-2, weight_decay=0.0)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 32
    for input_ids, latents, noise, t in batches:
        loss = sd1_loss(base.unet, te, base.noise_scheduler, input_ids, latents, noise, t)
        loss.backward()
        opt.step()
        opt.zero_grad()
    hook.remove()

    moved = (learned.vectors.detach() - original[ids]).abs().max().item()
    assert moved > 1e-3  # it trained
    torch.testing.assert_close(learned.vectors.detach(), emb.detach()[ids], rtol=1e-5, atol=1e-6)
    # the frozen matrix was never touched
    assert torch.equal(te.get_input_embeddings().weight, frozen_before)


def _step_parts(seed=0):
    """A fresh tiny model, its dataset's cached latents and AdamW over one new row; two samples."""
    parts, ds = step_parts(seed=seed)
    items = [{"index": i, **ds[i]} for i in (3, 7)]
    return parts, items


def test_training_step_accumulated_equals_one_batch():
    """training_step over 2 micro-batches of 1 (each loss halved, as accelerator.backward does with
    accumulation 2) makes the same update as over 1 batch of 2: the keyed draws do not depend on
    how samples are grouped. Only the new row moves; the frozen matrix gets no gradient."""

    def collate(items):
        return {
            "index": torch.tensor([it["index"] for it in items]),
            "view_index": torch.tensor([it["view_index"] for it in items]),
            "input_ids": torch.stack([it["input_ids"] for it in items]),
        }

    whole, items = _step_parts()
    split, _ = _step_parts()
    split.backward = lambda loss: (loss / 2).backward()
    before = whole.vectors.detach().clone()
    frozen = whole.text_encoder.get_input_embeddings().weight.detach().clone()
    with _hooked(whole):
        loss_whole = ti.training_step(whole, [collate(items)], epoch=0, step=1)
    with _hooked(split):
        loss_split = ti.training_step(split, [collate(items[:1]), collate(items[1:])], epoch=0, step=1)
    assert loss_whole == pytest.approx(loss_split, rel=1e-5)
    assert (whole.vectors - before).abs().max() > 1e-3  # it trained (AdamW's first step: lr x sign)
    torch.testing.assert_close(whole.vectors.detach(), split.vectors.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(whole.text_encoder.get_input_embeddings().weight, frozen)
    assert whole.gradient_checked and whole.vectors.grad is None  # checked once, then zeroed


class _hooked:
    """Install an EmbeddingHook for the parts' rows for the duration of a ``with``."""

    def __init__(self, parts):
        self.parts = parts

    def __enter__(self):
        self.hook = ti.EmbeddingHook(self.parts.text_encoder, self.parts.learned)
        return self.hook

    def __exit__(self, *exc):
        self.hook.remove()


def test_cached_latents_equal_encoding_each_view(components):
    tok = models.build_clip_tokenizer()
    ds = data.ConceptDataset(data.sample_concept_dir(), tok, "<x>", size=64, repeats=1)
    mean, std = ti.cache_latents(components.vae, ds, batch_size=3)
    assert mean.shape == (ds.num_views, 4, 8, 8) == std.shape
    with torch.no_grad():
        for v in (0, 1, ds.num_views - 1):
            pixels = ds.view_pixels(v)[None].contiguous(memory_format=pixel_layout(components.vae.dtype))
            dist = components.vae.encode(pixels).latent_dist
            torch.testing.assert_close(mean[v], dist.mean[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(std[v], dist.std[0], rtol=1e-5, atol=1e-5)
    # flipped views are really different pixels, hence different latents
    assert not torch.allclose(mean[0], mean[1])


def test_bf16_views_reach_the_vae_channels_last_and_come_back_contiguous(components):
    """bf16 encodes channels-last pixels (oneDNN's fast layout), fp32 plain ones; the latents come
    back contiguous either way, as a latent cache entry reads back, so cold and warm runs agree."""
    tok = models.build_clip_tokenizer()
    ds = data.ConceptDataset(data.sample_concept_dir(), tok, "<x>", size=64, repeats=1)
    for dtype, channels_last in ((torch.bfloat16, True), (torch.float32, False)):
        vae = copy.deepcopy(components.vae).to(dtype)
        seen: list[bool] = []
        vae.encoder.conv_in.register_forward_pre_hook(
            lambda _, args, seen=seen: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
        )
        mean, std = encode_views(vae, ds, range(3))
        assert seen == [channels_last]
        assert mean.dtype == std.dtype == torch.float32 and mean.is_contiguous() and std.is_contiguous()


def test_sample_draws_are_keyed_not_stateful():
    m, s = torch.zeros(4, 8, 8), torch.ones(4, 8, 8)
    a = ti.draw_sample_noise(m, s, 1000, ti.sample_generator(1, 0, 5))
    torch.randn(100)  # unrelated global RNG use changes nothing
    b = ti.draw_sample_noise(m, s, 1000, ti.sample_generator(1, 0, 5))
    c = ti.draw_sample_noise(m, s, 1000, ti.sample_generator(1, 0, 6))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[1], c[1])


def test_gradient_guard_catches_a_dead_gradient():
    vec = torch.nn.Parameter(torch.zeros(1, 4))
    with pytest.raises(RuntimeError, match="did not reach the placeholder"):
        ti.check_gradient_reaches(vec)
    vec.grad = torch.zeros(1, 4)
    with pytest.raises(RuntimeError, match="use_ipex"):
        ti.check_gradient_reaches(vec)


# --- whole runs -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_vector_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ti")
    cfg = tiny_config(
        tmp,
        num_vectors=2,
        save_as_full_pipeline=True,
        checkpointing_steps=2,
        checkpoints_total_limit=2,
        save_steps=3,
        validation_prompt="a photo of <dicoo>",
        validation_steps=3,
        num_validation_images=2,
    )
    seen = []
    with events.listening(seen.append):
        result = ti.train(cfg)
    return cfg, result, seen


def test_listeners_are_told_each_step_and_each_save(two_vector_run):
    """The run's events: the weights loaded once before the first step; each step's record equal to
    its row of history.json, with images/s; a save record after each periodic save, at its step."""
    cfg, result, seen = two_vector_run
    assert (
        isinstance(seen[0], events.WeightsLoaded)
        and sum(isinstance(e, events.WeightsLoaded) for e in seen) == 1
    )
    steps = [e for e in seen if isinstance(e, events.StepEnded)]
    assert [e.history_record() for e in steps] == result.history
    assert all(e.max_steps == 6 and e.images_per_second == pytest.approx(1 / e.seconds) for e in steps)
    out = result.output_dir
    saves = [(e.step, e.what, e.path) for e in seen if isinstance(e, events.Saved)]
    assert [s for s in saves if s[1] != "samples"] == [
        (2, "checkpoint", out / "checkpoints" / "checkpoint-2"),
        (3, "weights", out / "learned_embeds-steps-3.safetensors"),
        (4, "checkpoint", out / "checkpoints" / "checkpoint-4"),
        (6, "checkpoint", out / "checkpoints" / "checkpoint-6"),
        (6, "weights", out / "learned_embeds-steps-6.safetensors"),
        (6, "outputs", out),
    ]
    after_step = {e.step: i for i, e in enumerate(seen) if isinstance(e, events.StepEnded)}
    assert all(seen.index(e) > after_step[e.step] for e in seen if isinstance(e, events.Saved))


def test_run_outputs(two_vector_run):
    cfg, result, _ = two_vector_run
    out = result.output_dir
    assert result.placeholder_tokens == ["<dicoo>", "<dicoo>_1"]
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "history.json").read_text()) == result.history
    assert all(h["loss"] > 0 and h["seconds"] > 0 and h["lr"] == pytest.approx(5e-3) for h in result.history)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert (out / "learned_embeds-steps-3.safetensors").is_file() and (
        out / "learned_embeds-steps-6.safetensors"
    ).is_file()
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["final", "step-3", "step-6"]
    assert sorted(p.name for p in (out / "samples" / "final").iterdir()) == ["00.png", "01.png"]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 6 and summary["trainable_parameters"] == 64
    assert summary["full_matrix_allreduce_bytes_per_step"] == 49410 * 32 * 4
    assert (summary["allreduce_calls"], summary["allreduce_bytes_per_step"]) == (0, 0)  # one process
    assert not list(out.rglob(".*"))  # nothing half-written left behind
    # --save_as_full_pipeline: output_dir itself is the pipeline, as diffusers' script writes it
    assert result.pipeline_dir == out and not (out / "pipeline").exists()
    assert {"model_index.json", "text_encoder", "tokenizer", "unet", "vae", "scheduler"} <= {
        p.name for p in out.iterdir()
    }


def test_learned_embeds_load_in_stock_diffusers(two_vector_run):
    from diffusers import StableDiffusionPipeline

    cfg, result, _ = two_vector_run
    saved = load_file(result.learned_embeds_path)
    assert list(saved) == ["<dicoo>"] and saved["<dicoo>"].shape == (2, 32)
    pipe = StableDiffusionPipeline.from_pretrained(models.resolve_model("tiny"))
    pipe.load_textual_inversion(str(result.learned_embeds_path))
    ids = pipe.tokenizer.convert_tokens_to_ids(["<dicoo>", "<dicoo>_1"])
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[ids], saved["<dicoo>"])
    init = pipe.text_encoder.get_input_embeddings().weight[5988]
    assert (saved["<dicoo>"] - init).abs().max() > 1e-4  # trained away from "toy"


def test_full_pipeline_differs_from_base_only_in_new_rows(two_vector_run):
    from diffusers import StableDiffusionPipeline

    cfg, result, _ = two_vector_run
    tuned = StableDiffusionPipeline.from_pretrained(result.output_dir)  # as the guides load it
    base = models.load_components("tiny")
    new_w = tuned.text_encoder.get_input_embeddings().weight
    old_w = base.text_encoder.get_input_embeddings().weight
    assert new_w.shape == (49410, 32)
    assert torch.equal(new_w[:49408], old_w)
    assert torch.equal(new_w[49408:], load_file(result.learned_embeds_path)["<dicoo>"])
    others_new = {k: v for k, v in tuned.text_encoder.state_dict().items() if "token_embedding" not in k}
    others_old = base.text_encoder.state_dict()
    assert all(torch.equal(v, others_old[k]) for k, v in others_new.items())
    assert all(torch.equal(v, base.unet.state_dict()[k]) for k, v in tuned.unet.state_dict().items())
    assert tuned.tokenizer("<dicoo> <dicoo>_1", add_special_tokens=False).input_ids == [49408, 49409]
    image = tuned("a photo of <dicoo>", num_inference_steps=2).images[0]
    assert image.size == (64, 64)


def test_full_pipeline_copies_the_base_unet_and_vae_while_training(two_vector_run, tmp_path, monkeypatch):
    """The UNet and VAE files are the base model's, byte for byte, and their copy is under way
    before the first step (so the disk writes overlap training); nothing of it is left behind."""
    cfg, result, _ = two_vector_run
    base = models.resolve_model("tiny")
    for part in ("unet", "vae"):
        for name in ("config.json", "diffusion_pytorch_model.safetensors"):
            assert (result.output_dir / part / name).read_bytes() == (base / part / name).read_bytes()

    seen = []
    original = ti.training_step

    def step(parts, batches, epoch, step):
        seen.append(len(list((tmp_path / "run").glob(".pipeline.*.tmp"))))
        return original(parts, batches, epoch, step)

    monkeypatch.setattr(ti, "training_step", step)
    out = ti.train(tiny_config(tmp_path, max_train_steps=2, save_as_full_pipeline=True)).output_dir
    assert seen == [1, 1]  # the copy's folder exists (its thread started) before the first step
    assert not list(out.glob(".*"))


def test_a_failed_pipeline_copy_fails_the_run_and_leaves_no_pipeline(tmp_path, monkeypatch):
    from helpers.training.engine import saving

    def full_disk(src, dst):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(saving.files, "copy_file_uncached", full_disk)
    out = tmp_path / "run"
    with pytest.raises(saving.StorageError) as err:  # one line naming the path and the free space
        ti.train(tiny_config(tmp_path, max_train_steps=2, save_as_full_pipeline=True))
    assert str(err.value).startswith(f"saving the full pipeline to {out} failed: No space left on device; ")
    assert " free on that disk. Fix: free space there" in str(err.value)
    assert (out / "learned_embeds.safetensors").is_file()  # written before the pipeline
    assert not (out / "model_index.json").exists() and not (out / "run_summary.json").exists()
    assert not list(out.glob(".*"))  # the copy's temporary is removed


def test_a_run_that_fails_while_training_removes_the_pipeline_copy(tmp_path, monkeypatch):
    def crash(*args):
        raise RuntimeError("crashed in step 1")

    monkeypatch.setattr(ti, "training_step", crash)
    with pytest.raises(RuntimeError, match="crashed in step 1"):
        ti.train(tiny_config(tmp_path, max_train_steps=2, save_as_full_pipeline=True))
    assert not list((tmp_path / "run").glob(".pipeline.*"))


def test_the_vae_encodes_and_every_step_runs_in_kept_memory(tmp_path, monkeypatch):
    """The run keeps freed memory (``cpu.keep_freed_memory``) from set-up to its end: the VAE's
    encoding too, whose big blocks glibc would otherwise map afresh and unmap at every call."""
    from helpers.training.engine import latents

    seen = []
    keep, encode, step = cpu.keep_freed_memory, latents.encode_views, ti.training_step

    @contextlib.contextmanager
    def kept():
        with keep() as applied:
            seen.append("kept")
            yield applied
        seen.append("given back")

    monkeypatch.setattr(cpu, "keep_freed_memory", kept)
    monkeypatch.setattr(latents, "encode_views", lambda *a: seen.append("encoded") or encode(*a))
    monkeypatch.setattr(ti, "training_step", lambda *a: seen.append("step") or step(*a))
    ti.train(tiny_config(tmp_path, max_train_steps=2, latent_cache=False))
    encoded = seen.count("encoded")  # one per VAE call: every view, the cache being off
    assert encoded >= 1 and seen == ["kept", *["encoded"] * encoded, "step", "step", "given back"]


def test_bf16_run_keeps_the_saved_unet_fp32_and_untouched(tmp_path, monkeypatch):
    """With bf16 the frozen UNet trains in bf16 weights (no per-step casts), yet validation samples
    work, the learned rows stay fp32 and the saved pipeline's UNet is the base one, bit for bit."""
    from diffusers import StableDiffusionPipeline

    seen = []
    original = families.diffusion_loss
    monkeypatch.setattr(
        families,
        "diffusion_loss",
        lambda family, unet, *a: seen.append(unet.dtype) or original(family, unet, *a),
    )
    cfg = tiny_config(
        tmp_path,
        mixed_precision="bf16",
        max_train_steps=2,
        save_as_full_pipeline=True,
        validation_prompt="a photo of <dicoo>",
        num_validation_images=1,
    )
    result = ti.train(cfg)
    # the 2 steps', after the lay-out's forward on fake tensors where oneDNN can lay out bf16 weights
    assert seen == [torch.bfloat16] * (2 + cpu.can_lay_out_bf16_weights())
    assert json.loads((result.output_dir / "run_summary.json").read_text())["precision"] == "bf16"
    assert (result.output_dir / "samples" / "final" / "00.png").is_file()
    saved = load_file(result.learned_embeds_path)["<dicoo>"]
    assert saved.dtype == torch.float32 and torch.isfinite(saved).all()
    tuned = StableDiffusionPipeline.from_pretrained(result.output_dir)
    base = models.load_components("tiny").unet.state_dict()
    assert all(
        v.dtype == torch.float32 and torch.equal(v, base[k]) for k, v in tuned.unet.state_dict().items()
    )


def test_one_process_can_train_in_bf16_then_fp32():
    """A notebook kernel or a test session may run a bf16 run and then an fp32 one: accelerate's
    process-wide state would refuse the second precision, so each run starts from a clean state."""
    from helpers.training.engine.setup import make_accelerator

    first = make_accelerator(cpu.choose_precision("bf16"), gradient_accumulation_steps=2)
    assert (first.mixed_precision, first.gradient_accumulation_steps) == ("bf16", 2)
    second = make_accelerator(cpu.choose_precision("no"), gradient_accumulation_steps=1)
    assert (second.mixed_precision, second.gradient_accumulation_steps) == ("no", 1)


def test_resume_equals_uninterrupted(two_vector_run, tmp_path):
    cfg, result, _ = two_vector_run
    # A run killed after step 4 restarts from its checkpoint in a fresh process state.
    resumed_cfg = TrainConfig(
        **{
            **cfg.to_dict(),
            "output_dir": str(tmp_path / "resumed"),
            "resume_from_checkpoint": str(result.output_dir / "checkpoints" / "checkpoint-4"),
            "validation_prompt": None,
            "save_as_full_pipeline": False,
        }
    )
    resumed = ti.train(resumed_cfg)
    assert [h["step"] for h in resumed.history] == [5, 6]
    assert torch.equal(
        load_file(resumed.learned_embeds_path)["<dicoo>"], load_file(result.learned_embeds_path)["<dicoo>"]
    )
    assert resumed.history[-1]["loss"] == pytest.approx(result.history[-1]["loss"], rel=1e-6)


def test_finished_run_is_not_overwritten(two_vector_run):
    cfg, result, _ = two_vector_run
    before = result.learned_embeds_path.read_bytes()
    with pytest.raises(ti.TrainingInputError, match="already holds a finished run"):
        ti.train(cfg)
    assert result.learned_embeds_path.read_bytes() == before


def test_bad_inputs_fail_before_loading_weights(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(models, "load_components", boom)
    with pytest.raises(data.ImageFolderError):
        ti.train(tiny_config(tmp_path, train_data_dir=str(tmp_path / "missing")))
    with pytest.raises(ti.TrainingInputError, match="already in the tokenizer"):
        ti.train(tiny_config(tmp_path, placeholder_token="toy"))
    with pytest.raises(ti.TrainingInputError, match="no checkpoint"):
        ti.train(tiny_config(tmp_path, resume_from_checkpoint="latest"))
    assert not (tmp_path / "run").exists()


def test_use_ipex_without_its_environment_is_one_line_before_loading(tmp_path, monkeypatch):
    """Asking for IPEX where it is missing, or built for another torch: the fix, before any weights."""
    monkeypatch.setattr(cpu, "ipex_version", lambda: None)
    assert cpu.ipex_problem() == (
        f"intel_extension_for_pytorch is not installed in this environment (torch {torch.__version__})"
    )
    monkeypatch.setattr(cpu, "ipex_version", lambda: "1.0.0")
    assert cpu.ipex_problem() == (
        f"intel_extension_for_pytorch 1.0.0 needs torch 1.0, and this environment has torch {torch.__version__}"
    )
    monkeypatch.setattr(models, "load_components", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(ti.TrainingInputError) as err:
        ti.train(tiny_config(tmp_path, use_ipex=True))
    assert str(err.value) == (
        f"use_ipex: intel_extension_for_pytorch 1.0.0 needs torch 1.0, and this environment has torch "
        f"{torch.__version__}. Fix: create its environment with `make setup-ipex` and run with "
        f".venv-ipex/bin/python, or leave use_ipex off."
    )
    assert not (tmp_path / "run").exists()


def test_cli_has_the_one_shape_and_input_errors_are_one_line(tmp_path, capsys):
    import inspect

    from helpers import train as train_module
    from helpers.core.errors import InputError

    assert issubclass(ti.TrainingInputError, InputError)
    assert list(inspect.signature(train_module.parse_args).parameters) == ["argv"]
    assert list(inspect.signature(train_module.main).parameters) == ["args"]
    assert list(inspect.signature(train_module.cli).parameters) == ["argv"]
    common = ["--pretrained_model_name_or_path", "tiny", "--resolution", "64"]
    common += ["--output_dir", str(tmp_path / "out")]
    missing = tmp_path / "missing"
    assert train_module.cli([*common, "--train_data_dir", str(missing)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(missing) in err[0]
    assert (
        train_module.cli(
            [*common, "--train_data_dir", str(data.sample_concept_dir()), "--placeholder_token", "toy"]
        )
        == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "already in the tokenizer" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_command_from_the_issue(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "helpers.train",
        "--pretrained_model_name_or_path",
        "tiny",
        "--train_data_dir",
        str(data.sample_concept_dir()),
        "--placeholder_token",
        "<dicoo>",
        "--initializer_token",
        "toy",
        "--resolution",
        "64",
        "--max_train_steps",
        "30",
        "--save_as_full_pipeline",
        "--output_dir",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 30 and (out / "model_index.json").is_file()  # output_dir is the pipeline
    bad = subprocess.run(
        cmd[:-2] + ["--output_dir", str(tmp_path / "x"), "--resolution", "63"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and re.search(r"resolution='?63'?", bad.stderr)
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1  # one line


def test_keyed_draws_accept_every_seed_the_settings_allow():
    key = (3 * 1_000_003 + 1) * 1_000_033 + 2
    assert ti.sample_generator(3, 1, 2).initial_seed() == key  # small seeds: the key itself, unchanged
    largest = ti.sample_generator(2**32 - 1, 10_000, 999).initial_seed()  # the schema's largest seed
    assert largest == (((2**32 - 1) * 1_000_003 + 10_000) * 1_000_033 + 999) % 2**64
    assert list(ti.EpochSampler(5, 2**32 - 1)) != list(ti.EpochSampler(5, 2**32 - 2))

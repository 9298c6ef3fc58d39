"""The persistent latent cache (helpers.training.engine.latents) on the offline tiny model.

Every test has its own empty cache (the autouse ``latent_cache_dir`` fixture of conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import weakref
from unittest import mock

import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image
from safetensors.torch import load_file
from tiny_parts import tiny_config  # tests/ is on sys.path under pytest

from helpers.core import cpu
from helpers.ranks import status
from helpers.training import data, models
from helpers.training import textual_inversion as ti
from helpers.training.config import parse_args
from helpers.training.engine import latents
from helpers.training.engine.step import LATENT_BATCH

VIEWS = 10  # the 5 sample pictures, each flipped or not
CALLS = -(-VIEWS // LATENT_BATCH)  # VAE calls per cold start: 3


class VaeCounter:
    """Counts VAE loads and encoder calls, in this process, whoever makes them."""

    def __init__(self, monkeypatch):
        self.loads = self.encodes = 0
        self.loaded: list[weakref.ref] = []  # every VAE loaded, to see when it is freed
        load, encode = AutoencoderKL.from_pretrained.__func__, AutoencoderKL.encode

        def counted_load(cls, *args, **kwargs):
            self.loads += 1
            vae = load(cls, *args, **kwargs)
            self.loaded.append(weakref.ref(vae))
            return vae

        def counted_encode(vae, *args, **kwargs):
            self.encodes += 1
            return encode(vae, *args, **kwargs)

        monkeypatch.setattr(AutoencoderKL, "from_pretrained", classmethod(counted_load))
        monkeypatch.setattr(AutoencoderKL, "encode", counted_encode)

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.loaded)

    def take(self) -> tuple[int, int]:
        counts, self.loads, self.encodes = (self.loads, self.encodes), 0, 0
        return counts


def _run(tmp_path, name, vae: VaeCounter, **overrides):
    alive_while_training = []

    beat = status.beat

    def watching_beat(state, step=None):
        if state == "training":
            alive_while_training.append(vae.alive())
        beat(state, step)

    with mock.patch.object(status, "beat", watching_beat):
        result = ti.train(tiny_config(tmp_path, name, **overrides))
    assert alive_while_training == [0] * 6  # no VAE in memory at any step
    embeds = load_file(result.learned_embeds_path)["<dicoo>"]
    return embeds, [h["loss"] for h in result.history], result.summary["startup"]


def test_warm_cold_and_off_runs_are_identical_and_a_warm_run_never_loads_the_vae(
    tmp_path, latent_cache_dir, monkeypatch
):
    vae = VaeCounter(monkeypatch)
    cold = _run(tmp_path, "cold", vae)
    assert vae.take() == (1, CALLS)
    warm = _run(tmp_path, "warm", vae)
    assert vae.take() == (0, 0)  # neither loaded nor called
    off = _run(tmp_path, "off", vae, latent_cache=False)
    assert vae.take() == (1, CALLS)
    assert len(vae.loaded) == 2  # cold and off: each freed before its first step (checked in _run)

    assert torch.equal(warm[0], cold[0]) and torch.equal(off[0], cold[0])  # bit for bit
    assert warm[1] == cold[1] == off[1] and len(cold[1]) == 6
    where = str(latent_cache_dir)
    assert cold[2]["latent_cache"] == {"dir": where, "vae_calls": CALLS, "found": 0, "vae_loaded": True}
    assert warm[2]["latent_cache"] == {"dir": where, "vae_calls": CALLS, "found": CALLS, "vae_loaded": False}
    assert off[2]["latent_cache"] is None
    for startup in (cold[2], warm[2], off[2]):  # recorded, not judged: speed is bench.startup's
        assert 0 < startup["seconds_to_first_step"] <= startup["process_seconds_to_first_step"]
    entries = sorted(latent_cache_dir.glob("??/*.safetensors"))
    assert len(entries) == CALLS and sum(len(load_file(e)["mean"]) for e in entries) == VIEWS
    summary = json.loads((tmp_path / "warm" / "run_summary.json").read_text())
    assert summary["startup"]["latent_cache"]["found"] == CALLS


@pytest.fixture(scope="module")
def tiny_dir():
    return models.resolve_model("tiny")


def _dataset(folder, size=64, center_crop=False):
    return data.ConceptDataset(
        folder, models.build_clip_tokenizer(), "<x>", size=size, repeats=1, center_crop=center_crop
    )


def _loads(counter: list):
    def load(model_dir, dtype):
        counter.append(model_dir)
        return models.load_frozen_vae(model_dir, dtype)

    return load


def test_entries_are_what_the_encoder_computes(tmp_path, tiny_dir):
    ds = _dataset(data.sample_concept_dir())
    loaded: list = []
    got = latents.cached_latents(tmp_path, tiny_dir, ds, _loads(loaded))
    mean, std = ti.cache_latents(models.load_frozen_vae(tiny_dir), ds)
    assert torch.equal(got.mean, mean) and torch.equal(got.std, std) and got.mean.shape == (VIEWS, 4, 8, 8)
    assert got.scaling_factor == AutoencoderKL.load_config(tiny_dir, subfolder="vae")["scaling_factor"]
    again = latents.cached_latents(tmp_path, tiny_dir, ds, _loads(loaded))
    assert len(loaded) == 1 and (again.found, again.vae_loaded) == (CALLS, False)
    assert torch.equal(again.mean, mean) and torch.equal(again.std, std)
    assert again.scaling_factor == got.scaling_factor


def test_a_changed_image_resolution_crop_or_vae_misses(tmp_path, tiny_dir):
    images = tmp_path / "images"
    shutil.copytree(data.sample_concept_dir(), images)
    cache = tmp_path / "cache"
    loaded: list = []

    def found(ds, model_dir=tiny_dir) -> int:
        return latents.cached_latents(cache, model_dir, ds, _loads(loaded)).found

    assert found(_dataset(images)) == 0
    assert found(_dataset(images)) == CALLS

    # one pixel of the last picture: only the VAE call holding its two views (8 and 9) misses
    last = sorted(images.iterdir())[-1]
    with Image.open(last) as img:
        img = img.convert("RGB")
    img.putpixel((0, 0), tuple(255 - c for c in img.getpixel((0, 0))))
    img.save(last)
    changed = _dataset(images)
    assert found(changed) == CALLS - 1
    mean, _ = ti.cache_latents(models.load_frozen_vae(tiny_dir), changed)
    assert torch.equal(latents.cached_latents(cache, tiny_dir, changed).mean, mean)  # same as no cache

    assert found(_dataset(images, size=72)) == 0
    assert found(_dataset(images, center_crop=True)) == 0

    # the same VAE in another folder is the same VAE; one changed weight is another
    same = tmp_path / "same-model"
    shutil.copytree(tiny_dir / "vae", same / "vae")
    assert found(changed, same) == CALLS
    vae = models.load_frozen_vae(tiny_dir)
    with torch.no_grad():
        vae.encoder.conv_in.bias[0] += 1e-3
    vae.save_pretrained(tmp_path / "other-model" / "vae")
    assert found(changed, tmp_path / "other-model") == 0
    assert len(loaded) == 5  # each of the 5 misses above loaded the VAE once, no hit did


def test_a_corrupt_or_foreign_entry_is_ignored_and_rewritten(tmp_path, tiny_dir, caplog):
    ds = _dataset(data.sample_concept_dir())
    reference = latents.cached_latents(tmp_path, tiny_dir, ds)
    # two VAE calls of 4 views, one of 2
    first, second, third = sorted(tmp_path.glob("??/*.safetensors"), key=lambda p: -len(load_file(p)["mean"]))
    first.write_bytes(first.read_bytes()[:100])  # truncated
    third.write_bytes(b"not a safetensors file")
    loaded: list = []
    with caplog.at_level("WARNING", logger="helpers.training.engine.latents"):
        got = latents.cached_latents(tmp_path, tiny_dir, ds, _loads(loaded))
    assert (got.found, len(loaded)) == (CALLS - 2, 1)
    assert torch.equal(got.mean, reference.mean) and torch.equal(got.std, reference.std)
    assert sum("ignoring unreadable entry" in r.getMessage() for r in caplog.records) == 2
    # rewritten whole: read back as they were
    assert latents.cached_latents(tmp_path, tiny_dir, ds, _loads(loaded)).found == CALLS and len(loaded) == 1

    # an entry of another key under this key's name (a copy, a collision) is not used
    shutil.copy(second, first)
    caplog.clear()
    with caplog.at_level("WARNING", logger="helpers.training.engine.latents"):
        got = latents.cached_latents(tmp_path, tiny_dir, ds, _loads(loaded))
    assert got.found == CALLS - 1 and torch.equal(got.mean, reference.mean)
    assert any("does not match its key" in r.getMessage() for r in caplog.records)


def test_bf16_encodes_in_bf16_under_its_own_key(tmp_path, tiny_dir):
    """As diffusers' script does in bf16 runs; bf16 and fp32 entries are never served for each other."""
    ds = _dataset(data.sample_concept_dir())
    dtypes: list = []

    def load(model_dir, dtype):
        vae = models.load_frozen_vae(model_dir, dtype)
        dtypes.append(vae.dtype)
        return vae

    fp32 = latents.cached_latents(tmp_path, tiny_dir, ds, load)
    bf16 = latents.cached_latents(tmp_path, tiny_dir, ds, load, dtype=torch.bfloat16)
    assert dtypes == [torch.float32, torch.bfloat16] and bf16.found == 0
    assert bf16.mean.dtype == bf16.std.dtype == torch.float32
    assert not torch.equal(bf16.mean, fp32.mean)
    # bf16 keeps 8 bits of mantissa; through the tiny encoder the largest error is 2.7 % of the largest value
    assert (bf16.mean - fp32.mean).abs().max() < 0.05 * fp32.mean.abs().max()
    again = latents.cached_latents(tmp_path, tiny_dir, ds, load, dtype=torch.bfloat16)
    assert again.found == CALLS and len(dtypes) == 2 and torch.equal(again.mean, bf16.mean)


@pytest.mark.skipif(
    not cpu.has_native_bf16(), reason="the engine picks bf16 only where the CPU has it natively"
)
def test_a_bf16_run_loads_the_vae_in_bf16(tmp_path, monkeypatch):
    load, dtypes = models.load_frozen_vae, []

    def recorded(model_dir, dtype=torch.float32):
        dtypes.append(dtype)
        return load(model_dir, dtype)

    monkeypatch.setattr(models, "load_frozen_vae", recorded)
    result = ti.train(tiny_config(tmp_path, "bf16", mixed_precision="bf16"))
    assert dtypes == [torch.bfloat16] and result.summary["precision"] == "bf16"


def test_a_cache_that_cannot_be_written_only_warns(tmp_path, tiny_dir, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ds = _dataset(data.sample_concept_dir())
    with caplog.at_level("WARNING", logger="helpers.training.engine.latents"):
        got = latents.cached_latents(blocker / "cache", tiny_dir, ds)
    mean, std = ti.cache_latents(models.load_frozen_vae(tiny_dir), ds)
    assert torch.equal(got.mean, mean) and got.found == 0
    unwritten = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(unwritten) == CALLS + 1  # the 3 entries and the VAE file's remembered digest
    assert (
        sum(".safetensors" in m for m in unwritten) == CALLS and sum(".sha256" in m for m in unwritten) == 1
    )


WRITER = """
import sys, torch
from helpers.training import data, models
from helpers.training.engine import latents
ds = data.ConceptDataset(data.sample_concept_dir(), models.build_clip_tokenizer(), "<x>", size=64, repeats=1)
got = latents.cached_latents(latents.Path(sys.argv[1]), models.resolve_model("tiny"), ds)
torch.save(got.mean, sys.argv[2])
"""


def test_two_processes_filling_one_cache_at_once(tmp_path, tiny_dir):
    cache = tmp_path / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # both processes encode with the same threads
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(cache), str(tmp_path / f"{i}.pt")], env=env)
        for i in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    a, b = (torch.load(tmp_path / f"{i}.pt") for i in range(2))
    assert torch.equal(a, b)
    entries = sorted(cache.glob("??/*"))
    assert len(entries) == CALLS and all(e.suffix == ".safetensors" for e in entries)  # no temporaries left
    assert torch.equal(torch.cat([load_file(e)["mean"] for e in entries]).sort(0).values, a.sort(0).values)


def test_concurrent_writes_of_one_entry_are_always_whole(tmp_path):
    path = latents.entry_path(tmp_path, "ab" * 32)
    key = "ab" * 32
    values = [torch.full((4, 4, 8, 8), float(i)) for i in range(2)]
    latents.write_entry(path, key, values[0], values[0].clone(), 0.5)
    seen, stop = [], threading.Event()

    def write(i):
        for _ in range(30):
            latents.write_entry(path, key, values[i], values[i].clone(), 0.5)

    def read():
        while not stop.is_set():
            seen.append(latents.read_entry(path, key, 4))

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=60)
    stop.set()
    reader.join(timeout=60)
    assert seen and all(s is not None and torch.equal(s[0], s[1]) for s in seen)
    assert {float(s[0][0, 0, 0, 0]) for s in seen} <= {0.0, 1.0}
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_where_the_cache_lives_and_how_to_turn_it_off(tmp_path, monkeypatch):
    monkeypatch.delenv(latents.ENV)
    monkeypatch.delenv("WORKSHOP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert latents.cache_root() == tmp_path / "xdg" / "sd-cpu-workshop" / "latents"
    monkeypatch.setenv("WORKSHOP_CACHE", str(tmp_path / "ws"))
    assert latents.cache_root() == tmp_path / "ws" / "latents"
    monkeypatch.setenv(latents.ENV, str(tmp_path / "env"))
    assert latents.cache_root() == tmp_path / "env"
    assert latents.cache_root(folder=tmp_path / "flag") == tmp_path / "flag"  # the setting wins
    assert latents.cache_root(enabled=False, folder=tmp_path / "flag") is None
    monkeypatch.setenv(latents.ENV, "off")
    assert latents.cache_root() is None

    out = ["--output_dir", str(tmp_path / "out")]
    assert parse_args(out).latent_cache is True and parse_args(out).latent_cache_dir is None
    config = parse_args([*out, "--no-latent_cache", "--latent_cache_dir", str(tmp_path / "c")])
    assert (config.latent_cache, config.latent_cache_dir) == (False, str(tmp_path / "c"))
    assert config.to_args()[-2:] == ["--no-latent_cache", f"--latent_cache_dir={tmp_path / 'c'}"]


def test_a_link_planted_in_a_shared_cache_is_replaced_never_written_through(tmp_path):
    """A cache shared by the machine's users: a link at an entry's or a digest memo's name is replaced."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    key = "cd" * 32
    path = latents.entry_path(tmp_path / "cache", key)
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    mean = torch.zeros(4, 4, 8, 8)
    latents.write_entry(path, key, mean, mean.clone(), 0.5)
    assert not path.is_symlink() and torch.equal(latents.read_entry(path, key, 4)[0], mean)
    big = tmp_path / "vae.bin"
    big.write_bytes(b"w" * latents._MEMO_MIN_BYTES)
    memos = tmp_path / "cache" / "files"
    digest = latents.file_digest(big, memos)
    memo = next(memos.iterdir())
    memo.unlink()
    memo.symlink_to(victim)
    assert latents.file_digest(big, memos) == digest and not memo.is_symlink()
    assert victim.read_text() == "precious"

"""helpers.training.data: bundled sample, folder validation, Hub download (offline), the dataset."""

from __future__ import annotations

import string
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers.toyworld.__main__ import cli as toyworld_cli
from helpers.training import data
from helpers.training.data import ConceptDataset, ImageFolderError, validate_image_folder

SAMPLE_NAMES = ["01_table.png", "02_sky.png", "03_grass_small.png", "04_blanket.png", "05_table_small.png"]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer():
    """A tiny character-level CLIP tokenizer (no merges) that knows two placeholder tokens.

    Built here rather than taken from helpers.training.models so these tests depend on nothing but
    transformers: every lowercase letter, digit and ``<>-_`` is a token, with its ``</w>`` form.
    """
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + "<>-_")
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[],
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=48,
    )
    assert tok.add_tokens(["<pip>", "<pip>_1"]) == 2
    return tok


def _save(path: Path, size: tuple[int, int] = (24, 24), color=(200, 30, 30)) -> Path:
    Image.new("RGB", size, color).save(path)
    return path


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


# --------------------------------------------------------------------------- bundled sample
def test_sample_concept_is_five_small_images_that_validate():
    folder = data.sample_concept_dir()
    images = validate_image_folder(folder)
    assert [p.name for p in images] == SAMPLE_NAMES
    assert sum(p.stat().st_size for p in images) < 300_000
    for p in images:
        with Image.open(p) as img:
            assert (img.format, img.mode, img.size) == ("PNG", "RGB", (160, 160))
    assert (
        sorted(p.name for p in folder.iterdir()) == SAMPLE_NAMES
    )  # pictures only: diffusers' script reads every file


def test_fresh_render_is_pixel_identical_to_committed_files(tmp_path):
    assert toyworld_cli(["render-sample", str(tmp_path / "out")]) == 0  # the toy world owns drawing Pip
    written = sorted((tmp_path / "out").iterdir())
    assert [p.name for p in written] == SAMPLE_NAMES
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == SAMPLE_NAMES  # no temp files left
    for fresh in written:
        with Image.open(fresh) as a, Image.open(data.sample_concept_dir() / fresh.name) as b:
            assert np.array_equal(np.asarray(a), np.asarray(b)), (
                f"{fresh.name} differs from the committed file"
            )


def test_sample_images_differ_from_each_other():
    arrays = [
        np.asarray(Image.open(p), dtype=np.int16) for p in validate_image_folder(data.sample_concept_dir())
    ]
    for i in range(len(arrays)):
        for j in range(i + 1, len(arrays)):
            assert np.abs(arrays[i] - arrays[j]).mean() > 20  # different poses and backgrounds


# --------------------------------------------------------------------------- validate_image_folder
def _concept_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, data.ConceptImagesWarning)]


def test_validate_returns_sorted_images_and_skips_non_pictures_with_one_warning(tmp_path):
    _save(tmp_path / "b.JPG")
    _save(tmp_path / "a.png")
    _save(tmp_path / "c.webp")
    for name in (".DS_Store", ".gitattributes", "README.md", "LICENSE", "Thumbs.db", "notes.txt"):
        (tmp_path / name).write_bytes(b"not an image")
    (tmp_path / "empty.md").write_bytes(b"")
    (tmp_path / ".cache").mkdir()
    (tmp_path / "more").mkdir()  # subfolders are not searched
    _save(tmp_path / "more" / "z.png")
    with pytest.warns(data.ConceptImagesWarning) as record:
        images = validate_image_folder(tmp_path)
    assert images == [tmp_path / "a.png", tmp_path / "b.JPG", tmp_path / "c.webp"]
    assert _concept_warnings(record) == [
        f"{tmp_path}: skipped 7 file(s) that are not pictures: .DS_Store, .gitattributes, LICENSE, README.md, "
        "Thumbs.db, empty.md, notes.txt"
    ]


def test_a_picture_is_what_pillow_reads_whatever_its_name(tmp_path):
    _save(tmp_path / "a.png")
    Image.new("RGB", (20, 20)).save(tmp_path / "photo_without_extension", format="JPEG")
    Image.new("RGB", (20, 20)).save(tmp_path / "scan.pgm")  # a format Pillow reads, not in IMAGE_EXTENSIONS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, nothing small: no warning at all
        images = validate_image_folder(tmp_path, min_size=16)
    assert [p.name for p in images] == ["a.png", "photo_without_extension", "scan.pgm"]


def test_smaller_pictures_are_kept_and_named_in_one_warning(tmp_path, tokenizer):
    _save(tmp_path / "big.png", (64, 80))
    _save(tmp_path / "exact.png", (64, 300))  # shorter side == resolution: not small
    _save(tmp_path / "small.jpg", (40, 30))
    _save(tmp_path / "thin.png", (63, 500))
    with pytest.warns(data.ConceptImagesWarning) as record:
        images = validate_image_folder(tmp_path, min_size=64)
    assert [p.name for p in images] == ["big.png", "exact.png", "small.jpg", "thin.png"]
    assert _concept_warnings(record) == [
        f"{tmp_path}: 2 picture(s) smaller than the training resolution 64 px will be resized up (softer "
        "detail): small.jpg (40x30), thin.png (63x500)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_image_folder(tmp_path)  # no resolution given: no size warning
        validate_image_folder(tmp_path, min_size=30)
    ds = ConceptDataset(tmp_path, tokenizer, "<pip>", size=64, repeats=1, flip_p=0.0)
    pixels = ds.view_pixels(2)  # small.jpg, resized up as diffusers does
    assert pixels.shape == (3, 64, 64)
    assert torch.allclose(pixels, torch.tensor([200, 30, 30]).view(3, 1, 1) / 127.5 - 1.0, atol=0.04)  # JPEG


def test_validate_lists_every_unusable_picture_in_one_error_and_writes_nothing(tmp_path):
    _save(tmp_path / "good.png", (32, 32))
    _save(tmp_path / "tiny.png", (15, 64))  # small is fine now: resized up
    (tmp_path / "notes.csv").write_text("a,b\n")  # skipped
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg" * 10)
    _save(tmp_path / "whole.jpg", (64, 64), (10, 120, 200))
    blob = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(blob[: len(blob) // 2])
    (tmp_path / "whole.jpg").unlink()
    png = (tmp_path / "good.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(png[: len(png) - 20])
    (tmp_path / "zero.png").write_bytes(b"")
    (tmp_path / "fake.png").write_text("a text file named like a picture")
    (tmp_path / ".DS_Store").write_bytes(b"\0\0")
    before = _snapshot(tmp_path)

    with pytest.raises(ImageFolderError) as info:
        validate_image_folder(tmp_path, min_size=16)

    err = info.value
    assert err.path == tmp_path
    problems = {p.name: why for p, why in err.problems}
    assert sorted(problems) == ["broken.jpg", "cut.png", "fake.png", "truncated.jpg", "zero.png"]
    assert problems["zero.png"] == "empty file (0 bytes)"
    assert problems["fake.png"] == "not a readable image (Pillow does not recognise its content)"
    for name in ("broken.jpg", "truncated.jpg", "cut.png"):
        assert problems[name].startswith("corrupt or truncated image")
    message = str(err)
    assert str(tmp_path) in message and "Fix: remove or replace the files listed above" in message
    for ok in ("good.png", "tiny.png", "notes.csv", ".DS_Store"):
        assert ok not in message
    assert _snapshot(tmp_path) == before  # nothing written, nothing removed


def test_an_unreadable_picture_is_refused(tmp_path, monkeypatch):
    _save(tmp_path / "a.png")
    locked = _save(tmp_path / "locked.png")
    real_open = Image.open

    def open_(fp, *args, **kwargs):  # what a user without read permission gets (root reads anyway)
        if Path(fp) == locked:
            raise PermissionError(13, "Permission denied", str(fp))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(data.Image, "open", open_)
    with pytest.raises(ImageFolderError) as info:
        validate_image_folder(tmp_path)
    assert info.value.problems == [(locked, "cannot be read (Permission denied)")]


def test_validate_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ImageFolderError) as info:
        validate_image_folder(missing)
    assert info.value.problems == [(missing, "does not exist")]
    assert "sample_concept_dir()" in str(info.value)
    assert not missing.exists()


def test_validate_file_instead_of_folder(tmp_path):
    image = _save(tmp_path / "one.png")
    with pytest.raises(ImageFolderError) as info:
        validate_image_folder(image)
    assert info.value.problems == [(image, "is a file, not a folder")]


def test_validate_empty_folder_points_to_subfolders(tmp_path):
    (tmp_path / "README.md").write_text("# my concept")
    (tmp_path / "concept_images").mkdir()
    with pytest.raises(ImageFolderError) as info:
        validate_image_folder(tmp_path)
    assert info.value.problems == [
        (tmp_path, "contains no images (only files that are not pictures: README.md)")
    ]
    assert "subfolders (concept_images)" in str(info.value)


# --------------------------------------------------------------------------- download_concept
def _forbid_download(monkeypatch):
    import huggingface_hub

    def fail(*args, **kwargs):
        raise AssertionError("snapshot_download must not be called")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)


def test_download_offline_fails_before_any_download(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from helpers.training.models import HubUnavailableError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _forbid_download(monkeypatch)
    with pytest.raises(HubUnavailableError) as info:
        data.download_concept("sd-concepts-library/dicoo", tmp_path / "dicoo")
    assert "sd-concepts-library/dicoo" in str(info.value)
    assert "helpers.training.data.sample_concept_dir()" in str(info.value)
    assert not (tmp_path / "dicoo").exists()


def test_download_unreachable_endpoint_fails_before_any_download(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from helpers.training.models import HubUnavailableError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    _forbid_download(monkeypatch)
    with pytest.raises(HubUnavailableError, match="sample_concept_dir"):
        data.download_concept(dest=tmp_path / "dicoo")


def test_download_fetches_only_concept_images_and_reuses_them(monkeypatch, tmp_path):
    import shutil

    import huggingface_hub

    import helpers.training.models

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):  # what the Hub would put in local_dir
        calls.append((repo_id, kwargs))
        target = Path(kwargs["local_dir"]) / "concept_images"
        target.mkdir(parents=True)
        for p in validate_image_folder(data.sample_concept_dir())[:3]:
            shutil.copy(p, target / p.name.replace(".png", ".jpeg"))
        return str(kwargs["local_dir"])

    monkeypatch.setattr(helpers.training.models, "ensure_hub_reachable", lambda what, fix, timeout=3.0: None)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    dest = tmp_path / "dicoo"
    folder = data.download_concept("sd-concepts-library/dicoo", dest)
    assert folder == dest / "concept_images"
    assert len(validate_image_folder(folder)) == 3
    assert len(calls) == 1
    repo_id, kwargs = calls[0]
    assert repo_id == "sd-concepts-library/dicoo"
    assert kwargs["allow_patterns"] == ["concept_images/*"]
    assert Path(kwargs["local_dir"]) == dest

    # Second call: the images are there, so no Hub access at all (works offline).
    _forbid_download(monkeypatch)
    monkeypatch.setattr(helpers.training.models, "ensure_hub_reachable", None)
    assert data.download_concept("sd-concepts-library/dicoo", dest) == folder


# --------------------------------------------------------------------------- ConceptDataset
def test_dataset_items(tokenizer):
    ds = ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", size=32, repeats=10, seed=0)
    assert [p.name for p in ds.images] == SAMPLE_NAMES
    assert (len(ds), ds.num_views) == (50, 10)
    pip_id = tokenizer.convert_tokens_to_ids("<pip>")
    for i in range(len(ds)):
        item = ds[i]
        assert set(item) == {"view_index", "input_ids", "prompt"}
        assert item["view_index"] // 2 == i % 5  # image i % len(images), flipped or not
        assert item["prompt"] in {t.format("<pip>") for t in data.imagenet_templates_small}
        ids = item["input_ids"]
        assert ids.dtype == torch.long and ids.shape == (48,)
        assert ids[0].item() == tokenizer.bos_token_id and (ids == pip_id).sum().item() == 1
        expected = tokenizer(item["prompt"], padding="max_length", truncation=True, max_length=48).input_ids
        assert ids.tolist() == expected
    assert ds[-1]["prompt"] == ds[49]["prompt"]
    with pytest.raises(IndexError):
        ds[50]


def test_dataset_style_templates_and_multi_vector_placeholder(tokenizer):
    ds = ConceptDataset(
        data.sample_concept_dir(), tokenizer, "<pip> <pip>_1", learnable_property="style", repeats=40
    )
    prompts = {ds[i]["prompt"] for i in range(len(ds))}
    assert prompts == {t.format("<pip> <pip>_1") for t in data.imagenet_style_templates_small}
    ids = ds[0]["input_ids"].tolist()
    assert ids.count(tokenizer.convert_tokens_to_ids("<pip>")) == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<pip>_1")) == 1


def test_templates_match_the_diffusers_example():
    assert len(data.imagenet_templates_small) == 27 and len(data.imagenet_style_templates_small) == 19
    assert data.imagenet_templates_small[0] == "a photo of a {}"
    assert data.imagenet_style_templates_small[0] == "a painting in the style of {}"


def test_dataset_is_deterministic_per_seed(tokenizer):
    def items(seed):
        ds = ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", repeats=20, seed=seed)
        return [
            (it["view_index"], it["prompt"], it["input_ids"].tolist())
            for it in (ds[i] for i in range(len(ds)))
        ]

    first = items(0)
    assert items(0) == first
    other = items(1)
    assert other != first
    assert sum(a[:2] != b[:2] for a, b in zip(first, other, strict=True)) > 50  # most of the 100 items differ
    # Access order does not matter: each item has its own generator.
    ds = ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", repeats=20, seed=0)
    assert [ds[i]["prompt"] for i in reversed(range(len(ds)))] == [p for _, p, _ in reversed(first)]


def test_dataloader_workers_give_the_same_items(tokenizer):
    ds = ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", repeats=4, seed=3)
    direct = [ds[i]["view_index"] for i in range(len(ds))]
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False, num_workers=2)
    batches = list(loader)
    assert torch.cat([b["view_index"] for b in batches]).tolist() == direct
    assert batches[0]["input_ids"].shape == (4, 48)


@pytest.mark.parametrize(
    ("flip_p", "expected_views", "flipped_range"),
    [(0.0, 5, (0, 0)), (1.0, 10, (200, 200)), (0.5, 10, (70, 130))],
)
def test_flip_probability(tokenizer, flip_p, expected_views, flipped_range):
    ds = ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", repeats=40, flip_p=flip_p)
    assert ds.num_views == expected_views
    views = [ds[i]["view_index"] for i in range(len(ds))]
    if flip_p == 0:
        assert views == [i % 5 for i in range(200)]
    else:
        flipped = sum(v % 2 for v in views)
        assert flipped_range[0] <= flipped <= flipped_range[1]


def test_view_pixels_range_shape_flip_and_cache(tokenizer):
    ds = ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", size=64, repeats=1)
    plain, mirrored = ds.view_pixels(0), ds.view_pixels(1)
    assert plain.shape == (3, 64, 64) and plain.dtype == torch.float32
    assert plain.min().item() >= -1.0 and plain.max().item() <= 1.0
    assert plain.min().item() < -0.8 and plain.max().item() > 0.9  # dark outlines, white eyes
    assert torch.equal(mirrored, plain.flip(-1))
    assert not torch.equal(mirrored, plain)
    assert ds.view_pixels(0) is plain  # decoded once, cached
    with pytest.raises(IndexError):
        ds.view_pixels(10)


def test_view_pixels_exact_values_and_center_crop(tmp_path, tokenizer):
    # 30x10: red | green | blue thirds. A centre crop keeps the green square only.
    img = Image.new("RGB", (30, 10), (255, 0, 0))
    img.paste((0, 255, 51), (10, 0, 20, 10))
    img.paste((0, 0, 255), (20, 0, 30, 10))
    img.save(tmp_path / "bands.png")
    cropped = ConceptDataset(tmp_path, tokenizer, "<pip>", size=10, center_crop=True, flip_p=0.0).view_pixels(
        0
    )
    expected = torch.tensor([-1.0, 1.0, 51 / 127.5 - 1.0]).view(3, 1, 1).expand(3, 10, 10)
    assert torch.allclose(cropped, expected, atol=1e-6)
    squashed = ConceptDataset(
        tmp_path, tokenizer, "<pip>", size=10, center_crop=False, flip_p=0.0
    ).view_pixels(0)
    assert squashed[:, 5, 0].tolist() == [1.0, -1.0, -1.0]  # left column still red
    assert squashed[:, 5, 9].tolist() == [-1.0, -1.0, 1.0]  # right column blue


def test_view_pixels_apply_exif_orientation(tmp_path, tokenizer):
    img = Image.new("RGB", (20, 10), (255, 0, 0))
    img.paste((0, 0, 255), (10, 0, 20, 10))  # stored: red left, blue right
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display": red on top, blue at the bottom
    img.save(tmp_path / "phone.jpg", exif=exif, quality=100)
    px = ConceptDataset(tmp_path, tokenizer, "<pip>", size=10, center_crop=True, flip_p=0.0).view_pixels(0)
    assert px[0, 1, 5] > 0.9 and px[2, 1, 5] < -0.9  # top: red
    assert px[2, 8, 5] > 0.9 and px[0, 8, 5] < -0.9  # bottom: blue


def test_dataset_validates_folder_before_any_work(tmp_path):
    class NoTokenizer:
        model_max_length = 8

        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenizer used before validation")

    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        ImageFolderError, match=r"contains no images \(only files that are not pictures: notes.txt\)"
    ):
        ConceptDataset(tmp_path, NoTokenizer(), "<pip>")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"learnable_property": "person"}, "'object' or 'style'"),
        ({"flip_p": 1.5}, "probability"),
        ({"repeats": 0}, "at least 1"),
    ],
)
def test_dataset_rejects_bad_arguments(tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ConceptDataset(data.sample_concept_dir(), tokenizer, "<pip>", **kwargs)


def test_resolve_concept_sample_folder_and_hub(tmp_path, monkeypatch):
    from helpers.training.models import HubUnavailableError

    assert data.resolve_concept("sample") == data.sample_concept_dir()
    assert data.resolve_concept(data.sample_concept_dir(), min_size=64) == data.sample_concept_dir()
    with pytest.warns(
        data.ConceptImagesWarning, match="5 picture\\(s\\) smaller than the training resolution 512 px"
    ):
        assert data.resolve_concept("sample", min_size=512) == data.sample_concept_dir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubUnavailableError, match="sample"):
        data.resolve_concept("sd-concepts-library/dicoo")
    assert not (tmp_path / "concepts").exists()


# --- unusual picture modes --------------------------------------------------------------------------


def _saved(tmp_path, image: Image.Image, name: str) -> Path:
    folder = tmp_path / "concept"
    folder.mkdir(exist_ok=True)
    image.save(folder / name)
    return folder


@pytest.mark.parametrize(
    ("mode", "values", "grey"),
    [
        ("I;16", np.full((64, 64), 32896, dtype=np.uint16), 128),  # 16-bit grey PNG: 32896 / 257 = 128
        ("I", np.full((64, 64), 65535, dtype=np.int32), 255),  # 32-bit grey holding 16-bit values
        ("I", np.full((64, 64), 100, dtype=np.int32), 100),  # 32-bit grey holding 8-bit values
        ("F", np.full((64, 64), 0.5, dtype=np.float32), 128),  # float grey from 0 to 1
    ],
)
def test_high_bit_depth_pictures_are_scaled_not_clipped(mode, values, grey):
    """Issue 37: a 16-bit grey PNG became 99.6 % white pixels (Pillow clips at 255 when converting)."""
    image = Image.fromarray(values, mode) if mode != "I;16" else Image.fromarray(values)
    assert image.mode == mode
    rgb = np.asarray(data.to_rgb(image))
    assert rgb.shape == (64, 64, 3) and (rgb == grey).all()


def test_a_16_bit_grey_png_trains_as_its_grey(tmp_path, tokenizer):
    """The whole path: a 16-bit gradient PNG in a concept folder gives the view its 8-bit twin gives."""
    ramp = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (64, 1))
    deep = _saved(tmp_path, Image.fromarray(ramp), "deep.png")
    assert Image.open(deep / "deep.png").mode == "I;16"
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray((ramp / 257).round().astype(np.uint8), "L").save(flat / "flat.png")
    views = [
        data.ConceptDataset(f, tokenizer, "<pip>", size=64, flip_p=0.0).view_pixels(0) for f in (deep, flat)
    ]
    assert torch.equal(views[0], views[1])
    assert (views[0] > 0.99).float().mean() < 0.05  # was 99.6 % white


@pytest.mark.parametrize("mode", ["LA", "P", "RGBA", "CMYK", "1", "I;16"])
def test_every_picture_mode_gives_rgb_views_in_range(tmp_path, mode, tokenizer):
    source = Image.new("RGB", (64, 64), (200, 30, 30))
    image = source.convert(mode) if mode != "I;16" else Image.fromarray(np.full((64, 64), 40000, np.uint16))
    folder = _saved(tmp_path, image, "a.png" if mode != "CMYK" else "a.jpg")
    view = data.ConceptDataset(folder, tokenizer, "<pip>", size=64, flip_p=0.0).view_pixels(0)
    assert view.shape == (3, 64, 64) and view.min() >= -1 and view.max() <= 1


def test_a_folder_of_more_files_than_a_concept_holds_is_refused_before_any_is_opened(tmp_path, monkeypatch):
    """Issue 48: 10,000 tiny pictures took over 400 s before step 1 without a word."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(data.MAX_CONCEPT_FILES + 1):
        (folder / f"{i:05}.png").write_bytes(b"")
    opened = []
    monkeypatch.setattr(data, "_open_picture", lambda path: opened.append(path) or ("problem", "empty"))
    with pytest.raises(
        data.ImageFolderError, match=r"holds 1,001 entries, more than the 1,000 a concept folder may hold"
    ):
        data.validate_image_folder(folder)
    assert opened == []
    with pytest.raises(data.ImageFolderError, match="empty"):  # generated class pictures: no limit
        data.validate_image_folder(folder, max_files=None)
    assert len(opened) == data.MAX_CONCEPT_FILES + 1

"""Smoke tests of the benchmark code paths on the tiny model: structure and exact counts, never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from bench import (
    allreduce,
    common,
    end_to_end,
    optimisations,
    report,
    startup,
    step_ops,
    stress_launch,
    train_step,
)
from bench import inference as bench_inference
from helpers import inference
from helpers.training import data, models
from helpers.training.engine import prepack

PHASES = set(train_step.PHASES) | {"total"}


def test_sd15_shape_configs_have_the_real_parameter_counts():
    """The SD v1.5-shape pipeline has exactly SD v1.5's parameter counts (built on the meta device)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**models.SD15_SHAPE_UNET_CONFIG)
        vae = AutoencoderKL(**models.SD15_SHAPE_VAE_CONFIG)
        te = CLIPTextModel(CLIPTextConfig(vocab_size=49408, **models.SD15_SHAPE_TEXT_CONFIG))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert (count(unet), count(vae), count(te)) == (859_520_964, 83_653_863, 123_060_480)
    assert te.get_input_embeddings().weight.shape == (49408, 768)


def test_flops_include_cpu_attention():
    q = torch.randn(1, 8, 256, 40, requires_grad=True)
    fwd = common.count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert fwd == 2 * (2 * 8 * 256 * 256 * 40)  # QK^T and AV
    both = common.count_flops(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    )
    assert both == fwd + 5 * fwd // 2  # backward: recompute scores + 4 matmuls


def test_concept_dir_upscales_only_when_needed(tmp_path):
    from PIL import Image

    assert common.concept_dir(64, tmp_path / "x") == data.sample_concept_dir()
    big = common.concept_dir(256, tmp_path / "big")
    files = data.validate_image_folder(big, min_size=256)
    assert len(files) == len(data.validate_image_folder(data.sample_concept_dir()))
    with Image.open(files[0]) as img:
        assert min(img.size) == 256


def test_interleaving_alternates_the_order():
    calls = []
    steps = {"a": lambda i: calls.append(("a", i)) or {}, "b": lambda i: calls.append(("b", i)) or {}}
    common.run_interleaved(steps, n=3, warmup=1)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return common.make_setup("tiny", 64, 2, tmp_path_factory.mktemp("setup"))


def test_ours_and_reference_do_the_same_work_but_the_vae(tiny_setup):
    """Same batch, same modules: the reference counts exactly the VAE encoder's FLOPs more."""
    ours, ref = common.OursStep(tiny_setup), common.ReferenceStep(tiny_setup)
    with ours.active():
        f_ours = common.count_flops(lambda: ours(0))
    with ref.active():
        f_ref = common.count_flops(lambda: ref(0))
    pixels = torch.stack([tiny_setup.dataset.view_pixels(int(v)) for v in tiny_setup.batch(0)["view_index"]])
    with torch.no_grad():
        f_vae = common.count_flops(lambda: tiny_setup.parts.vae.encode(pixels))
    assert f_ours > 0 and f_ref - f_ours == f_vae
    # the reference trains the whole matrix but restores every row except the new one
    weight = tiny_setup.parts.text_encoder.get_input_embeddings().weight
    assert torch.equal(weight[ref.keep], ref.original[ref.keep])
    assert not torch.equal(weight[tiny_setup.token_ids], ref.original[tiny_setup.token_ids])
    assert not weight.requires_grad  # both modes leave the matrix frozen when inactive


def test_phase_timer_splits_the_step(tiny_setup):
    ours = common.OursStep(tiny_setup)
    timer = common.PhaseTimer(tiny_setup.parts.text_encoder, ours.unet)
    with ours.active():
        ours(0, timer)
    timer.remove()
    phases = timer.phases()
    assert set(phases) == PHASES
    parts = sum(v for k, v in phases.items() if k != "total")
    assert all(v >= 0 for v in phases.values()) and parts == pytest.approx(phases["total"], rel=1e-6)
    assert phases["unet_backward"] > 0 and phases["text_encoder_backward"] > 0


def test_train_step_benchmark_on_tiny(tmp_path):
    out = tmp_path / "r.json"
    report = train_step.main(
        train_step.parse_args(["--model", "tiny", "--steps", "2", "--warmup", "1", "--out", str(out)])
    )
    assert out.is_file() and report["resolution"] == 64 and report["threads"] >= 1
    for name in ("ours", "reference"):
        mode = report["modes"][name]
        assert mode["seconds_per_step"]["n"] == 2 and set(mode["breakdown"]) == PHASES - {"total"}
        assert mode["peak_rss_mib"] > 0 and mode["flops_per_step"] > 0
    assert report["modes"]["reference"]["flops_per_step"] > report["modes"]["ours"]["flops_per_step"]
    assert report["modes"]["ours"]["breakdown"]["communication"] == 0.0
    assert report["flop_bound_seconds"] == pytest.approx(
        report["modes"]["ours"]["flops_per_step"] / (report["gemm_peak_gflops"] * 1e9)
    )
    assert "speed-up (reference / ours)" in train_step.format_report(report)
    # Ours hands the UNet's convolutions to oneDNN with weights laid out once (prepack_convs): no
    # weight is re-laid out in its steps. The reference's VAE encoder re-lays out its weights each step.
    ours_onednn = report["modes"]["ours"]["onednn_seconds"]
    assert ours_onednn["convolution"] > 0 and "reorder_weights" not in ours_onednn
    assert report["modes"]["reference"]["onednn_seconds"]["reorder_weights"] > 0


def test_onednn_seconds_splits_weight_and_activation_relayouts(capfd):
    conv, x = torch.nn.Conv2d(16, 32, 3, padding=1), torch.randn(3, 16, 32, 32)
    got = common.onednn_seconds(lambda: conv(x), [conv])
    assert set(got) == {"convolution", "reorder_weights", "reorder_activations"}
    assert all(v > 0 for v in got.values())
    assert "onednn_verbose" not in capfd.readouterr().out  # the log went to the capture file only
    print("still printing")
    assert capfd.readouterr().out == "still printing\n"


def test_bf16_runs_both_modes_forward_under_autocast(tmp_path):
    """``--mixed_precision bf16``: the UNet computes in bf16 in both modes (as accelerate's autocast
    makes the engine do), the loss and the learned rows stay fp32, the bound uses the bf16 GEMM peak."""
    out = tmp_path / "r.json"
    args = ["--model", "tiny", "--steps", "1", "--warmup", "0", "--no-memory", "--out", str(out)]
    report = train_step.main(train_step.parse_args([*args, "--mixed_precision", "bf16"]))
    assert report["mixed_precision"] == "bf16" and "bf16 GEMM peak" in train_step.format_report(report)
    setup = common.make_setup("tiny", 64, 1, tmp_path / "setup", mixed_precision="bf16")
    dtypes = []
    setup.parts.unet.register_forward_hook(lambda m, a, o: dtypes.append(o.sample.dtype))
    for step in (common.OursStep(setup), common.ReferenceStep(setup)):
        with step.active():
            assert isinstance(step(0), float)
    assert dtypes == [torch.bfloat16, torch.bfloat16] and setup.parts.unet.dtype == torch.bfloat16
    assert common.OursStep(setup).learned.vectors.dtype == torch.float32


@pytest.mark.slow
def test_allreduce_benchmark_on_tiny(tmp_path):
    report = allreduce.main(
        allreduce.parse_args(
            ["--model", "tiny", "--steps", "1", "--split_rounds", "1", "--out", str(tmp_path / "a.json")]
        )
    )
    ours, ref = report["modes"]["ours"], report["modes"]["reference"]
    hidden = models.TINY_TEXT_CONFIG["hidden_size"]
    assert ours["allreduce_bytes_per_step"] == 1 * hidden * 4  # one new row
    assert ref["allreduce_bytes_per_step"] == (49408 + 1) * hidden * 4  # the whole matrix
    assert ours["parameters_all_reduced"] == hidden and ref["parameters_all_reduced"] == 49409 * hidden
    assert report["bytes_ratio"] == 49409
    assert set(report["split"]["layouts"]) == {"2x1", "1x2"} or report["threads_per_process"] != 1


def test_optimisations_benchmark_on_tiny(tmp_path):
    report = optimisations.main(
        optimisations.parse_args(
            ["--model", "tiny", "--steps", "1", "--rounds", "1", "--out", str(tmp_path / "o.json")]
            + ["--only", "channels_last,prepacked_convs,allocator"]
        )
    )
    opts = report["options"]
    assert set(opts) == {"channels_last", "prepacked_convs", "allocator"}
    assert not opts["channels_last"]["used_by_engine"] and opts["prepacked_convs"]["used_by_engine"]
    for name in ("channels_last", "prepacked_convs"):
        assert opts[name]["speedup"] > 0 and opts[name]["seconds"]["on"]["n"] == 1
    alloc = opts["allocator"]
    assert alloc["baseline_s"] > 0 and alloc["glibc_default_training_rss_mib"] > 0
    assert all(len(runs) == 1 for runs in alloc["seconds"].values())
    with pytest.raises(SystemExit):
        optimisations.parse_args(["--only", "warp_drive"])
    with pytest.raises(SystemExit):  # bf16 weights mean nothing in an fp32 run
        optimisations.parse_args(["--only", "bf16_weights"])
    assert "bf16_weights" not in optimisations.parse_args([]).only.split(",")
    assert "bf16_weights" in optimisations.parse_args(["--mixed_precision", "bf16"]).only.split(",")


def test_bf16_weights_option_switches_the_unet_and_returns_to_the_engines_choice(tmp_path):
    args = ["--model", "tiny", "--steps", "1", "--mixed_precision", "bf16", "--only", "bf16_weights"]
    report = optimisations.main(optimisations.parse_args([*args, "--out", str(tmp_path / "o.json")]))
    result = report["options"]["bf16_weights"]
    assert report["mixed_precision"] == "bf16" and result["used_by_engine"]
    assert result["seconds"]["off"]["n"] == 1 and result["speedup"] > 0


KEEP_FREED_PROBE = """
import resource, torch
from helpers.core import cpu

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        torch.ones(16_000_000)  # 64 MB, touched, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

outside = faults()
with cpu.keep_freed_memory() as applied:
    faults(), faults()  # the heap grows to its working size (measured: over two rounds)
    inside = faults()
print(applied, outside, inside, 64_000_000 // resource.getpagesize())
"""


def test_keep_freed_memory_stops_refaulting_big_blocks():
    """Blocks above glibc's mmap threshold are page-faulted in afresh each time, unless kept.

    Measured in a fresh process: in a worker that has run other tests, a free chunk left inside the
    heap can serve the 64 MB blocks without fresh pages (seen in CI: one block's faults for six)."""
    done = subprocess.run(
        [sys.executable, "-c", KEEP_FREED_PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    applied, outside, inside, block_pages = done.stdout.split()
    outside, inside, block_pages = int(outside), int(inside), int(block_pages)
    assert applied == "True"  # Linux with glibc, as here
    # Outside, all six blocks are faulted in; inside, they are reused (a fraction of a block faults).
    assert outside > 5.9 * block_pages and inside < 0.5 * block_pages


def test_process_age_counts_from_the_process_start_within_what_its_parent_saw():
    """A child's age read just after it starts lies between 0 and the parent's time from just before
    starting it to just after it ended; psutil's create_time() can put it up to a second earlier
    (seen in CI: 6.9 s to a first step in a command that took 6.4 s in all). A second reading after
    a 0.3 s sleep is at least that much later."""
    code = "import time; from helpers.core import cpu; a = cpu.process_age(); time.sleep(0.3); print(a, cpu.process_age())"
    before = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    elapsed = time.monotonic() - before
    first, second = map(float, done.stdout.split())
    assert 0 < first and first + 0.3 <= second < elapsed


def test_a_benchmarks_child_caches_its_bytecode_as_users_processes_do(monkeypatch):
    """A shell's ``PYTHONDONTWRITEBYTECODE`` does not reach a benchmark's child, whether the child
    inherits the benchmark's environment or is given one; the rest of that environment does. With
    it, every child compiled what it imports afresh, which users' runs do not."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("BENCH_PROBE", "inherited")
    code = "import os, sys; print(os.environ.get('PYTHONDONTWRITEBYTECODE'), os.environ['BENCH_PROBE'], sys.dont_write_bytecode)"
    argv = [sys.executable, "-c", code]
    opts = {"capture_output": True, "text": True, "check": True, "timeout": 60}
    assert common.run(argv, **opts).stdout.split() == ["None", "inherited", "False"]
    given = common.run(argv, env={**os.environ, "BENCH_PROBE": "given"}, **opts)
    assert given.stdout.split() == ["None", "given", "False"]
    with common.popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.communicate(timeout=60)[0].split() == ["None", "inherited", "False"]


@pytest.mark.parametrize("start", ["popen", "run"])
def test_a_benchmarks_child_ends_when_the_benchmark_is_killed_outright(start):
    """A benchmark killed with SIGKILL (no handler runs) leaves no child behind: the child, started
    through ``common.popen`` or ``common.run``, gets SIGTERM from the kernel and ends. Before, a killed
    ``bench.end_to_end`` left its 8 GB ``helpers.train`` child training on."""
    import psutil

    child = "import time; time.sleep(120)"
    argv = f"[sys.executable, '-c', {child!r}]"
    started = {  # run() blocks until its child ends: from a thread, which lives as long as the child
        "popen": f"common.popen({argv})",
        "run": f"threading.Thread(target=common.run, args=({argv},), daemon=True).start()",
    }[start]
    code = f"import sys, threading, time; from bench import common; {started}; time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=common.ROOT)
    try:
        deadline, kids = time.monotonic() + 60, []
        # the child starts once bench.common is imported, and is exec'd after its preexec
        while time.monotonic() < deadline and not any(k.cmdline()[-1:] == [child] for k in kids):
            time.sleep(0.1)
            kids = psutil.Process(parent.pid).children()
        (kid,) = kids
    finally:
        parent.kill()
        parent.wait(timeout=30)

    def ended() -> bool:  # gone, or a zombie until init reaps it
        try:
            return kid.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not ended():
        time.sleep(0.1)
    assert ended()


def test_report_replaces_only_the_marked_block():
    readme = f"# Title\nintro\n{report.BEGIN}\nold table\n{report.END}\noutro\n"
    assert (
        report.replace_block(readme, "| a |\n")
        == f"# Title\nintro\n{report.BEGIN}\n| a |\n{report.END}\noutro\n"
    )
    with pytest.raises(ValueError, match="bench:begin"):
        report.replace_block("# no markers\n", "| a |\n")


def test_process_level_rows_show_each_launch_range_and_flag_overlaps():
    def launches(*seconds):
        return [{"seconds_per_step": s, "training_peak_rss_mib": 1024.0} for s in seconds]

    o = {
        "baseline_s": 3.0,
        "baseline_training_rss_mib": 1024.0,
        "thp_s": 2.9,
        "thp_training_rss_mib": 2048.0,
        "thp_speedup": 3.0 / 2.9,
        "close_cores_s": 2.0,
        "close_cores_training_rss_mib": 1024.0,
        "close_cores_speedup": 1.5,
        "seconds": {
            "baseline": launches(2.8, 3.0, 3.3),
            "thp": launches(2.7, 2.9, 3.1),
            "close_cores": launches(1.9, 2.0, 2.1),
        },
    }
    thp, close = report._option_rows("allocator", o)
    assert thp == (
        "| `THP_MEM_ALLOC_ENABLE=1` (huge pages) on top of the engine | no | "
        "3.00 s (2.80-3.30, 3 launches) | 2.90 s (2.70-3.10, 3 launches) | 1.03x | "
        "training peak RSS 2.00 GiB (without: 1.00 GiB); within the spread of the measurements |"
    )
    assert close.endswith("| 1.50x | training peak RSS 1.00 GiB (without: 1.00 GiB) |")  # ranges apart
    ab = {
        "used_by_engine": False,
        "off_s": 3.2,
        "on_s": 3.0,
        "speedup": 3.2 / 3.0,
        "seconds": {
            "off": {"median": 3.2, "min": 3.1, "max": 3.4, "n": 3},
            "on": {"median": 3.0, "min": 2.9, "max": 3.05, "n": 3},
        },
    }
    assert report._option_rows("flush_denormal", ab) == [
        "| flush_denormal | no | 3.20 s (3.10-3.40, 3 steps) | 3.00 s (2.90-3.05, 3 steps) | 1.07x | "
        "`torch.set_flush_denormal(True)` |"
    ]


def test_committed_tables_are_what_report_renders_from_the_results():
    """docs/performance.md, the README's headline and README_table.md are exactly ``bench.report``'s output.

    Run ``python -m bench.report`` after changing a result file or the report's code.
    """
    loaded = report.load(common.RESULTS)
    tables = report.render(loaded)
    page = report.PERFORMANCE.read_text()
    assert report.replace_block(page, tables) == page
    readme = report.README.read_text()
    assert (
        report.replace_block(readme, report.headline(loaded), report.HEADLINE_BEGIN, report.HEADLINE_END)
        == readme
    )
    assert (common.RESULTS / "README_table.md").read_text() == tables
    # every other machine's folder holds its own table: bench.report --results <it>
    for folder in sorted(p for p in common.RESULTS.iterdir() if p.is_dir()):
        assert (folder / "README_table.md").read_text() == report.render(report.load(folder))
    step = loaded["train_step-sd15-shape-256px"]
    ours = step["modes"]["ours"]["seconds_per_step"]["median"]
    assert f"| sd15-shape | 256 | 1 | fp32 | ours | {ours:.2f} |" in page
    assert f"| one training step, fp32 | {ours:.2f} s |" in readme
    assert f"**{step['speedup']:.2f}x**" in readme


def test_headline_has_a_row_per_result_file_and_leaves_out_missing_ones():
    loaded = report.load(common.RESULTS)
    rows = [line for line in report.headline(loaded).splitlines() if line.endswith(".json` |")]
    assert [line.rsplit("`", 2)[1] for line in rows] == [
        "train_step-sd15-shape-256px.json",
        "train_step-sd15-shape-256px-bf16.json",
        "end_to_end-sd15-shape-256px-30steps-fp32.json",
        "end_to_end-sd15-shape-256px-30steps-bf16.json",
        "end_to_end-sd15-shape-256px-200steps-fp32.json",
        "allreduce-sd15-shape-256px.json",
        "inference-sd15-shape-256px.json",
    ]
    only = {"allreduce-sd15-shape-256px": loaded["allreduce-sd15-shape-256px"]}
    assert report.headline(only).splitlines()[-1] == (
        "| bytes all-reduced per step | 3,072 | 151,784,448 | **49,409x fewer** | `allreduce-sd15-shape-256px.json` |"
    )


def test_report_writes_neither_page_when_one_lacks_its_markers(tmp_path):
    docs, readme = tmp_path / "performance.md", tmp_path / "README.md"
    docs.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    readme.write_text("no markers here\n")
    args = report.parse_args(["--out", str(tmp_path / "t.md"), "--docs", str(docs), "--readme", str(readme)])
    with pytest.raises(ValueError, match="bench:headline:begin"):
        report.main(args)
    assert docs.read_text() == f"intro\n{report.BEGIN}\nold\n{report.END}\nafter\n"
    assert not (tmp_path / "t.md").exists()
    readme.write_text(f"top\n{report.HEADLINE_BEGIN}\n{report.HEADLINE_END}\nend\n")
    report.main(args)
    assert docs.read_text().startswith(f"intro\n{report.BEGIN}\nMeasured on: ")
    assert docs.read_text().endswith(f"{report.END}\nafter\n")
    assert readme.read_text().startswith(f"top\n{report.HEADLINE_BEGIN}\nSD v1.5 shape")
    assert (tmp_path / "t.md").read_text() == report.render(report.load(common.RESULTS))


@pytest.mark.slow
def test_inference_benchmark_on_tiny(tmp_path):
    """Every variant timed once (each loaded alone), PSNR against PyTorch, int8 smaller than fp32."""
    out = tmp_path / "i.json"
    args = ["--model", "tiny", "--steps", "2", "--repeats", "1", "--out", str(out)]
    result = bench_inference.main(bench_inference.parse_args(args))
    native = inference.openvino_default_precision() == "bf16"
    expected = {*inference.VARIANTS, inference.QUANT_VARIANT} | (
        {inference.BF16_VARIANT, bench_inference.INT8_BF16} if native else set()
    )
    assert set(result["seconds_per_image"]) == expected
    assert json.loads(out.read_text())["seconds_per_image"] == result["seconds_per_image"]
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds_per_image_all"].values())
    assert result["psnr_vs_pytorch_db"]["pytorch_fp32"] == inference.PSNR_IDENTICAL_DB
    assert result["psnr_vs_pytorch_db"]["openvino_static"] > inference.IMAGE_PSNR_MIN_DB
    assert result["model_megabytes"]["int8"] < result["model_megabytes"]["fp32"]
    assert result["calibration"]["samples"] == inference.CALIBRATION_SAMPLES
    assert result["calibration"]["resolution"] == 128
    assert 15 < result["psnr_vs_pytorch_db"][inference.QUANT_VARIANT] < inference.PSNR_IDENTICAL_DB
    assert "openvino_static_int8" in bench_inference.report(result)


def test_stress_percentiles_are_nearest_rank():
    values = [float(v) for v in range(20, 0, -1)]
    assert stress_launch.percentile(values, 50) == 10.0 and stress_launch.percentile(values, 95) == 19.0
    assert stress_launch.percentile([3.0], 95) == 3.0 and stress_launch.percentile([], 50) is None


@pytest.mark.slow
def test_stress_launch_on_tiny(tmp_path):
    """Two runs (mpirun, then torchrun) beside 0.1 GiB held: both end cleanly. No busy process here:
    on CI's 2 cores one would take a core from the other test worker for the whole test (75 s of CPU
    measured); the next test checks the busy processes themselves."""
    out = tmp_path / "stress.json"
    args = stress_launch.parse_args(
        ["--runs", "2", "--cpu_load", "0", "--memory_gb", "0.1", "--out", str(out)]
    )
    report = stress_launch.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
    assert (report["runs"], report["ok"], report["failures"], report["hangs"]) == (2, 2, 0, 0)
    assert report["problems"] == [] and report["load"] == {"cpu_processes": 0, "memory_gb": 0.1}
    assert 0 < report["p50_seconds"] <= report["p95_seconds"]


def test_stress_load_runs_its_busy_and_holding_processes_only_while_it_lasts():
    me = psutil.Process()
    earlier = set(me.children())
    with stress_launch.load(2, 0.01):
        children = [p for p in me.children() if p not in earlier]
        scripts = sorted(p.cmdline()[2] for p in children)
        assert scripts == sorted([stress_launch._HOLD, stress_launch._BURN, stress_launch._BURN])
        busy = [p for p in children if p.cmdline()[2] == stress_launch._BURN]
        before = [p.cpu_times().user for p in busy]
        time.sleep(0.5)
        assert all(
            p.is_running() and p.cpu_times().user > t for p, t in zip(busy, before, strict=True)
        )  # they compute
    assert not any(p.is_running() for p in children)


@pytest.mark.slow
def test_startup_benchmark_on_tiny(tmp_path):
    """Three fresh processes: the cache off encodes, cold encodes and fills it, warm never loads the VAE."""
    out = tmp_path / "startup.json"
    result = startup.main(startup.parse_args(["--model", "tiny", "--resolution", "64", "--out", str(out)]))
    assert (
        json.loads(out.read_text())["order"] == ["off", "cold", "warm"] == [r["mode"] for r in result["runs"]]
    )
    caches = {r["mode"]: r["latent_cache"] for r in result["runs"]}
    assert caches["off"] is None
    assert (caches["cold"]["found"], caches["cold"]["vae_loaded"]) == (0, True)
    assert (caches["warm"]["found"], caches["warm"]["vae_loaded"]) == (3, False)  # 10 views, 4 per VAE call
    assert caches["cold"]["dir"] == caches["warm"]["dir"]
    for r in result["runs"]:
        assert 0 < r["train_seconds_to_first_step"] < r["process_seconds_to_first_step"] < r["wall_seconds"]
    assert "| warm |" in "\n".join(startup.table(result))


def _flag_values(tokens: list[str]) -> dict[str, str | bool]:
    """``--name=value``, ``--name value`` and ``--switch`` tokens as a dict."""
    values: dict[str, str | bool] = {}
    for i, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        name, eq, value = token[2:].partition("=")
        nxt = tokens[i + 1] if i + 1 < len(tokens) else "--"
        values[name] = value if eq else (nxt if not nxt.startswith("--") else True)
    return values


def test_end_to_end_runs_the_guides_command_with_only_the_named_swaps(tmp_path):
    import shlex

    from test_guides import TRAIN_FLAGS  # the guides' command as printed

    guide = _flag_values(shlex.split(TRAIN_FLAGS.replace("\\\n", " ")))
    ours = _flag_values(end_to_end.guide_flags(tmp_path / "m", tmp_path / "c", 256, 30, "no", tmp_path / "o"))
    swapped = {"pretrained_model_name_or_path", "train_data_dir", "resolution", "max_train_steps"}
    swapped |= {"output_dir", "mixed_precision"}
    assert set(ours) == set(guide)
    assert {k: v for k, v in ours.items() if k not in swapped} == {
        k: v for k, v in guide.items() if k not in swapped
    }
    assert (ours["resolution"], ours["max_train_steps"], ours["mixed_precision"]) == ("256", "30", "no")


def test_reference_program_trains_only_the_new_row_and_saves_the_guides_layout(tmp_path):
    from safetensors.torch import load_file
    from transformers import CLIPTextModel, CLIPTokenizer

    concept = common.concept_dir(64, tmp_path / "concept")
    out = tmp_path / "out"
    flags = end_to_end.guide_flags(models.tiny_pipeline_dir(), concept, 64, 3, "no", out)
    history = end_to_end.reference(flags)
    assert len(history["step_seconds"]) == 3 and history["process_seconds_to_first_step"] > 0
    assert json.loads((out / end_to_end.HISTORY).read_text()) == history
    learned = load_file(out / "learned_embeds.safetensors")
    assert list(learned) == ["<dicoo>"]
    before = CLIPTextModel.from_pretrained(models.tiny_pipeline_dir(), subfolder="text_encoder")
    after = CLIPTextModel.from_pretrained(out, subfolder="text_encoder")  # the full pipeline
    old, new = before.get_input_embeddings().weight, after.get_input_embeddings().weight
    assert new.shape[0] == old.shape[0] + 1
    assert torch.equal(new[: old.shape[0]], old)  # every other row restored after each step
    (toy,) = CLIPTokenizer.from_pretrained(out, subfolder="tokenizer").encode("toy", add_special_tokens=False)
    assert torch.equal(learned["<dicoo>"][0], new[-1])
    # moved from its initializer: 3 AdamW steps at 2e-3 move an element by about 6e-3
    assert 0 < (new[-1] - old[toy]).abs().max() < 0.05


def test_sdxl_reference_program_trains_only_the_new_rows_of_both_encoders(tmp_path):
    """On an SDXL pipeline the reference is shaped like diffusers' textual_inversion_sdxl.py: both
    encoders' whole matrices in AdamW with the other rows put back, two embedding files."""
    from safetensors.torch import load_file
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    model = models.resolve_model("tiny-xl")
    (toy,) = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer").encode(
        "toy", add_special_tokens=False
    )
    out = tmp_path / "out"
    flags = end_to_end.guide_flags(model, common.concept_dir(64, tmp_path / "concept"), 64, 2, "no", out)
    history = end_to_end.reference(flags)
    assert len(history["step_seconds"]) == 2
    for cls, sub, name in (
        (CLIPTextModel, "text_encoder", "learned_embeds.safetensors"),
        (CLIPTextModelWithProjection, "text_encoder_2", "learned_embeds_2.safetensors"),
    ):
        old = cls.from_pretrained(model, subfolder=sub).get_input_embeddings().weight
        new = cls.from_pretrained(out, subfolder=sub).get_input_embeddings().weight  # the full pipeline
        learned = load_file(out / name)
        assert new.shape[0] == old.shape[0] + 1 and torch.equal(new[: old.shape[0]], old)
        assert list(learned) == ["<dicoo>"] and torch.equal(learned["<dicoo>"][0], new[-1])
        assert 0 < (new[-1] - old[toy]).abs().max() < 0.05  # 2 AdamW steps at 2e-3 from "toy"


def test_end_to_end_benchmark_on_tiny(tmp_path):
    """Three whole processes: ours fills the latent cache, the re-run reads it, the reference runs."""
    out = tmp_path / "e2e.json"
    result = end_to_end.main(
        end_to_end.parse_args(["--model", "tiny", "--resolution", "64", "--steps", "2", "--out", str(out)])
    )
    assert json.loads(out.read_text())["modes"] == ["ours", "ours_warm", "reference"]
    assert [r["mode"] for r in result["runs"]] == ["ours", "ours_warm", "reference"]
    assert all(r["steps_recorded"] == 2 for r in result["runs"])
    caches = {r["mode"]: r["latent_cache"] for r in result["runs"]}
    assert (caches["ours"]["found"], caches["ours"]["vae_loaded"]) == (0, True)
    assert (caches["ours_warm"]["found"], caches["ours_warm"]["vae_loaded"]) == (3, False)
    assert caches["reference"] is None
    for r in result["runs"]:
        assert 0 < r["process_seconds_to_first_step"] < r["wall_seconds"]
        # each child's own peak (wait4): above torch's import, far below a real model's (6 to 20 GiB);
        # CI measured up to 2.5 GiB for this tiny run
        assert 0.3 < r["peak_rss_gib"] < 5
    m = result["medians"]
    assert result["speedup_ours"] == m["reference"]["wall_seconds"] / m["ours"]["wall_seconds"]
    rows = end_to_end.table([result])
    assert rows[-1].startswith("| tiny | 64 | fp32 | 2 | ")
    assert rows[-1].endswith(
        f"| **{result['speedup_ours']:.2f}x** | {result['speedup_ours_warm']:.2f}x | "
        f"{m['reference']['seconds_per_step']:.2f} / {m['ours']['seconds_per_step']:.2f} s | "
        f"{m['reference']['peak_rss_gib']:.1f} / {m['ours']['peak_rss_gib']:.1f} GiB |"
    )


def test_whole_process_mode_differences_two_lengths_on_a_warm_cache(tmp_path, monkeypatch, capsys):
    """The arithmetic and the order of bench.train_step --whole_process; run_once, the whole
    processes it times, is the one test_end_to_end_benchmark_on_tiny runs for real."""
    calls = []

    def run_once(mode, model, concept, cache, settings, run_dir):
        calls.append((mode, settings.steps, cache))
        start, step = {"ours": (10, 3), "ours_warm": (10, 3), "reference": (12, 5)}[mode]  # seconds
        return {"wall_seconds": start + step * settings.steps, "seconds_per_step": step - 0.5}

    monkeypatch.setattr(end_to_end, "run_once", run_once)
    out = tmp_path / "w.json"
    args = train_step.parse_args(["--model", "tiny", "--whole_process", "4", "14", "--rounds", "2"])
    args.out = str(out)
    result = train_step.main(args)
    # one untimed run fills the cache, then both lengths of both modes, in the other order next round
    assert [(m, n) for m, n, _ in calls] == [("ours", 1),
        ("ours_warm", 4), ("reference", 4), ("ours_warm", 14), ("reference", 14),
        ("reference", 14), ("ours_warm", 14), ("reference", 4), ("ours_warm", 4)]  # fmt: skip
    assert len({cache for _, _, cache in calls}) == 1  # every run of ours reads the cache the first filled
    assert result["seconds_per_step"] == {"ours_warm": 3.0, "reference": 5.0} and result["speedup"] == 5 / 3
    assert json.loads(out.read_text())["wall_seconds"]["reference"] == {"4": [32.0, 32.0], "14": [82.0, 82.0]}
    row = end_to_end.whole_process_table([result])[-1]
    assert row == "| tiny | 64 | fp32 | 4 and 14 | 5.00 | 3.00 | **1.67x** | 4.50 / 2.50 s |"
    assert row in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_step.parse_args(["--whole_process", "14", "14"])
    assert "--whole_process 14 14: needs 0 < SHORT < LONG" in capsys.readouterr().err


def test_end_to_end_refuses_a_warm_run_without_its_first_run(capsys):
    with pytest.raises(SystemExit):
        end_to_end.parse_args(["--modes", "ours_warm", "reference"])
    assert "--modes ours_warm needs ours" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("aten::mkldnn_convolution", "convolution"),
        ("aten::convolution_backward", "convolution"),
        ("aten.convolution", "convolution"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten._scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("aten::addmm", "matmul"),
        ("aten.mm", "matmul"),
        ("aten::bmm", "matmul"),
        ("aten::native_group_norm_backward", "normalisation"),
        ("aten::silu_backward", "activation"),
        ("aten::copy_", "copies, casts and fills"),
        ("aten::to", "copies, casts and fills"),
        ("aten::add", "element-wise and other"),
        ("aten::mul", "element-wise and other"),
        ("aten::transpose", "element-wise and other"),
    ],
)
def test_step_ops_families(name, expected):
    assert step_ops.family(name) == expected


def test_step_ops_benchmark_on_tiny(tmp_path):
    """The families partition the profiled time exactly; FLOPs only where the counter has a formula."""
    result = step_ops.main(
        step_ops.parse_args(
            ["--model", "tiny", "--resolution", "64", "--steps", "1", "--out", str(tmp_path / "o.json")]
        )
    )
    fam = result["families"]
    assert sum(f["seconds"] for f in fam.values()) == pytest.approx(
        result["profiled_seconds_per_step"], rel=1e-9
    )
    assert min(fam[k]["gflop"] for k in ("convolution", "attention", "matmul")) > 0
    for k in ("normalisation", "activation", "copies, casts and fills", "element-wise and other"):
        assert fam[k]["gflop"] == 0 and fam[k]["seconds_lost"] == fam[k]["seconds"]
    assert sum(f["gflop"] for f in fam.values()) == pytest.approx(result["gflop_per_step"], rel=1e-9)
    assert len(result["top_ops"]) == step_ops.TOP_OPS
    # The roofline bound: never under the FLOP bound, over it where weights were read
    for k in ("convolution", "matmul"):
        assert fam[k]["weight_gb"] > 0 and fam[k]["roofline_seconds"] >= fam[k]["gflop"] * 1e9 / (
            result["peak_gflops"] * 1e9
        )
    assert fam["attention"]["weight_gb"] == 0  # q, k, v are activations
    assert result["roofline_seconds"] == pytest.approx(sum(f["roofline_seconds"] for f in fam.values()))
    assert result["roofline_seconds"] >= result["bound_seconds"] and result["read_gbps"] > 0
    rows = step_ops.table([result])
    assert rows[-1].startswith(f"| | | | **step** | **{result['seconds_per_step']:.2f}** ")
    assert rows[-1].endswith(
        f"**{result['roofline_seconds']:.2f}** ({100 * result['fraction_of_roofline']:.0f} %) |"
    )


def test_op_calls_count_the_frozen_weights_each_call_reads_plain_or_laid_out():
    linear = torch.nn.Linear(64, 32).requires_grad_(False)
    x = torch.randn(4, 64)
    weight_bytes = (64 * 32 + 32) * 4  # addmm reads the weight and the bias
    assert step_ops.op_calls(lambda: linear(x), [linear]) == [("matmul", 2 * 4 * 64 * 32, weight_bytes)]
    assert step_ops.op_calls(lambda: linear(x), []) == [("matmul", 2 * 4 * 64 * 32, 0)]  # not a weight
    prepack.pack_linear(linear)
    linear(
        x
    )  # the laid-out copy exists now: a oneDNN tensor, counted as a weight (the plain one is not read)
    assert step_ops.op_calls(lambda: linear(x), [linear]) == [("matmul", 2 * 4 * 64 * 32, weight_bytes)]
    assert step_ops.op_calls(lambda: linear(x), []) == [("matmul", 2 * 4 * 64 * 32, 64 * 32 * 4)]


def test_the_roofline_takes_the_slower_of_compute_and_weight_reads_call_by_call():
    calls = [("matmul", 100, 10), ("matmul", 10, 100), ("convolution", 50, 0)]
    got = step_ops.roofline(calls, peak=10.0, read_bytes_per_s=20.0)
    assert got["matmul"] == {"flops": 110, "weight_bytes": 110, "bound_seconds": 10.0 + 5.0}
    assert got["convolution"] == {"flops": 50, "weight_bytes": 0, "bound_seconds": 5.0}


def test_a_result_goes_to_its_machines_folder_never_over_another_machines():
    def measured_on(folder):
        return json.loads((folder / "train_step-sd15-shape-256px.json").read_text())["machine"]

    home, amx = measured_on(common.RESULTS), measured_on(common.RESULTS / "xeon-amx")
    assert common.results_path("x.json", on=home) == common.RESULTS / "x.json"
    assert common.results_path("x.json", on=amx) == common.RESULTS / "xeon-amx" / "x.json"
    avx512 = {**home, "cpu": "Intel(R) Xeon(R) Processor", "isa": ["avx2", "avx512f", "fma"]}
    assert common.results_path("x.json", on=avx512) == common.RESULTS / "xeon-avx512" / "x.json"
    assert str(common.results_path("x.json", "given.json", on=avx512)) == "given.json"

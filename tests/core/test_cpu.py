"""helpers.core.cpu: what this CPU can do, the precision chosen for it, and thread settings."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time

import pytest
import torch
from tiny_parts import mapped_rss

from helpers.core import cpu

CPUINFO = """processor	: 0
cpu family	: 25
model		: 17
model name	: Test CPU 9000
flags		: fpu sse2 avx2 fma avx512f avx512_bf16
processor	: 1
"""


def test_flags_and_model_come_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert cpu.cpu_flags(str(info)) == frozenset({"fpu", "sse2", "avx2", "fma", "avx512f", "avx512_bf16"})
    assert cpu._model_name(str(info)) == "Test CPU 9000"
    # "model" is its own field, not the start of "model name"
    assert (cpu.cpuinfo_field("cpu family", str(info)), cpu.cpuinfo_field("model", str(info))) == ("25", "17")
    assert cpu.cpuinfo_field("stepping", str(info)) == ""
    assert cpu.cpu_flags(str(tmp_path / "missing")) == frozenset()  # no /proc/cpuinfo: no flags


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ({"avx512_bf16"}, True),
        ({"amx_bf16", "avx2"}, True),
        ({"avx2", "fma", "avx512f"}, False),
        (set(), False),
    ],
)
def test_native_bf16_means_avx512_bf16_or_amx(flags, native):
    assert cpu.has_native_bf16(frozenset(flags)) is native


def test_auto_picks_bf16_only_where_the_cpu_has_it():
    with_bf16, without = frozenset({"avx512_bf16"}), frozenset({"avx2"})
    assert cpu.choose_precision("auto", with_bf16, bf16_speedup=2.3) == cpu.PrecisionChoice(
        "bf16",
        "auto: the CPU has native bf16 (avx512_bf16, no AMX) and multiplies matrices 2.3x as fast "
        "in bf16, so bf16 autocast",
    )
    assert cpu.choose_precision("auto", without) == cpu.PrecisionChoice(
        "no", "auto: the CPU has no native bf16 (no AVX512-BF16, no AMX), so fp32"
    )
    assert cpu.choose_precision("no", with_bf16).mixed_precision == "no"


def test_auto_keeps_fp32_where_native_bf16_multiplies_slower(monkeypatch):
    with_bf16 = frozenset({"avx512f", "avx512_bf16"})
    assert cpu.choose_precision("auto", with_bf16, bf16_speedup=0.7) == cpu.PrecisionChoice(
        "no",
        "auto: the CPU has native bf16 (avx512_bf16, no AMX) and multiplies matrices 0.7x as fast "
        "in bf16 (bf16 pays from 1.3x), so fp32",
    )
    assert cpu.choose_precision("auto", with_bf16, bf16_speedup=1.29).mixed_precision == "no"
    assert cpu.choose_precision("auto", with_bf16, bf16_speedup=1.3).mixed_precision == "bf16"
    asked = cpu.choose_precision("bf16", with_bf16, bf16_speedup=0.7)
    assert (asked.mixed_precision, asked.warning) == (
        "bf16",
        "this CPU multiplies matrices 0.7x as fast in bf16 as in fp32: mixed_precision='auto' "
        "(fp32 here) trains faster",
    )
    assert cpu.choose_precision("bf16", with_bf16, bf16_speedup=1.0).warning is None
    # AMX is not measured: its bf16 tiles are many times fp32's speed
    monkeypatch.setattr(cpu, "bf16_gemm_speedup", lambda: pytest.fail("measured an AMX CPU"))
    assert cpu.choose_precision("auto", frozenset({"avx512_bf16", "amx_bf16"})).mixed_precision == "bf16"
    assert cpu.choose_precision("bf16", frozenset({"amx_bf16"})).warning is None


def test_the_bf16_speedup_is_measured_on_one_thread_once():
    cpu.bf16_gemm_speedup.cache_clear()
    threads = torch.get_num_threads()
    speedup = cpu.bf16_gemm_speedup()
    # a ratio of two timings: positive and finite is all it promises (an AVX2 CPU emulating bf16
    # under a busy test run measured 0.009, a quiet one 0.02)
    assert 0 < speedup < math.inf and torch.get_num_threads() == threads
    assert cpu.bf16_gemm_speedup() is speedup  # once per process
    assert cpu.bf16_gemm_speedup.cache_info().misses == 1
    if cpu.has_native_bf16() and "amx_bf16" not in cpu.cpu_flags():
        auto = cpu.choose_precision("auto")
        assert auto.mixed_precision == ("bf16" if speedup >= cpu.BF16_GEMM_SPEEDUP_NEEDED else "no")
        assert f"multiplies matrices {speedup:.1f}x as fast in bf16" in auto.reason


def test_bf16_asked_for_without_native_bf16_is_kept_with_a_warning():
    choice = cpu.choose_precision("bf16", frozenset({"avx2"}))
    assert choice.mixed_precision == "bf16"
    assert (
        "emulated and many times slower than fp32" in choice.warning
        and "mixed_precision='auto'" in choice.warning
    )
    assert cpu.choose_precision("bf16", frozenset({"amx_bf16"})).warning is None
    with pytest.raises(ValueError, match=r"mixed_precision='fp16': must be 'auto', 'no' or 'bf16'"):
        cpu.choose_precision("fp16")


def test_compute_dtype_follows_the_mode():
    assert cpu.compute_dtype("bf16") == torch.bfloat16
    assert cpu.compute_dtype("no") == torch.float32


def test_threads_come_from_omp_or_are_shared_among_the_nodes_processes(monkeypatch):
    with cpu.torch_threads(torch.get_num_threads()):  # restores PyTorch's count afterwards
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cpu.set_threads() == 3 and torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpu.physical_cores() * 2))
        assert cpu.set_threads() == 1  # more processes than cores: still one thread each
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert cpu.set_threads() == cpu.physical_cores()
        assert cpu.set_threads(2) == 2 and torch.get_num_threads() == 2


def test_torch_threads_restores_the_count_even_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), cpu.torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def test_physical_cores_never_exceed_what_this_process_may_use():
    assert 1 <= cpu.physical_cores() <= len(os.sched_getaffinity(0))


def test_report_agrees_with_the_choice_for_this_cpu():
    report = cpu.report()
    assert report.precision == cpu.choose_precision("auto").mixed_precision
    assert report.native_bf16 is cpu.has_native_bf16()
    assert set(report.isa_flags) == set(cpu.ISA_FLAGS)
    assert report.to_dict()["physical_cores"] == cpu.physical_cores()


def test_keep_freed_memory_applies_on_glibc_and_restores_on_exit():
    with cpu.keep_freed_memory() as applied:
        assert applied is (cpu._glibc() is not None)
    with cpu.keep_freed_memory() as again:  # the defaults came back: it can be entered again
        assert again is applied


def test_keep_freed_memory_leaves_glibcs_defaults_when_asked(monkeypatch):
    """``WORKSHOP_MALLOC_DEFAULTS=1``: how bench/ measures a run with glibc's defaults."""
    monkeypatch.setattr(cpu, "_glibc", lambda: pytest.fail("glibc was configured"))
    monkeypatch.setenv(cpu.MALLOC_DEFAULTS_ENV, "1")
    with cpu.keep_freed_memory() as applied:
        assert applied is False


def test_only_the_first_flags_line_counts_and_a_cpuinfo_without_one_has_no_flags(tmp_path):
    two = tmp_path / "two"
    two.write_text("processor\t: 0\nflags\t\t: avx2 fma\nprocessor\t: 1\nflags\t\t: avx2 fma amx_bf16\n")
    assert cpu.cpu_flags(str(two)) == frozenset({"avx2", "fma"})
    bare = tmp_path / "bare"  # e.g. an ARM machine's cpuinfo: "Features", no "flags", no "model name"
    bare.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert cpu.cpu_flags(str(bare)) == frozenset()
    assert cpu._model_name(str(bare)) == (platform.processor() or platform.machine())


def test_auto_names_the_native_bf16_flags_it_found():
    amx = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
    assert (
        cpu.choose_precision("auto", amx).reason
        == "auto: the CPU has native bf16 (amx_bf16), so bf16 autocast"
    )
    both = frozenset({"amx_bf16", "avx512_bf16"})
    assert cpu.choose_precision("auto", both).reason == (
        "auto: the CPU has native bf16 (avx512_bf16, amx_bf16), so bf16 autocast"
    )
    assert cpu.choose_precision("bf16", both) == cpu.PrecisionChoice(
        "bf16", "bf16 requested and the CPU has it natively (avx512_bf16, amx_bf16)"
    )
    assert cpu.choose_precision("no", amx) == cpu.PrecisionChoice("no", "fp32 requested")


def test_the_report_of_a_cpu_without_bf16_carries_the_warning(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda *args: frozenset({"avx2", "fma", "avx512f", "sse2"}))
    report = cpu.report("bf16")
    assert report.isa_flags == {
        "avx2": True,
        "fma": True,
        "avx512f": True,
        "avx512_bf16": False,
        "avx512_vnni": False,
        "avx_vnni": False,
        "amx_bf16": False,
        "amx_int8": False,
        "amx_tile": False,
    }
    assert (report.native_bf16, report.precision) == (False, "bf16")
    assert report.reason == (
        "bf16 requested although the CPU has no native bf16. WARNING: mixed_precision='bf16' on a CPU "
        "without AVX512-BF16 or AMX is emulated and many times slower than fp32 here; use "
        "mixed_precision='auto' (fp32 on this CPU)"
    )
    assert cpu.report("auto").precision == "no"


@pytest.mark.parametrize(("value", "processes"), [(None, 1), ("0", 1), ("1", 1), ("4", 4)])
def test_local_processes_come_from_local_world_size(value, processes, monkeypatch):
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert cpu.local_processes() == processes


@pytest.mark.parametrize("omp", ["0", "two", ""])
def test_an_unusable_omp_num_threads_is_ignored(omp, monkeypatch):
    with cpu.torch_threads(torch.get_num_threads()):
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert cpu.set_threads() == cpu.physical_cores() == torch.get_num_threads()


def test_process_age_counts_from_this_process_start():
    import psutil

    first = cpu.process_age()
    time.sleep(0.2)
    second = cpu.process_age()
    assert 0 < first < second and 0.15 < second - first < 2.0
    assert abs(second - (time.time() - psutil.Process().create_time())) < 1.5  # psutil's coarser reading


def test_ipex_is_usable_only_when_built_for_this_torchs_minor_version(monkeypatch):
    major, minor = torch.__version__.split(".")[:2]
    monkeypatch.setattr(cpu, "ipex_version", lambda: f"{major}.{minor}.100+cpu")
    assert cpu.ipex_problem() is None and cpu.ipex_available()
    monkeypatch.setattr(cpu, "ipex_version", lambda: f"{major}.{int(minor) + 1}.0")
    assert cpu.ipex_problem() == (
        f"intel_extension_for_pytorch {major}.{int(minor) + 1}.0 needs torch {major}.{int(minor) + 1}, "
        f"and this environment has torch {torch.__version__}"
    )
    assert not cpu.ipex_available()


@pytest.mark.parametrize(("preset", "expected"), [(None, "AUTO,STRICT"), ("COMPATIBLE", "COMPATIBLE")])
def test_importing_helpers_asks_mkl_for_reproducible_results_and_keeps_a_users_choice(preset, expected):
    """Two identical 2-thread runs on an Intel Xeon differed in the last digits without MKL_CBWR
    (tests/training/test_textual_inversion.py::test_resume_equals_uninterrupted caught it)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | ({"MKL_CBWR": preset} if preset else {})
    code = "import os, helpers; print(os.environ['MKL_CBWR'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == expected, done.stderr


@pytest.mark.skipif(cpu._glibc() is None, reason="madvise through glibc: Linux only")
def test_drop_file_pages_hands_back_a_loaded_weight_unless_another_tensor_shares_it():
    from diffusers import UNet2DConditionModel

    from helpers.training import models

    folder = models.tiny_pipeline_dir() / "unet"
    unet = UNet2DConditionModel.from_pretrained(folder)  # weights are views into a mapping of the file
    (path,) = folder.glob("*.safetensors")
    weight = max(unet.parameters(), key=lambda p: p.numel())
    size, page = weight.numel() * weight.element_size(), os.sysconf("SC_PAGE_SIZE")
    assert size >= 4 * page
    total = float(weight.sum())  # every page read, so resident
    resident = mapped_rss(path)

    view = weight[:1]  # another tensor on the same storage: its pages must stay
    assert cpu.drop_file_pages(weight) == 0
    del view
    dropped = cpu.drop_file_pages(weight)
    assert size - 2 * page <= dropped <= size
    assert resident - mapped_rss(path) >= dropped - page  # no longer resident
    assert float(weight.sum()) == total  # read again, from the file
    assert cpu.drop_file_pages(weight, cpu.file_mappings()) == dropped  # it lies in the file's mapping
    doomed = torch.ones(4 * page)  # anonymous memory, about to be dropped: handed back too
    assert cpu.drop_file_pages(doomed, cpu.file_mappings()) == 0  # unless only file pages are asked for
    assert cpu.drop_file_pages(doomed) >= 15 * page  # 16 pages of floats, less a partial one at each end


@pytest.mark.skipif(cpu._glibc() is None, reason="madvise through glibc: Linux only")
def test_a_frozen_model_that_did_its_part_leaves_memory_and_still_computes_the_same():
    from diffusers import AutoencoderKL

    from helpers.training import models

    folder = models.tiny_pipeline_dir() / "vae"
    vae = AutoencoderKL.from_pretrained(folder).eval()
    (path,) = folder.glob("*.safetensors")
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = vae.encode(x).latent_dist.mean
    resident = mapped_rss(path)
    dropped = cpu.drop_module_file_pages(vae)
    assert dropped > 0.8 * resident and mapped_rss(path) < 0.2 * resident
    with torch.no_grad():
        assert torch.equal(vae.encode(x).latent_dist.mean, before)  # its pages read again from the file
    built = torch.nn.Linear(1024, 1024)  # weights in anonymous memory: left alone, still valid
    weight = built.weight.detach().clone()
    assert cpu.drop_module_file_pages(built) == 0 and torch.equal(built.weight, weight)


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/self/maps and /proc/self/status")
def test_weights_mapped_from_their_file_are_not_counted_as_free_memory():
    """Loaded from safetensors, a model's weights are views into the file's mapping: ``file_backed_bytes``
    counts them all (read yet or not; a model built in memory: none), and ``available_memory`` leaves
    them out of ``MemAvailable``, which counts file pages as free."""
    import psutil
    from diffusers import UNet2DConditionModel

    from helpers.training import models

    folder = models.tiny_pipeline_dir() / "unet"
    unet = UNet2DConditionModel.from_pretrained(folder)
    weights = sum(t.numel() * t.element_size() for t in (*unet.parameters(), *unet.buffers()))
    assert cpu.file_backed_bytes([unet, unet]) == weights  # each weight once
    assert cpu.file_backed_bytes([torch.nn.Linear(256, 256)]) == 0
    huge = 2 * psutil.virtual_memory().total
    assert cpu.available_memory(file_bytes=huge) == 0
    rss_file = next(
        int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssFile:")
    )
    spare = psutil.virtual_memory().available - rss_file  # resident file pages (the libraries) are not spare
    assert abs(cpu.available_memory() - spare) < 64 * 2**20  # the machine's own churn between the readings

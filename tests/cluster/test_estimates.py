"""Expected training time: measured rows, stated scaling, the notebooks' real defaults."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from helpers.cluster import estimates
from helpers.launching import preflight
from helpers.workshop import notebooks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "row",
    estimates.MEASURED,
    ids=lambda r: f"{r.source.split('/')[-2]}-{r.shape}-{r.resolution}-{r.precision}",
)
def test_every_measured_row_is_its_benchmark_result(row):
    result = json.loads((ROOT / row.source).read_text())
    assert (result["model"], result["resolution"], result["batch"]) == (
        f"{row.shape}-shape",
        row.resolution,
        row.batch,
    )
    assert result["mixed_precision"] == row.precision and result["threads"] == row.physical_cores
    if "runs" in result:  # bench.end_to_end: whole commands
        seconds = {mode: result["medians"][mode]["seconds_per_step"] for mode in ("ours", "reference")}
    else:  # bench.train_step
        seconds = {
            mode: result["modes"][mode]["seconds_per_step"]["median"] for mode in ("ours", "reference")
        }
    assert (round(seconds["ours"], 2), round(seconds["reference"], 2)) == (
        row.seconds_per_step,
        row.reference_seconds_per_step,
    )
    assert all(word in result["machine"]["cpu"] for word in row.cpu.split(" (")[0].split())
    assert ("avx512_bf16" in result["machine"]["isa"]) == row.native_bf16
    assert ("amx_bf16" in result["machine"]["isa"]) == row.amx


def test_workshop_defaults_are_notebook_02s_parameters():
    nb = json.loads((notebooks.NOTEBOOK_DIR / "02_single_node_finetune.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    values = {s.target.id: ast.literal_eval(s.value) for s in ast.parse("".join(cell["source"])).body}
    assert {k: values[k] for k in estimates.WORKSHOP_DEFAULTS} == estimates.WORKSHOP_DEFAULTS


def test_scaling_from_the_nearest_measurement_is_stated():
    row = next(m for m in estimates.MEASURED if (m.precision, m.resolution, m.shape) == ("bf16", 256, "sd15"))
    same = estimates.training_time(100, 256, 1, "bf16", row.physical_cores, native_bf16=True)
    assert same.seconds == pytest.approx(100 * row.seconds_per_step) and same.scaling == "measured as is"
    bigger = estimates.training_time(100, 512, 2, "bf16", row.physical_cores, native_bf16=True)
    if bigger.basis is row:  # no 512 px row yet: 4x the pixels, 2x the images
        assert bigger.seconds_per_step == pytest.approx(8 * row.seconds_per_step)
        assert bigger.scaling == "pixels x4"
    fewer_cores = estimates.training_time(10, 256, 1, "bf16", 4, processes=4, native_bf16=True)
    assert fewer_cores.seconds_per_step == pytest.approx(row.seconds_per_step * row.physical_cores)
    assert "1 cores per process, assumed to scale linearly" in fewer_cores.scaling
    other = estimates.training_time(10, 256, 1, "bf16", 2, native_bf16=True, cpu="Intel Xeon Platinum 8480+")
    assert "measured on another CPU than Intel Xeon Platinum 8480+" in other.scaling
    assert other.describe().startswith(f"about {10 * row.seconds_per_step:.0f} s (")
    assert row.source in other.describe()


def test_each_cpu_family_takes_its_own_row():
    """AMX or not picks the row; where the family is unknown, the slowest row of the precision."""

    def row(precision, amx):
        return next(
            m for m in estimates.MEASURED if (m.precision, m.amx, m.shape) == (precision, amx, "sd15")
        )

    for precision in ("bf16", "no"):
        for amx in (True, False):
            got = estimates.training_time(1, 256, 1, precision, 2, native_bf16=True, amx=amx)
            assert (
                got.basis is row(precision, amx)
                and got.seconds_per_step == row(precision, amx).seconds_per_step
            )
        unknown = estimates.training_time(1, 256, 1, precision, 2)
        assert unknown.basis is max(
            (row(precision, a) for a in (True, False)), key=lambda m: m.seconds_per_step
        )
    xeon = estimates.training_time(
        1, 256, 1, "bf16", 2, native_bf16=True, amx=True, cpu="Intel(R) Xeon(R) Processor"
    )
    assert xeon.scaling == "measured as is"
    epyc_cpu = estimates.training_time(1, 256, 1, "bf16", 2, native_bf16=True, amx=True, cpu="AMD EPYC 9V74")
    assert "measured on another CPU than AMD EPYC 9V74" in epyc_cpu.scaling
    v6 = estimates.cluster_time("Standard_D16s_v6", 1)  # Emerald Rapids: AMX
    assert v6.basis is row("bf16", True)


def test_cluster_time_spreads_notebook_02s_images_over_every_process():
    two = estimates.cluster_time("Standard_D8_v5", node_count=2, nproc_per_node=2)
    one = estimates.cluster_time("Standard_D8_v5", node_count=1, nproc_per_node=2)
    assert two.basis.precision == "no"  # Dv5 may land on Ice Lake: fp32 is the safe estimate
    # 1000 images over 4 processes = 250 steps; over 2 = 500; each process gets 4 vCPU / 2 = 2 cores
    assert two.seconds == pytest.approx(250 * two.seconds_per_step)
    assert (
        one.seconds == pytest.approx(500 * one.seconds_per_step)
        and one.seconds_per_step == two.seconds_per_step
    )
    assert "measured on another CPU than Xeon Platinum" in two.scaling
    assert estimates.cluster_time("Standard_D16s_v6", 1).basis.precision == "bf16"  # Emerald Rapids: AMX
    with pytest.raises(ValueError, match="not an Azure size name"):
        estimates.cluster_time("big-machine", 1)


def test_a_shape_is_estimated_from_its_own_rows_only():
    sdxl = [m for m in estimates.MEASURED if m.shape == "sdxl"]
    for precision in {m.precision for m in sdxl}:
        got = estimates.training_time(10, 1024, 1, precision, 2, native_bf16=True, amx=False, shape="sdxl")
        basis = next(m for m in sdxl if m.precision == precision)
        assert got.basis is basis
        assert got.seconds_per_step == pytest.approx(basis.seconds_per_step * (1024 / basis.resolution) ** 2)
    sd15 = estimates.training_time(10, 512, 1, "bf16", 2, native_bf16=True, amx=False)
    assert sd15.basis.shape == "sd15" and sd15.basis.seconds_per_step < sdxl[0].seconds_per_step
    with pytest.raises(
        ValueError, match=r"shape='sd3': no step time measured \(measured: \['sd15', 'sdxl'\]\)"
    ):
        estimates.training_time(10, 512, 1, "bf16", 2, shape="sd3")


def test_a_cluster_run_fits_processes_then_prices_the_hours(monkeypatch):
    gib = 2**30
    need = {512: 20 * gib, 1024: 50 * gib}  # per process; E16s_v5: 128 GiB, less 2 for the OS
    monkeypatch.setattr(estimates, "memory_per_process", lambda res, precision, prepack, shape: need[res])
    run = estimates.cluster_run("Standard_E16s_v5", 4, 3200, 512, "sdxl")
    assert (run.precision, run.processes_per_node) == ("no", 4)  # 6 fit; at most 4 (the guide's)
    assert run.time == estimates.cluster_time("Standard_E16s_v5", 4, 4, 3200, 512, "sdxl")
    assert run.time.seconds == pytest.approx(200 * run.time.seconds_per_step)  # 3,200 images / 16 processes
    assert run.usd_per_node_hour == 16 * 0.063 and run.usd == round(run.time.hours * 4 * 16 * 0.063, 2)
    big = estimates.cluster_run("Standard_E16s_v5", 4, 3200, 1024, "sdxl")
    assert big.processes_per_node == 2 and big.time.seconds == pytest.approx(400 * big.time.seconds_per_step)
    assert big.row() == {"VM size": "Standard_E16s_v5", "px": 1024, "precision": "fp32", "processes per node": 2,
                         "hours": round(big.time.hours, 1), "USD (VMs, training only)": big.usd}  # fmt: skip
    nothing = estimates.cluster_run("Standard_D8_v5", 4, 3200, 1024, "sdxl")  # 30 GiB usable
    assert (nothing.processes_per_node, nothing.time, nothing.usd) == (0, None, None)
    unpriced = estimates.cluster_run("Standard_E32s_v6", 4, 3200, 512, "sdxl")  # AMX: bf16; no price yet
    assert unpriced.precision == "bf16" and unpriced.time is not None and unpriced.usd is None


@pytest.mark.parametrize(
    "row", estimates.MEASURED_MEMORY, ids=lambda r: f"{r.shape}-{r.resolution}-{r.precision}-{r.prepack}"
)
def test_every_memory_row_is_its_benchmark_result(row):
    result = json.loads((ROOT / row.source).read_text())
    assert (result["model"], result["resolution"], result["mixed_precision"]) == (
        f"{row.shape}-shape",
        row.resolution,
        row.precision,
    )
    if "runs" in result:  # bench.end_to_end: whole commands, the engine's default prepacking
        [ours] = [r for r in result["runs"] if r["mode"] == "ours"]
        assert round(ours["peak_rss_gib"] * 1024, 1) == row.peak_mib and not row.prepack
    else:  # bench.train_step
        mode = "ours" if row.prepack else "ours_unpacked"
        assert round(result["modes"][mode]["peak_rss_mib"], 1) == row.peak_mib


def test_memory_per_process_is_the_measured_peak_and_scales_only_what_is_not_weights(monkeypatch):
    rows = (
        estimates.PeakMemory(256, "no", True, 10240.0, "a.json"),
        estimates.PeakMemory(256, "bf16", False, 4096.0, "b.json"),
    )
    monkeypatch.setattr(preflight, "MEASURED_MEMORY", rows)  # their one home, below helpers.cluster
    monkeypatch.setattr(
        preflight,
        "RESIDENT_WEIGHTS_GIB",
        {
            ("sd15", "no", True): 6.0,
            ("sd15", "no", False): 3.0,
            ("sd15", "bf16", True): 3.5,
            ("sd15", "bf16", False): 2.0,
        },
    )
    gib = 2**30
    assert estimates.memory_per_process(256, "no") == 10 * gib
    assert estimates.memory_per_process(512, "no") == 6 * gib + 4 * 4 * gib  # 4 GiB above the weights, x4
    assert estimates.memory_per_process(256, "no", prepack=False) == 7 * gib  # less 3 GiB of copies
    assert estimates.memory_per_process(512, "bf16", prepack=False) == 2 * gib + 4 * 2 * gib
    assert estimates.memory_per_process(256, "bf16", prepack=True) == int(5.5 * gib)
    assert estimates.memory_basis(512, "no", prepack=False) == (
        "10.0 GiB measured at 256 px (a.json); less the prepacked copies (not measured unpacked); "
        "the part above the weights scaled by the pixels (x4)"
    )
    with pytest.raises(ValueError, match="precision='fp16': no memory measured for the sd15 shape"):
        estimates.memory_per_process(256, "fp16")
    # a row measured at another resolution is taken where it is the nearest
    wider = (*rows, estimates.PeakMemory(512, "no", True, 14336.0, "c.json"))
    monkeypatch.setattr(preflight, "MEASURED_MEMORY", wider)
    assert estimates.memory_per_process(512, "no") == 14 * gib
    assert estimates.memory_per_process(384, "no") == 6 * gib + int(4 * gib * (384 / 256) ** 2)  # nearer 256
    assert estimates.memory_per_process(768, "no") == 6 * gib + int(8 * gib * (768 / 512) ** 2)
    assert estimates.memory_basis(768, "no").startswith("14.0 GiB measured at 512 px (c.json)")


def test_processes_that_fit_a_node_from_its_documented_memory(monkeypatch):
    gib = 2**30
    assert estimates.node_memory_bytes("Standard_D8_v5") == 32 * gib  # D: 4 GiB per vCPU
    assert estimates.node_memory_bytes("Standard_E16s_v5") == 128 * gib  # E: 8 GiB per vCPU
    assert estimates.node_memory_bytes("Standard_D4s_v6") == 16 * gib
    with pytest.raises(ValueError, match="'Standard_F8s_v2': not a size of Dv5/Dsv5"):
        estimates.node_memory_bytes("Standard_F8s_v2")
    need = {("no", True): 10 * gib, ("no", False): 7 * gib}
    monkeypatch.setattr(
        estimates, "memory_per_process", lambda res, precision, prepack, shape: need[(precision, prepack)]
    )
    # 32 GiB less the 2 GiB kept for the OS: 30 GiB
    assert estimates.processes_that_fit("Standard_D8_v5", 512, "no") == 3
    assert estimates.processes_that_fit("Standard_D8_v5", 512, "no", prepack=False) == 4
    assert estimates.processes_that_fit("Standard_D2s_v6", 512, "no") == 0  # 8 GiB: not even one

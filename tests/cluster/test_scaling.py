"""The scaling model: its arithmetic on given inputs, its calibration files, the guide's published point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.cluster import estimates, scaling
from helpers.cluster import prices as azure_data
from helpers.workshop import plots

ROOT = Path(__file__).resolve().parents[2]


def test_bytes_per_step_on_the_sd15_shape():
    assert scaling.allreduced_bytes("ours") == 3_072
    assert scaling.allreduced_bytes("ours", num_vectors=4) == 12_288
    assert scaling.allreduced_bytes("reference") == 151_784_448
    assert scaling.allreduced_bytes("reference") // scaling.allreduced_bytes("ours") == 49_409
    with pytest.raises(ValueError, match="'ours' or 'reference'"):
        scaling.allreduced_bytes("full")


def test_loopback_link_is_the_fit_in_its_result_file():
    result = json.loads((ROOT / scaling.LOOPBACK_SOURCE).read_text())
    assert result["world_size"] == 2 and result["transport"].startswith("gloo")
    assert {3_072, 151_784_448} <= set(result["bytes"])  # ours and the reference's sizes were measured
    assert round(result["fit"]["latency_s"], 6) == scaling.LOOPBACK.latency_s
    assert round(result["fit"]["bytes_per_s"] / 1e9, 2) * 1e9 == scaling.LOOPBACK.bytes_per_s
    refit = scaling.fit_link(result["bytes"], result["median_seconds"], result["world_size"])
    assert refit.latency_s == pytest.approx(result["fit"]["latency_s"])
    assert refit.bytes_per_s == pytest.approx(result["fit"]["bytes_per_s"])


def test_the_ccl_link_is_its_result_files_fit_or_absent_and_said_so():
    """CCL_LOOPBACK holds the committed fit of ``bench.scaling --backend ccl``; without that file the
    model has no ccl link, and asking for it is one error naming the run that makes it."""
    source = ROOT / scaling.CCL_LOOPBACK_SOURCE
    if not source.exists():
        assert scaling.CCL_LOOPBACK is None
        with pytest.raises(ValueError, match=r"run `python -m bench.scaling --backend ccl`"):
            scaling.predict("ours", "Standard_D8_v5", 2, 2, backend="ccl")
        return
    result = json.loads(source.read_text())
    assert result["backend"] == "ccl" and result["world_size"] == 2
    assert round(result["fit"]["latency_s"], 6) == scaling.CCL_LOOPBACK.latency_s
    assert round(result["fit"]["bytes_per_s"] / 1e9, 2) * 1e9 == scaling.CCL_LOOPBACK.bytes_per_s


def test_the_backend_picks_the_link_inside_and_between_nodes(monkeypatch):
    fast = scaling.Link(latency_s=10e-6, bytes_per_s=5e9)
    monkeypatch.setattr(scaling, "CCL_LOOPBACK", fast)
    assert scaling.local_link("ccl") == fast and scaling.local_link("gloo") == scaling.LOOPBACK
    assert scaling.network_link(8, "ccl") == scaling.Link(10e-6 + scaling.NETWORK_LATENCY_S, 1e9)
    gloo, ccl = (scaling.predict("ours", "Standard_D8_v5", 4, 2, backend=b) for b in ("gloo", "ccl"))
    assert ccl.compute_s == gloo.compute_s
    hop = {b: max(link.latency_s + 3_072 / 8 / link.bytes_per_s for link in (scaling.local_link(b),
               scaling.network_link(scaling.azure_machine("Standard_D8_v5").network_gbps, b))) for b in ("gloo", "ccl")}  # fmt: skip
    assert (gloo.allreduce_s, ccl.allreduce_s) == pytest.approx((2 * 7 * hop["gloo"], 2 * 7 * hop["ccl"]))
    with pytest.raises(ValueError, match="backend='nccl': use 'gloo' or 'ccl'"):
        scaling.local_link("nccl")


def test_fit_recovers_a_known_link():
    link = scaling.Link(latency_s=2e-4, bytes_per_s=1.5e9)
    sizes = [4, 3_072, 2**20, 2**24, 151_784_448]
    seconds = [scaling.ring_allreduce_seconds(n, 2, link) for n in sizes]
    fit = scaling.fit_link(sizes, seconds, 2)
    assert fit.latency_s == pytest.approx(2e-4, rel=1e-9) and fit.bytes_per_s == pytest.approx(
        1.5e9, rel=1e-9
    )
    with pytest.raises(ValueError, match="do not grow"):
        scaling.fit_link([4, 8], [1.0, 0.5], 2)


def test_ring_allreduce_arithmetic():
    link = scaling.Link(latency_s=1e-4, bytes_per_s=1e9)
    # 16 ranks: 30 ring steps of 1e-4 s + 151,784,448 / 16 = 9,486,528 bytes at 1 GB/s
    assert scaling.ring_allreduce_seconds(151_784_448, 16, link) == pytest.approx(30 * (1e-4 + 9_486_528e-9))
    assert scaling.ring_allreduce_seconds(3_072, 2, link) == pytest.approx(2 * (1e-4 + 1_536e-9))
    assert scaling.ring_allreduce_seconds(3_072, 1, link) == 0.0


def test_a_ring_step_lasts_as_long_as_its_slowest_hop():
    local, network = scaling.Link(1e-5, 4e9), scaling.Link(5e-5, 1e9)
    nbytes = 8e6
    # one node: local hops only; one process per node: network hops only; both: the slower one
    assert scaling.allreduce_seconds(nbytes, 1, 4, network, local) == pytest.approx(6 * (1e-5 + 2e6 / 4e9))
    assert scaling.allreduce_seconds(nbytes, 4, 1, network, local) == pytest.approx(6 * (5e-5 + 2e6 / 1e9))
    assert scaling.allreduce_seconds(nbytes, 2, 2, network, local) == pytest.approx(6 * (5e-5 + 2e6 / 1e9))
    assert scaling.allreduce_seconds(nbytes, 1, 1, network, local) == 0.0


def test_ours_all_reduces_49409_times_fewer_bytes_and_waits_far_less():
    no_latency = scaling.Link(0.0, 1e9)
    ours, ref = (scaling.allreduced_bytes(m) for m in ("ours", "reference"))
    for nodes, nproc in [(1, 2), (4, 4), (16, 8)]:
        t_ours = scaling.allreduce_seconds(ours, nodes, nproc, no_latency, no_latency)
        t_ref = scaling.allreduce_seconds(ref, nodes, nproc, no_latency, no_latency)
        assert t_ref / t_ours == pytest.approx(49_409)  # the bandwidth term alone: >= 10^4 x smaller
    # With the measured latency per ring step, ours is latency-bound: below the reference on every
    # layout, but only 28x less time at the guide's 16 ranks, and the ring's 2 (p - 1) latencies
    # dominate both at hundreds of ranks.
    for vm_size, _ in scaling.FIGURE_LAYOUTS[:2]:
        machine = scaling.azure_machine(vm_size)
        for nodes in range(1, 17):
            for nproc in range(2 if nodes == 1 else 1, machine.physical_cores + 1):
                o = scaling.predict("ours", machine, nodes, nproc).allreduce_s
                r = scaling.predict("reference", machine, nodes, nproc).allreduce_s
                steps = 2 * (nodes * nproc - 1)
                latency = scaling.LOOPBACK.latency_s + (scaling.NETWORK_LATENCY_S if nodes > 1 else 0)
                assert r > o and steps * latency < o < 1.02 * steps * latency
    check = scaling.guide_check()
    assert 25 < check.reference.allreduce_s / check.ours.allreduce_s < 30


def test_compute_is_the_measured_step_scaled_as_estimates_does():
    sd15 = [m for m in estimates.MEASURED if m.shape == "sd15"]  # the scaling model's shape
    fp32 = max((m for m in sd15 if m.precision == "no"), key=lambda m: m.seconds_per_step)
    amx_bf16 = next(m for m in sd15 if m.precision == "bf16" and m.amx)
    d8 = scaling.predict("ours", "Standard_D8_v5", nodes=3, nproc_per_node=2)  # Dv5 may be Ice Lake: fp32
    # 512 px is 4x the pixels of 256; 4 cores / 2 processes = 2 cores each, as measured; a host of
    # either family: the slower fp32 row
    assert d8.compute_s == pytest.approx(fp32.seconds_per_step * 4)
    ref = scaling.predict("reference", "Standard_D8_v5", nodes=3, nproc_per_node=2)
    assert ref.compute_s == pytest.approx(fp32.reference_seconds_per_step * 4)
    big = scaling.predict("ours", "Standard_D96s_v6", nodes=1, nproc_per_node=4)  # 48 cores, 12 per process
    assert big.compute_s == pytest.approx(amx_bf16.seconds_per_step * 4 * 2 / 12)  # Emerald Rapids: AMX
    assert d8.images_per_second == pytest.approx(6 / d8.seconds_per_step)
    with pytest.raises(ValueError, match="not in helpers.cluster.prices"):
        scaling.predict("ours", "Standard_F8s_v2", 1, 1)


@pytest.mark.parametrize("vm_size", ["Standard_D8_v5", "Standard_D32s_v6", "Standard_E16_v5"])
def test_more_nodes_never_lower_ours_images_per_second(vm_size):
    machine = scaling.azure_machine(vm_size)
    for nproc in (1, 2, machine.physical_cores):
        speeds = [scaling.predict("ours", machine, n, nproc).images_per_second for n in range(1, 17)]
        assert speeds == sorted(speeds) and speeds[-1] > 15 * speeds[0]  # near-linear: communication is small


def test_guide_check_reproduces_its_stated_numbers():
    check = scaling.guide_check()
    bf16 = next(m for m in estimates.MEASURED if m.precision == "bf16" and m.amx)  # the guide's CPU family
    # 4 nodes x 4 processes of 112 cores: 28 cores per process, 512 px = 4x the pixels of 256
    compute = bf16.reference_seconds_per_step * 4 * 2 / 28
    # 16 ranks, 30 ring steps of 151,784,448 / 16 bytes; the loopback hop is slower than 25 Gbit/s
    hop = scaling.LOOPBACK.latency_s + 9_486_528 / scaling.LOOPBACK.bytes_per_s
    assert hop > scaling.NETWORK_LATENCY_S + scaling.LOOPBACK.latency_s + 9_486_528 / (25e9 / 8)
    assert check.reference.compute_s == pytest.approx(compute)
    assert check.reference.allreduce_s == pytest.approx(30 * hop)
    assert check.predicted_seconds == pytest.approx(200 * (compute + 30 * hop))
    assert check.published_seconds == 300 and check.published_seconds_per_step == pytest.approx(1.2)
    assert check.published_images_per_second == pytest.approx(16 / 1.2)
    assert (
        round(check.reference.seconds_per_step, 2) == 0.71 and round(check.predicted_seconds / 300, 2) == 0.48
    )
    assert round(check.ours.seconds_per_step, 2) == 0.21
    text = check.describe()
    assert "0.55 s compute + 0.16 s all-reduce = 0.71 s per step, 2.4 min for 200 steps" in text
    assert "(0.48 of the published time" in text and "Ours on that cluster: 0.21 s per step" in text


def test_network_bandwidth_of_the_sizes_notebook_01_offers():
    assert azure_data.network_gbps("Standard_D8_v5") == 12.5
    assert azure_data.network_gbps("Standard_D8s_v5") == 12.5
    assert azure_data.network_gbps("Standard_D96s_v6") == 41.0
    assert azure_data.network_gbps("Standard_E96_v5") == 30.0
    assert azure_data.network_gbps("Standard_D7_v5") is None and azure_data.network_gbps("big") is None
    assert {row.series for row in azure_data.SIZE_SERIES} == set(azure_data.NETWORK_MBPS)


def test_line_groups_colours_groups_and_styles_variants():
    curves = {
        ("a", "ours"): ([1, 2], [1, 2]),
        ("a", "reference"): ([1, 2], [1, 1.5]),
        ("b", "ours"): ([1], [3]),
    }
    ax = plots.line_groups(curves, title="t", xlabel="x", ylabel="y", log=True).axes[0]
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == ["a: ours", "a: reference", "b: ours"]
    assert lines[0].get_color() == lines[1].get_color() != lines[2].get_color()
    assert [ln.get_linestyle() for ln in lines] == ["-", "--", "-"]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="no curves"):
        plots.line_groups({}, title="t", xlabel="x", ylabel="y")


def test_figure_draws_every_layout_and_the_published_point():
    ax = plots.scaling_figure(max_nodes=4).axes[0]
    lines = ax.get_lines()
    # ours and the reference per layout, ours on ccl too where the model has ccl's link, the star
    assert len(lines) == (2 + (scaling.CCL_LOOPBACK is not None)) * len(scaling.FIGURE_LAYOUTS) + 1
    d8_ours = next(ln for ln in lines if ln.get_label() == "Standard_D8_v5, 2 per node: ours")
    assert list(d8_ours.get_xdata()) == [2, 4, 6, 8]
    star = lines[-1]
    assert list(star.get_xdata()) == [16] and list(star.get_ydata()) == pytest.approx([16 / 1.2])


def test_the_backend_effect_is_read_from_the_bench_result_file(tmp_path):
    folder = tmp_path / "results" / "xeon-avx512"
    folder.mkdir(parents=True)
    machine = {"cpu": "Some Xeon", "load_average": [3.25, 1, 1]}
    (folder / "allreduce_backends-loopback.json").write_text(json.dumps({"machine": machine}))
    assert scaling.backend_effect(tmp_path / "results") is None  # latency only, no training step
    step = {"model": "toyworld", "median_seconds_per_step": {"gloo": 0.5, "ccl": 0.4}}
    (folder / "allreduce_backends-loopback.json").write_text(
        json.dumps({"machine": machine, "train_step": step})
    )
    effect = scaling.backend_effect(tmp_path / "results")
    assert effect.seconds_per_step == {"gloo": 0.5, "ccl": 0.4} and effect.load_average == 3.25
    assert effect.describe() == (
        "The same 2-process step (toyworld, one machine) took 0.500 s on gloo and 0.400 s on ccl (1.25x), "
        f"measured by bench.allreduce on Some Xeon under a load average of 3.2 ({folder}/allreduce_backends-"
        "loopback.json; figures from a shared machine are noisy)."
    )

"""Every notebook: committed clean, one parameters cell, runs on the tiny profile in JupyterLab as
an attendee runs it (tests/workshop/lab.py), shows nothing broken there, and records what it
computed (each notebook's records are checked here)."""

from __future__ import annotations

import ast
import base64
import io
import json
import math
import re
from pathlib import Path

import pytest
from launching.test_launch import AUTO, SPLIT_LOSS_REL  # tests/ is on sys.path
from PIL import Image

from helpers import inference
from helpers.cluster import azure, estimates, scaling
from helpers.workshop import notebooks
from workshop import lab
from workshop.test_handouts import quiet_offline_handout

NOTEBOOKS = notebooks.notebook_paths()


def test_the_seven_workshop_notebooks_exist():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_clean(path: Path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "outputs committed"
    # JupyterLab saves the ipywidgets' state into a notebook it saves (metadata "widgets"): a
    # notebook opened from notebooks/ and saved would carry the upload form's state along
    assert "widgets" not in nb["metadata"], "saved widget state committed (metadata 'widgets')"
    tagged = [i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    params = nb["cells"][tagged[0]]
    assert params["cell_type"] == "code"
    # literal values only, each annotated and commented, so papermill --help-notebook documents them
    for stmt in ast.parse("".join(params["source"])).body:
        assert isinstance(stmt, ast.AnnAssign), ast.unparse(stmt)
        ast.literal_eval(stmt.value)
    lines = [ln for ln in "".join(params["source"]).splitlines() if ln.strip()]
    assert all("  # " in ln for ln in lines), "every parameter has a trailing comment"
    # the parameters cell comes right after the imports cell
    assert [c["cell_type"] for c in nb["cells"][: tagged[0]]].count("code") == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_tiny_profile_only_sets_declared_parameters(path: Path):
    nb = json.loads(path.read_text())
    params = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    declared = {s.target.id for s in ast.parse("".join(params["source"])).body}
    assert set(notebooks.tiny_profile(path)) <= declared


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_tiny_profile_and_records(path: Path, notebook_records, notebook_run_dir):
    """Every code cell ran, in order, once; every name a cell passes to ``record("...")`` was
    recorded (a cell that skipped its record, e.g. behind an ``if``, fails here). What the values
    must be is each notebook's own test."""
    records = notebook_records(path.stem)
    executed = json.loads((notebook_run_dir / path.name).read_text())
    code = [c for c in executed["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    assert None not in counts and counts == sorted(set(counts)), f"cells not run in order: {counts}"
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    source = "\n".join("".join(c["source"]) for c in code)
    named = set(re.findall(r"""\brecord\(\s*["']([^"']+)["']""", source))
    assert records and named <= set(records), f"named but not recorded: {sorted(named - set(records))}"


@pytest.mark.notebooks
@pytest.mark.skipif(bool(lab.MISSING), reason=lab.MISSING)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_in_jupyterlab(path: Path, notebook_records, notebook_run_dir):
    """What JupyterLab showed while the notebook ran and afterwards (``lab.run_in_lab``'s findings):
    nothing a person would call broken, every code cell run."""
    notebook_records(path.stem)
    report = json.loads((notebook_run_dir / f"{path.stem}.lab.json").read_text())
    assert report["code_cells"] > 0, (
        f"{path.name}: no code cell found in the page: the notebook was not opened"
    )
    assert not report["findings"], (
        f"{path.name} in JupyterLab ({report['cells_run']}/{report['code_cells']} code cells ran in "
        f"{report['seconds_run_all']} s; screenshot {report['screenshot']}):\n  - "
        + "\n  - ".join(report["findings"])
    )
    assert report["cells_run"] == report["code_cells"]
    seconds = {int(i): s for i, s in report["seconds_per_cell"].items()}  # where its time went
    assert sorted(seconds) == [c["index"] for c in report["cells"] if c["type"] == "code"]
    assert 0 < sum(seconds.values()) <= report["seconds_run_all"]


def live_curve(executed: Path, index: int = 0) -> list[str]:
    """The text of each picture in the ``index``-th cell that trained under ``plots.live_loss`` (one,
    if it was replaced in place while training), after checking each is a PNG."""
    cells = json.loads(executed.read_text())["cells"]
    cell = [c for c in cells if "plots.live_loss(" in "".join(c["source"])][index]
    shown = [o["data"] for o in cell["outputs"] if "image/png" in o.get("data", {})]
    assert all(Image.open(io.BytesIO(base64.b64decode(d["image/png"]))).format == "PNG" for d in shown)
    return ["".join(d["text/plain"]) for d in shown]  # nbformat may keep text as a list of lines


# --- what each executed notebook recorded ------------------------------------------------------
# Every check of an executed notebook lives in this module: the notebooks run once per session,
# in order, on the worker that asks first (conftest.notebook_records), and a test in another
# module would sit idle on the other worker until they have (measured: 10 min in one CI run).


@pytest.mark.notebooks
def test_notebook_01_records(notebook_records):
    records = notebook_records("01_azure_cluster_setup")
    profile = notebooks.tiny_profile("01_azure_cluster_setup")
    spec = azure.ClusterSpec(ssh_source_cidr=profile["ssh_source_cidr"])  # the notebook's defaults otherwise
    commands = azure.plan(spec)
    assert records["planned_commands"] == len(commands) == 13
    assert records["mutating_commands"] == sum(c.mutating for c in commands) == 12
    assert records["estimated_cost_per_hour"] == azure.estimate_cost(spec).per_hour == 0.823
    # the cluster's hours: the real run's training time on these nodes plus setup_hours (1.5)
    training = estimates.cluster_time(spec.vm_size, spec.node_count)
    assert records["estimated_hours"] == round(training.hours + 1.5, 1) > 1.5


@pytest.mark.notebooks
def test_notebook_02_records(notebook_records, notebook_run_dir):
    from safetensors.torch import load_file

    r = notebook_records("02_single_node_finetune")
    assert r["history_steps"] == 200 and r["final_loss"] > 0 and r["steps_per_second"] > 0
    # the loss drawn while it trained: one picture, replaced in place, the last one at the last step
    [curve] = live_curve(notebook_run_dir / "02_single_node_finetune.ipynb")
    assert re.fullmatch(r"loss after step 200 of 200: \d\.\d{4}", curve), curve
    assert r["precision"] in ("no", "bf16")
    embeds = load_file(r["learned_embeds_path"])
    assert list(embeds) == ["<pip>"] and embeds["<pip>"].shape == (1, 32)
    # The toy world's acceptance (8 pictures, fixed seeds, the judge's mean probability of Pip):
    assert r["concept_score_before"] <= 0.2  # the new word starts as "toy": not Pip
    # after the offline profile's training it draws Pip. The score depends on the CPU's precision and
    # kernels: the 200 steps trained in bf16 on an AVX512-BF16 EPYC score above 0.7; in fp32 on an
    # AVX-512 Xeon without bf16, 0.644 (the same before and after this session's changes, measured
    # on the commit before them), so the bound is the one both pass, far above the 0.2 before training.
    assert r["concept_score_after"] >= 0.6
    # and composes: "a photo of <pip> on the grass" is Pip, on grass in most pictures
    assert r["concept_score_composed"] >= 0.5 and r["composed_backgrounds"].count("grass") > 4
    assert Path(r["learned_embeds_path"]).is_relative_to(notebook_run_dir)
    assert (Path(r["pipeline_dir"]) / "model_index.json").is_file()


@pytest.mark.notebooks
def test_notebook_03_records(notebook_records, notebook_run_dir):
    from accelerate.commands.config.config_args import load_config_from_file

    from helpers.core import cpu

    r = notebook_records("03_accelerate_config")
    assert r["config_files"] == ["accelerate_config_node0.yaml"] and r["machine_ranks"] == [0]
    assert (r["num_processes"], r["num_machines"], r["distributed_type"]) == (2, 1, "MULTI_CPU")
    assert r["mixed_precision"] == cpu.choose_precision("auto").mixed_precision
    assert r["questions_answered"] == 13  # every prompt of `accelerate config` for multi-CPU
    written = load_config_from_file(
        str(notebook_run_dir / "accelerate_configs" / "accelerate_config_node0.yaml")
    )
    assert (written.num_processes, written.machine_rank, written.use_cpu) == (2, 0, True)
    # the dry run for notebook 01's planned 3-node cluster: one file per node, head's private IP
    assert r["example_cluster_files"] == [f"accelerate_config_node{k}.yaml" for k in range(3)]
    example = [
        load_config_from_file(str(notebook_run_dir / "accelerate_configs" / "example-cluster" / name))
        for name in r["example_cluster_files"]
    ]
    assert [(c.machine_rank, c.num_machines, c.num_processes) for c in example] == [
        (k, 3, 6) for k in range(3)
    ]
    assert {c.main_process_ip for c in example} == {"10.42.1.4"}


@pytest.mark.notebooks
def test_notebook_04_records(notebook_records, notebook_run_dir):
    r = notebook_records("04_multi_node_mpirun")
    assert r["world_size"] == 2 and r["steps"] == 200 and r["embeddings_identical_across_ranks"] is True
    hidden, num_vectors = 32, 1  # the toy world's text encoder
    assert r["allreduce_bytes_per_step"] == num_vectors * hidden * 4
    assert r["full_matrix_allreduce_bytes_per_step"] >= 10_000 * r["allreduce_bytes_per_step"]
    # the scaling model's check against the guide's published run (tests/cluster/test_scaling.py pins its numbers)
    model = scaling.guide_check().reference.seconds_per_step
    assert r["scaling_guide_seconds_per_step"] == pytest.approx({"model": model, "published": 1.2}, abs=5e-4)
    assert r["images_per_second"] > 0
    assert r["images_per_second_per_process"] == pytest.approx(r["images_per_second"] / 2)
    assert r["preflight_problems"] == 0 and r["final_loss"] > 0
    assert " -n 2 -ppn 2 " in r["command"] and "accelerate.commands.launch --config_file" in r["command"]
    assert (notebook_run_dir / "outputs" / "pip-toyworld-mpirun" / "learned_embeds.safetensors").is_file()
    # the backend: ccl where it is built (as the guides run), its variables in the command; gloo's step from the bench
    assert r["backend"] == r["ray_backend"] == AUTO
    assert ("-genv CCL_ATL_TRANSPORT ofi" in r["command"]) == (AUTO == "ccl")
    effect = scaling.backend_effect()
    assert r["gloo_over_ccl_step"] == (
        effect.seconds_per_step["gloo"] / effect.seconds_per_step["ccl"] if effect else None
    )
    # the cluster run learned Pip too (the judge's mean probability, 8 pictures); CPU-dependent as
    # notebook 02's (tests/workshop/test_notebooks.py): 0.645 in fp32 on an AVX-512 Xeon without bf16
    assert r["concept_score"] >= 0.6
    # the Ray section: the first 20 steps of the same training through Ray Train workers (a private
    # runtime here), the same loss at every step as mpirun's (the same ranks, data and draws)
    assert r["ray_world_size"] == 2 and r["ray_embeddings_identical_across_ranks"] is True
    assert r["ray_images_per_second"] > 0
    assert r["ray_reported_steps"][0] == 1 and r["ray_reported_steps"][-1] == 20
    assert 0 <= r["ray_loss_max_relative_difference"] <= SPLIT_LOSS_REL
    assert (
        r["ray_startup_seconds"]["ray_init_seconds"] > 0
        and r["ray_startup_seconds"]["workers_started_seconds"] > 0
    )
    assert "-m helpers.launching.ray_train --nproc_per_node 2 --num_nodes 1 " in r["ray_command"]
    assert "--ray_address" not in r["ray_command"]
    assert (notebook_run_dir / "outputs" / "pip-toyworld-mpirun-ray" / "learned_embeds.safetensors").is_file()
    # the dry run for notebook 01's planned 3-node cluster (Standard_D8_v5: 4 cores, 2 ranks each)
    (mpirun,), torchrun = r["example_commands"]["mpirun"], r["example_commands"]["torchrun"]
    assert " -f cluster/hostfile -n 6 -ppn 2 " in mpirun and "-genv MASTER_ADDR 10.42.1.4" in mpirun
    assert "-genv OMP_NUM_THREADS 2" in mpirun
    assert ("-genv FI_PROVIDER tcp" in mpirun) == (AUTO == "ccl")  # 3 nodes: libfabric's tcp between them
    assert [c.split("--node_rank ")[1].split()[0] for c in torchrun] == ["0", "1", "2"]
    assert all("--nnodes 3 " in c and "--master_addr 10.42.1.4 " in c for c in torchrun)


@pytest.mark.notebooks
def test_notebook_05_records(notebook_records):
    records = notebook_records("05_openvino_inference")
    assert Path(records["trained_output_dir"]).name == "pip-toyworld-mpirun"  # the cluster-trained word (04)
    seconds = records["seconds_per_image"]
    native_bf16 = records["openvino_default_precision"] == "bf16"
    assert records["openvino_default_precision"] == inference.openvino_default_precision()
    always = {*inference.VARIANTS, inference.QUANT_VARIANT}
    assert set(seconds) == always | ({inference.BF16_VARIANT} if native_bf16 else set())
    if native_bf16:  # bf16 drifts (measured ~30-36 dB) but still draws the same picture
        assert records["image_psnr_bf16_vs_pt"] > 25
    else:  # recorded on every CPU, so the record's name is always there
        assert records["image_psnr_bf16_vs_pt"] is None
    assert all(v > 0 for v in seconds.values())
    assert records["text_encoder_max_abs_diff"] < inference.TEXT_ENCODER_ATOL
    assert records["image_psnr_ov_vs_pt"] > inference.IMAGE_PSNR_MIN_DB
    assert records["image_psnr_static_vs_pt"] > inference.IMAGE_PSNR_MIN_DB
    assert math.isfinite(records["image_psnr_int8_vs_pt"])
    assert records["calibration"]["samples"] == 20 and records["calibration"]["resolution"] == 64
    assert 15 < records["image_psnr_quant_int8_vs_pt"] < inference.PSNR_IDENTICAL_DB
    assert set(records["export_seconds"]) == {"fp32", "int8"} and all(records["export_seconds"].values())
    assert records["model_megabytes"]["int8"] < records["model_megabytes"]["fp32"]
    expected = {f"{variant}-{i:02d}.png" for variant in seconds for i in range(records["num_images"])}
    assert sorted(Path(p).name for p in records["saved_images"]) == sorted(expected)
    assert all(Path(p).is_file() for p in records["saved_images"])
    scores = records["concept_score"]  # the judge's Pip score of every variant's pictures
    # 04's word drawn by PyTorch: 0.47 where 04 trained in fp32 (an AVX-512 Xeon without bf16; the
    # score depends on the CPU, as notebook 02's), far above the untrained word's 0.2 at most
    assert set(scores) == set(seconds) and scores["pytorch_fp32"] >= 0.4
    assert all(abs(score - scores["pytorch_fp32"]) <= 0.1 for score in scores.values()), scores


@pytest.mark.notebooks
def test_notebook_06_records(notebook_records, notebook_run_dir):
    """DreamBooth-LoRA on the toy world, beside notebook 02's Textual Inversion of the same Pip.

    Measured (8 pictures, fixed seeds, instance prompt "a photo of sks", 240 steps of 5 pictures at
    7e-3 on an AVX-512 Xeon): Pip score 0.003 before, 0.84 after (500 steps of 4 at 5e-3: 0.64 there,
    0.77 on an earlier machine); the class prompt's pictures 8 of 8 not Pip before and after; OpenVINO parity 1e-6
    and 89 dB. (With "a photo of sks toy" the toy world learns one compromise for both prompts:
    0.37 and 5 of 8; the notebook explains why.)
    """
    from safetensors.torch import load_file

    r = notebook_records("06_dreambooth_lora")
    [curve] = live_curve(notebook_run_dir / "06_dreambooth_lora.ipynb")
    assert re.fullmatch(r"loss after step 240 of 240: \d\.\d{4}", curve), curve
    assert r["concept_score_before"] <= 0.2  # "sks" means nothing to the base model
    assert r["concept_score_after"] >= 0.6  # after training it draws Pip
    assert r["class_share_before"] >= 0.75 and r["class_share_after"] >= 0.75  # "a toy" is still not Pip
    s = r["summary"]
    made = s["class_images"]  # drawn by the base model (or reused from an earlier run in the folder)
    assert s["steps"] == 240 and s["with_prior_preservation"] and made["existing"] + made["generated"] == 20
    lora_file = Path(r["lora_weights_path"])
    assert lora_file.is_relative_to(notebook_run_dir) and lora_file.stat().st_size == s["lora_weights_bytes"]
    assert {k.split(".")[0] for k in load_file(lora_file)} == {"unet", "text_encoder"}
    assert (Path(r["pipeline_dir"]) / "model_index.json").is_file()
    ti, db = r["comparison"]
    assert (ti["method"], db["method"]) == ("Textual Inversion", "DreamBooth-LoRA")
    assert ti["result bytes"] < 1_000 < db["result bytes"] == s["lora_weights_bytes"]
    assert db["concept score"] == r["concept_score_after"] and ti["concept score"] >= 0.6  # as notebook 02
    assert ti["class pictures not the subject"] == r["class_share_before"]  # TI leaves the model as it was
    parity = r["openvino_parity"]
    assert parity["text_encoder_max_abs_diff"] < 1e-4 and parity["image_psnr"] > 40
    assert r["openvino_concept_score"] >= 0.6


@pytest.mark.notebooks
def test_notebook_07_records(notebook_records, notebook_run_dir):
    """Both methods on toyworld-xl, the toy world's SDXL twin, as notebooks 02 and 06 run them.

    Measured (8 pictures, fixed seeds, fp32): Textual Inversion with two vectors per encoder (100
    steps of 8 pictures) 0.0008 before, 0.99 after; DreamBooth-LoRA ("a photo of sks", 300 steps) 0.001 before, 0.84 after, the
    class prompt's pictures 8 of 8 not Pip before and after. OpenVINO with the word in both
    encoders: encoder outputs within 7e-7 of PyTorch's, images at 86 dB PSNR (int8 weights: 46 dB),
    Pip 0.99.
    """
    import torch
    from safetensors.torch import load_file

    from helpers.dreambooth import lora
    from helpers.training import models

    r = notebook_records("07_sdxl")
    executed = notebook_run_dir / "07_sdxl.ipynb"
    assert [live_curve(executed, i)[-1].split(":")[0] for i in (0, 1)] == [
        "loss after step 100 of 100",
        "loss after step 300 of 300",
    ]
    # what the real SDXL base 1.0 weighs, counted on the meta device (its published UNet size)
    assert r["sdxl_parameters"]["unet"] == 2_567_463_684 and r["sdxl_parameters"]["total"] > 3.4e9
    # one process's peak, as helpers.launch warns with it: measured at 512 px, scaled to 1024 px
    # (bf16 measured at 512 px; fp32 at 256 px, 12.6 GiB of weights and 2.1 above them, x4 and x16)
    memory = {(row["precision"], row["resolution"]): row for row in r["sdxl_memory"]}
    keys = [("bf16", 512), ("bf16", 1024), ("fp32", 512), ("fp32", 1024)]
    assert [memory[k]["GiB per process"] for k in keys] == [14.6, 35.0, 21.2, 47.0]
    assert [memory[k]["processes per Standard_D8_v5"] for k in keys] == [2, 0, 1, 0]  # 32 GiB
    assert [memory[k]["processes per Standard_E32_v5"] for k in keys] == [17, 7, 11, 5]  # 256 GiB
    # the guide's 3,200 pictures on 4 nodes: v5 sizes in fp32 (hosts without bf16), the v6 in bf16
    cost = {(row["VM size"], row["px"]): row for row in r["sdxl_cost"]}
    assert cost["Standard_D8_v5", 1024] == {"VM size": "Standard_D8_v5", "px": 1024, "precision": "fp32",
                                            "processes per node": 0, "hours": None, "USD (VMs, training only)": None}  # fmt: skip
    # E32: 4 processes (11 fit) of 4 cores; 200 steps of 9.06 s x4 pixels x 2/4 cores = 18.1 s: 1.0 h
    # of 4 nodes at 32 x $0.063 an hour
    e32 = cost["Standard_E32_v5", 512]
    assert (e32["precision"], e32["processes per node"], e32["hours"]) == ("fp32", 4, 1.0)
    assert e32["USD (VMs, training only)"] == pytest.approx(200 * 9.06 * 2 / 3600 * 4 * 32 * 0.063, abs=0.01)
    v6 = cost["Standard_E32s_v6", 1024]
    assert (v6["precision"], v6["USD (VMs, training only)"]) == ("bf16", None)  # AMX; no price in the table
    embeds = [load_file(p) for p in r["learned_embeds_paths"]]
    assert [Path(p).name for p in r["learned_embeds_paths"]] == [
        "learned_embeds.safetensors",
        "learned_embeds_2.safetensors",
    ]
    assert [list(e) for e in embeds] == [["<pip>"], ["<pip>"]] and [e["<pip>"].shape[0] for e in embeds] == [
        2,
        2,
    ]
    assert r["ti_concept_score_before"] <= 0.2 and r["ti_concept_score_after"] >= 0.7
    assert r["lora_concept_score_before"] <= 0.2 and r["lora_concept_score_after"] >= 0.6
    assert r["class_share_before"] >= 0.75 and r["class_share_after"] >= 0.75
    assert (r["ti_summary"]["steps"], r["lora_summary"]["steps"]) == (100, 300)
    lora_groups = {"unet", "text_encoder", "text_encoder_2"}
    assert {k.split(".")[0] for k in load_file(r["lora_weights_path"])} == lora_groups
    ti, db = r["comparison"]
    assert (ti["concept score"], db["concept score"]) == (
        r["ti_concept_score_after"],
        r["lora_concept_score_after"],
    )
    # OpenVINO: the word inserted in both encoders (two rows each), each giving PyTorch's output.
    # toyworld-xl stores its UNet in fp16, as Hub SDXL checkpoints do: left to itself, optimum traces
    # such a pipeline in fp16, text encoders included, whose token tables then sit behind a 16-bit
    # embedding op that learned rows cannot go into; the export loads it in fp32.
    unet = models.resolve_model("toyworld-xl") / "unet" / "diffusion_pytorch_model.safetensors"
    assert load_file(unet)["conv_in.weight"].dtype == torch.float16
    assert r["openvino_inserted_tokens"] == ["<pip>", "<pip>_1"]
    assert (
        len(r["openvino_encoder_diffs"]) == 2
        and max(r["openvino_encoder_diffs"]) < inference.TEXT_ENCODER_ATOL
    )
    assert r["openvino_image_psnr"] > inference.IMAGE_PSNR_MIN_DB and r["openvino_int8_image_psnr"] > 30
    assert r["openvino_concept_score"] >= 0.7
    # both methods again on 2 processes (helpers.launch, mpirun), each with half the batch: the same
    # pictures per step, so the loss of every step is the single process's to rounding (measured
    # 2.6e-7 and 1.5e-7 on an AVX512 Xeon; an AVX2-only CPU rounds about 1e-4 in a few steps)
    assert set(r["launched"]) == {"Textual Inversion", "DreamBooth-LoRA"}
    for launched in r["launched"].values():
        assert (launched["processes"], launched["steps"], launched["backend"]) == (2, 10, AUTO)
        assert launched["largest loss difference"] < 1e-3
    # what the all-reduce carried: the new rows of both encoders; the LoRA of the UNet and both encoders
    profile = notebooks.tiny_profile("07_sdxl")  # section 3 writes each run beside its one-process run
    ti_run, lora_run = (
        notebook_run_dir / f"{profile[name]}-2proc" for name in ("ti_output_dir", "lora_output_dir")
    )
    ti_s, lora_s = (json.loads((run / "run_summary.json").read_text()) for run in (ti_run, lora_run))
    rows = sum(
        load_file(ti_run / name)["<pip>"].numel()
        for name in ("learned_embeds.safetensors", "learned_embeds_2.safetensors")
    )
    assert ti_s["embeddings_identical_across_ranks"] is True and ti_s["allreduce_bytes_per_step"] == rows * 4
    assert lora_s["lora_identical_across_ranks"] is True
    assert lora_s["allreduce_bytes_per_step"] == lora_s["trainable_parameters"] * 4
    assert {k.split(".")[0] for k in load_file(lora_run / lora.LORA_WEIGHTS)} == lora_groups


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executed_handout_is_offline_and_quiet(path: Path, notebook_records, notebook_run_dir):
    notebook_records(path.stem)  # runs the notebooks up to this one
    text = quiet_offline_handout(notebook_run_dir / path.name)
    # bare floats with 10+ digits ending a cell are for machines, not people
    assert re.findall(r"\b\d+\.\d{10,}\b", text) == []


def test_records_round_trip_through_an_executed_notebook(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(
        cells=[
            new_code_cell(
                "from helpers.workshop.notebooks import record\nrecord('x', {'a': [1, 2.5]})\nrecord('x', 3)\nrecord('y', 'ok')"
            )
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    src = tmp_path / "t.ipynb"
    nbformat.write(nb, src)
    assert notebooks.run_notebook(src, tmp_path / "out.ipynb") == {"x": 3, "y": "ok"}


def test_failing_cell_names_the_cell_and_keeps_no_output(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(
        cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('bad input: x')")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    src = tmp_path / "t.ipynb"
    nbformat.write(nb, src)
    with pytest.raises(notebooks.NotebookError, match=r"t.ipynb: cell 1 raised ValueError: bad input: x"):
        notebooks.run_notebook(src, tmp_path / "out.ipynb")
    assert not (tmp_path / "out.ipynb").exists() and (tmp_path / "out.failed.ipynb").exists()


def _ends_with_a_record_call(source: str) -> bool:
    body = ast.parse(source).body
    last = body[-1] if body else None
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)):
        return False
    func = last.value.func
    return getattr(func, "attr", getattr(func, "id", None)) == "record"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_ends_with_a_bare_record_call(path: Path):
    """record() returns its value, so a cell ending with one shows a stray ``Out[..]`` in JupyterLab
    and in the handout: such a cell ends with record_all() (which returns None) instead."""
    nb = json.loads(path.read_text())
    cells = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    assert [i for i in cells if _ends_with_a_record_call("".join(nb["cells"][i]["source"]))] == []


def test_record_all_records_each_value_and_returns_none(caplog):
    caplog.set_level("INFO", logger="helpers.workshop.notebooks")
    assert notebooks.record_all({"loss": 0.25, "steps": [1, 2]}) is None
    assert [r.getMessage() for r in caplog.records] == ["recorded loss = 0.25", "recorded steps = [1, 2]"]


def test_memory_box_names_the_need_the_fit_and_the_result_file():
    from helpers.cluster import estimates

    text = notebooks.memory_box(512, "no", "Standard_D8_v5")
    # at 512 px the engine does not lay the weights out once by default: the unpacked peak
    need = estimates.memory_per_process(512, "no", prepack=False) / 2**30
    fit = estimates.processes_that_fit("Standard_D8_v5", 512, "no", prepack=False)
    assert need < estimates.memory_per_process(512, "no") / 2**30
    assert text.startswith(
        f"> **Memory.** One training process needs about {need:.1f} GiB at 512 px in fp32; "
    )
    assert f"a Standard_D8_v5 node fits {fit} such process" in text
    assert "bench/results/xeon-avx512/train_memory-sd15-shape-512px.json" in text  # the figure's home, named

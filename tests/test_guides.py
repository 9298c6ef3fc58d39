"""The original guides' command lines and code, run as printed.

The lines below are those of the guides this workshop follows (Intel's textual-inversion module
and the Hugging Face blog on fine-tuning Stable Diffusion on Intel CPUs). Only what cannot run
here is swapped, each swap listed and checked to apply exactly once so nothing else drifts: the
program path (diffusers' script -> ``helpers/train.py``), the model (the Hub -> the offline toy
world), the images (the bundled Pip pictures), 512 px -> 64 px, 200 steps -> 4, the process
counts, and bf16 -> fp32 on a CPU without native bf16 (where bf16 is 100x slower). The
OpenVINO snippet keeps the blog's calls (``from_pretrained(output_dir, export=True)``,
``reshape(batch_size=..., height, width, num_images_per_prompt=...)``, ``compile()``, generate);
its prompt and step count are the workshop's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.core import cpu
from helpers.core.outputs import SUMMARY
from helpers.launching import accelerate_config
from helpers.launching.layout import ClusterLayout
from helpers.training import data, models

ROOT = Path(__file__).resolve().parent.parent
TRAIN_FLAGS = r"""--pretrained_model_name_or_path=$MODEL_NAME --train_data_dir=$DATA_DIR \
  --learnable_property="object" --placeholder_token="<dicoo>" --initializer_token="toy" \
  --resolution=512 --train_batch_size=1 --seed=7 --gradient_accumulation_steps=1 \
  --max_train_steps=200 --learning_rate=2.0e-03 --scale_lr --lr_scheduler="constant" \
  --lr_warmup_steps=0 --output_dir=./textual_inversion_output --mixed_precision bf16 \
  --save_as_full_pipeline"""
EXPORTS = 'export MODEL_NAME="runwayml/stable-diffusion-v1-5"\nexport DATA_DIR="./dicoo"\n'
SINGLE_NODE = EXPORTS + "python textual_inversion.py \\\n  " + TRAIN_FLAGS
ACCELERATE = EXPORTS + "accelerate launch textual_inversion.py \\\n  " + TRAIN_FLAGS
MPIRUN = (
    EXPORTS + "mpirun -f nodefile -n 16 -ppn 4 \\\n"
    "  accelerate launch diffusers/examples/textual_inversion/textual_inversion.py \\\n  " + TRAIN_FLAGS
)
OPENVINO = """
from optimum.intel.openvino import OVStableDiffusionPipeline

model_id = "./textual_inversion_output"
ov_pipe = OVStableDiffusionPipeline.from_pretrained(model_id, export=True)
ov_pipe.reshape(batch_size=1, height=512, width=512, num_images_per_prompt=1)
ov_pipe.compile()
prompt = "a photo of <dicoo>"
image = ov_pipe(prompt, num_inference_steps=20).images[0]
"""


def adapt(text: str, swaps: dict[str, str]) -> str:
    """Apply each swap exactly once (a guide line that changed would fail here, not drift)."""
    for old, new in swaps.items():
        assert text.count(old) == 1, f"{old!r} appears {text.count(old)} times"
        text = text.replace(old, new)
    return text


def _swaps(program: str) -> dict[str, str]:
    precision = cpu.choose_precision("auto").mixed_precision
    return {
        '"runwayml/stable-diffusion-v1-5"': str(models.resolve_model("toyworld")),
        '"./dicoo"': str(data.sample_concept_dir()),
        program: str(ROOT / "helpers" / "train.py"),
        "--resolution=512": "--resolution=64",
        "--max_train_steps=200": "--max_train_steps=4",
        "--mixed_precision bf16": f"--mixed_precision {precision}",
    }


def _bash(script: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> None:
    venv_bin = str(Path(sys.executable).parent)
    full_env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", **(env or {})}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _check_output(out: Path, world_size: int = 1) -> None:
    from diffusers import StableDiffusionPipeline

    summary = json.loads((out / SUMMARY).read_text())
    assert (summary["world_size"], summary["steps"]) == (world_size, 4)
    assert (out / "learned_embeds.safetensors").is_file() and (out / "model_index.json").is_file()
    pipe = StableDiffusionPipeline.from_pretrained(out, safety_checker=None)  # as the guides load it
    assert "<dicoo>" in pipe.tokenizer.get_vocab()


@pytest.fixture(scope="module")
def single_node_output(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("guide-single")
    _bash(adapt(SINGLE_NODE, _swaps("textual_inversion.py")), cwd)
    return cwd / "textual_inversion_output"


@pytest.mark.slow
def test_single_node_line_of_the_guide_trains_and_writes_the_pipeline_into_output_dir(single_node_output):
    _check_output(single_node_output)


@pytest.mark.slow
def test_accelerate_launch_line_of_the_guide(tmp_path):
    _bash(adapt(ACCELERATE, _swaps("textual_inversion.py")), tmp_path, {"HF_HOME": str(tmp_path / "hf")})
    _check_output(tmp_path / "textual_inversion_output")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_mpirun_accelerate_launch_line_of_the_guide(tmp_path):
    """The guides run `accelerate config` on every node first; here notebook 03's code writes it."""
    layout = ClusterLayout.local(nproc_per_node=2, main_process_port=0)
    (config,) = accelerate_config.write_accelerate_configs(layout, tmp_path / "configs", "auto")
    (tmp_path / "hf" / "accelerate").mkdir(parents=True)
    shutil.copy(config, tmp_path / "hf" / "accelerate" / "default_config.yaml")
    (tmp_path / "nodefile").write_text("localhost\n")
    swaps = _swaps("diffusers/examples/textual_inversion/textual_inversion.py") | {
        "-n 16 -ppn 4": "-n 2 -ppn 2"
    }
    _bash(adapt(MPIRUN, swaps), tmp_path, {"HF_HOME": str(tmp_path / "hf")})
    _check_output(tmp_path / "textual_inversion_output", world_size=2)


@pytest.mark.slow
def test_openvino_snippet_of_the_blog_loads_the_output_dir(single_node_output, tmp_path):
    snippet = adapt(OPENVINO, {
        '"./textual_inversion_output"': repr(str(single_node_output)),
        "height=512, width=512": "height=64, width=64",
    })  # fmt: skip
    scope: dict = {}
    exec(compile(snippet, "hf-blog-openvino", "exec"), scope)  # noqa: S102 - the guide's code, as printed
    assert scope["image"].size == (64, 64)
    assert "<dicoo>" in scope["ov_pipe"].tokenizer.get_vocab()  # the exported pipeline knows the word

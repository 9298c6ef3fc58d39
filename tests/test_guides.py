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
import re
import shlex
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
from helpers.workshop import notebooks

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


# --- The lines this workshop itself tells a person to type: the README and the notebooks ----------
#
# Every command of the README's ```bash blocks and every Python call the README's or a notebook's text
# gives in `code` (``pipe.…(…)``, ``…Pipeline.from_pretrained(…)``) is found by the extractors below and must
# be in one of the tables: run (as printed, or with the listed swaps, for a small run) in the
# workshop's offline environment, or not run here with the reason. A new line in the README or a
# notebook fails test_every_documented_line_is_run_or_excused until it is classified.

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
_CALL_TO_TYPE = re.compile(r"^(?:pipe\.\w+|\w+Pipeline\.from_pretrained)\(.*\)$")

NOT_RUN = {
    "make demo": (
        "runs every notebook offline with papermill: tests/workshop/test_notebooks.py runs the same notebooks "
        "in JupyterLab, tests/workshop/test_handouts.py one with papermill into its handout"
    ),
    "make test": "the test suite itself",
    "make lab": (
        "starts JupyterLab, a server that runs until stopped: tests/workshop/test_jupyter.py checks how it "
        "prepares the notebooks and decides offline, tests/workshop/test_notebooks.py runs them in JupyterLab"
    ),
    ".venv/bin/tensorboard --logdir out/logs": (
        "starts TensorBoard, a server that runs until stopped: tests/training/test_tracking.py reads the "
        "event files under <output_dir>/logs back with TensorBoard's own reader"
    ),
    ".venv-ipex/bin/python -m helpers.train --use_ipex <the same flags>": (
        "a template, in the second environment: tests/test_ipex.py runs the IPEX path"
    ),
    ".venv/bin/python -m helpers.toyworld build --output_dir DIR": (
        "trains the toy world from scratch (hours on 2 cores): tests/toyworld/test_toyworld.py builds a small one"
    ),
    ".venv/bin/python -m helpers.azure {plan,apply,teardown,ssh-config} --config cluster.yaml": (
        "notation for four subcommands that need an Azure subscription: tests/cluster/test_azure.py checks them"
    ),
}
# Small runs of the README's lines: fewer steps, pictures and pixels; nothing else changes.
SWAPS = {
    "--output_dir lora": "--output_dir lora --resolution 64 --max_train_steps 2 --num_class_images 2 "
    "--class_num_inference_steps 2",
    "--quant_mode int8": "--quant_mode int8 --num_samples 2 --resolution 64",
    "--static --output_dir images": "--static --output_dir images --resolution 64 --num_inference_steps 2",
    '--openvino_dir out-ov --prompt "a photo of <dicoo>"': (
        '--openvino_dir out-ov --prompt "a photo of <dicoo>" --resolution 64 --num_inference_steps 2'
    ),
}
# What `make demo` leaves in build/ that a README line reads, made here by a short run of notebook 02's training.
DEMO_OUTPUT = (
    "python -m helpers.train --pretrained_model_name_or_path toyworld --train_data_dir {sample} "
    "--placeholder_token '<pip>' --initializer_token toy --resolution 64 --max_train_steps 2 "
    "--output_dir build/outputs/pip-toyworld --save_as_full_pipeline"
)
# Each call of the notebooks' and the README's text with what it needs first (in its own namespace,
# offline) and what it must do; the README's calls name the folders its commands wrote ({cwd}).
NOTEBOOK_CALLS = {
    "pipe.load_textual_inversion(path)": (
        "from diffusers import StableDiffusionPipeline\n"
        "pipe = StableDiffusionPipeline.from_pretrained({toyworld!r})\n"
        "path = {ti_output!r} + '/learned_embeds.safetensors'\n",
        "assert '<pip>' in pipe.tokenizer.get_vocab()",
    ),
    "StableDiffusionPipeline.from_pretrained(output_dir)": (
        "from diffusers import StableDiffusionPipeline\noutput_dir = {ti_output!r}\n",
        "assert '<pip>' in _.tokenizer.get_vocab()",
    ),
    'pipe.load_lora_weights(output_dir, weight_name="pytorch_lora_weights.safetensors")': (
        "from diffusers import StableDiffusionPipeline\n"
        "pipe = StableDiffusionPipeline.from_pretrained({toyworld!r})\noutput_dir = {lora_output!r}\n",
        "assert pipe.get_active_adapters(), 'no LoRA adapter loaded'",
    ),
    'StableDiffusionPipeline.from_pretrained("out")': (
        "import os\nfrom diffusers import StableDiffusionPipeline\nos.chdir({cwd!r})\n",
        "assert '<dicoo>' in _.tokenizer.get_vocab()",
    ),
    'pipe.load_lora_weights("lora", weight_name="pytorch_lora_weights.safetensors")': (
        "import os\nfrom diffusers import StableDiffusionPipeline\n"
        "pipe = StableDiffusionPipeline.from_pretrained({toyworld!r})\nos.chdir({cwd!r})\n",
        "assert pipe.get_active_adapters(), 'no LoRA adapter loaded'",
    ),
}


def readme_commands(text: str) -> list[str]:
    """Each command of the ```bash blocks: continuations joined, comment lines and trailing comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def notebook_calls() -> dict[str, list[str]]:
    """The Python calls the notebooks' markdown and the README's prose give in inline code, with where each is."""
    texts = [
        (path.stem, "".join(cell["source"]))
        for path in notebooks.notebook_paths()
        for cell in json.loads(path.read_text())["cells"]
        if cell["cell_type"] == "markdown"
    ]
    texts.append(("README", re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)))
    found: dict[str, list[str]] = {}
    for where, text in texts:
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
            if _CALL_TO_TYPE.match(span):
                found.setdefault(span, []).append(where)
    return found


def test_every_documented_line_is_run_or_excused():
    readme = readme_commands((ROOT / "README.md").read_text())
    assert len(readme) >= 8  # the extractor finds the README's commands
    assert [line for line in readme if line not in NOT_RUN and not line.startswith(".venv/bin/python ")] == []
    assert sorted(set(NOT_RUN) - set(readme)) == []  # no excuse for a line that is gone
    assert [old for old in SWAPS if sum(old in line for line in readme) != 1] == []
    assert sorted(notebook_calls()) == sorted(NOTEBOOK_CALLS)


def test_the_extractors_read_continuations_comments_and_inline_code():
    text = "```bash\nmake x   # why\n# a comment\n.venv/bin/python -m a \\\n  --b c\n```\n```\nnot bash\n```"
    assert readme_commands(text) == ["make x", ".venv/bin/python -m a --b c"]
    assert _CALL_TO_TYPE.match("pipe.load_lora_weights(output_dir)")
    assert not _CALL_TO_TYPE.match("python -m helpers.train") and not _CALL_TO_TYPE.match("config.to_args")


@pytest.fixture(scope="module")
def documented_run(tmp_path_factory) -> dict[str, Path]:
    """Every README line that runs here, in its order, in one folder (later lines use earlier outputs),
    offline; `.venv/bin/python` is this interpreter, `helpers/assets` the package's."""
    cwd = tmp_path_factory.mktemp("readme")
    (cwd / "helpers").mkdir()
    (cwd / "helpers" / "assets").symlink_to(ROOT / "helpers" / "assets")
    _bash(DEMO_OUTPUT.format(sample=data.sample_concept_dir()), cwd, OFFLINE)
    for line in readme_commands((ROOT / "README.md").read_text()):
        if line in NOT_RUN:
            continue
        for old, new in SWAPS.items():
            line = line.replace(old, new)
        _bash(line.replace(".venv/bin/python", shlex.quote(sys.executable), 1), cwd, OFFLINE, timeout=900)
    return {"cwd": cwd, "ti_output": cwd / "build" / "outputs" / "pip-toyworld", "lora_output": cwd / "lora"}


@pytest.mark.slow
def test_readme_lines_run_offline(documented_run):
    cwd = documented_run["cwd"]
    assert (cwd / "out" / "learned_embeds.safetensors").is_file() and (
        cwd / "out-ov" / "model_index.json"
    ).is_file()
    assert (cwd / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert list((cwd / "images").glob("*.png"))


# Runs each call (its set-up, the call, its check) in its own namespace and folder, in one offline
# interpreter (one start of torch and diffusers for all of them), and prints {call: traceback or None}.
_CALLS_RUNNER = """
import json, os, sys, traceback
results, start = {}, os.getcwd()
for call, script in json.loads(sys.argv[1]).items():
    try:
        exec(script, {"__name__": "__main__"})
        results[call] = None
    except BaseException:
        results[call] = traceback.format_exc()[-2000:]
    os.chdir(start)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def notebook_call_errors(documented_run) -> dict[str, str | None]:
    values = {k: str(v) for k, v in documented_run.items()} | {
        "toyworld": str(models.resolve_model("toyworld"))
    }
    scripts = {
        call: setup.format(**values) + f"_ = {call}\n" + check + "\n"
        for call, (setup, check) in NOTEBOOK_CALLS.items()
    }
    done = subprocess.run([sys.executable, "-c", _CALLS_RUNNER, json.dumps(scripts)], env={**os.environ, **OFFLINE},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(NOTEBOOK_CALLS))
def test_notebook_calls_run_offline(call, notebook_call_errors):
    assert notebook_call_errors[call] is None, f"{call} fails offline:\n{notebook_call_errors[call]}"

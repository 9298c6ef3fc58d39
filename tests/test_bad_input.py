"""Every bad input a person can give a ``python -m helpers.*`` command: one ``error:`` line, exit code 2,
nothing written, no model loaded.

One table (``CASES``): the command, its arguments (``{tmp}`` is a scratch folder, which is also the
working directory), the files to create first, and a piece of the one error line. Each case runs
the command in-process through its ``cli`` (``helpers.launch``: ``main``) with the model loaders
replaced by a function that fails the test, and checks that nothing in the scratch folder changed.
A few cases also run as real subprocesses, where the exit code is the operating system's.

The cases cover issue 13's "raw tracebacks" and "Azure spec" lists (the ones independent of the
training engine; non-finite training and resuming past the end are tested with the engine), the
file problems of every command (missing, a folder, unreadable, not text, corrupt, empty, a file
where a folder is needed) and issue 14's concept folders.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from helpers.ranks import oneccl
from helpers.training import data

SAMPLE = str(data.sample_concept_dir())
CIDR = "203.0.113.7/32"
TRAIN = ["--train_data_dir", SAMPLE, "--output_dir", "{tmp}/out"]  # a good base for one bad setting
INFER = ["generate", "--model", "toyworld", "--prompt", "a <pip>", "--output_dir", "{tmp}/out"]
DREAM = ["--pretrained_model_name_or_path", "tiny", "--instance_data_dir", SAMPLE, "--instance_prompt",
         "a photo of sks toy", "--resolution", "64", "--output_dir", "{tmp}/out"]  # fmt: skip
SCORE = ["score", "--prompt", "a photo of <pip>", "--output_dir", "{tmp}/scores"]
LAUNCH = ["--launcher", "torchrun", "--dry_run"]
# An interrupted DreamBooth run of DREAM's settings with a complete checkpoint-8 (is_complete looks
# for accelerate's random_states_0.pkl; nothing is loaded before the checks refuse).
DREAM_RUN = (
    "pretrained_model_name_or_path: tiny\nseed: 0\nrank: 4\ntrain_text_encoder: false\nmax_train_steps: 8\n"
)
DREAM_CKPT = {"out/dreambooth_config.yaml": DREAM_RUN, "out/checkpoints/checkpoint-8/dreambooth_config.yaml": DREAM_RUN,
              "out/checkpoints/checkpoint-8/random_states_0.pkl": b"x"}  # fmt: skip


def png(size: tuple[int, int] = (64, 64)) -> bytes:
    import io

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "x.safetensors"
        save_file(tensors, str(path))
        return path.read_bytes()


@dataclass
class Case:
    """One bad input. ``files`` maps a path under ``{tmp}`` to its content (None: an empty folder);
    ``unreadable`` names one of them that this user cannot read; ``unwritable`` one folder it
    cannot write (both simulated when the tests run as root, who is never refused).
    ``ccl_not_built``: as where ``make setup`` did not build the ccl extension (its build folder
    an empty one, nothing loaded yet). ``links`` maps a path under ``{tmp}`` to what the symbolic
    link planted there points at (also under ``{tmp}``)."""

    id: str
    cli: str
    argv: list[str]
    error: str
    files: dict[str, str | bytes | None] = field(default_factory=dict)
    unreadable: str | None = None
    unwritable: str | None = None
    ccl_not_built: bool = False
    links: dict[str, str] = field(default_factory=dict)


PRECIOUS = {"victim.txt": "precious", "out": None}  # a file a planted link points at, and the run's folder
CASES = [
    # --- helpers.train: issue 13's raw tracebacks ---------------------------------------------------
    Case("output_dir is a file", "train", ["--train_data_dir", SAMPLE, "--output_dir", "{tmp}/out"],
         "output_dir='{tmp}/out' is a file: it must be a folder", files={"out": "a file"}),
    Case("output_dir under a file", "train", ["--train_data_dir", SAMPLE, "--output_dir", "{tmp}/notes.txt/run"],
         "output_dir='{tmp}/notes.txt/run' lies under {tmp}/notes.txt, which is a file", files={"notes.txt": "x"}),
    Case("read-only output folder", "train", ["--train_data_dir", SAMPLE, "--output_dir", "{tmp}/ro/run"],
         "output_dir='{tmp}/ro/run': {tmp}/ro is not writable by this user", files={"ro": None}, unwritable="ro"),
    Case("empty checkpoint folder", "train", [*TRAIN, "--resume_from_checkpoint", "{tmp}/out/checkpoints/checkpoint-10"],
         "resume_from_checkpoint='{tmp}/out/checkpoints/checkpoint-10' is an empty folder",
         files={"out/checkpoints/checkpoint-10": None}),
    Case("resume from a file", "train", [*TRAIN, "--resume_from_checkpoint", "{tmp}/ckpt.bin"],
         "resume_from_checkpoint='{tmp}/ckpt.bin' is a file", files={"ckpt.bin": "x"}),
    Case("YAML learning_rate not a number", "train", ["--config", "{tmp}/run.yaml"],
         "{tmp}/run.yaml: invalid training setting: learning_rate='5e-4x': expected a number",
         files={"run.yaml": f"train_data_dir: {SAMPLE}\noutput_dir: out\nlearning_rate: 5e-4x\n"}),
    Case("YAML resolution not a multiple of 8", "train", ["--config", "{tmp}/run.yaml"],
         "{tmp}/run.yaml: invalid training setting: resolution='63': must be a multiple of 8",
         files={"run.yaml": 'output_dir: out\nresolution: "63"\n'}),
    Case("YAML syntax error", "train", ["--config", "{tmp}/run.yaml"],
         "config file {tmp}/run.yaml, line 3, column 1: YAML syntax error: while parsing a flow sequence",
         files={"run.yaml": "output_dir: out\nlearning_rate: [5e-4\n"}),
    Case("YAML tab indentation", "train", ["--config", "{tmp}/run.yaml"],
         "config file {tmp}/run.yaml, line 2, column 1: YAML syntax error",
         files={"run.yaml": "output_dir: out\n\tresolution: 64\n"}),
    Case("YAML list instead of mapping", "train", ["--config", "{tmp}/run.yaml"],
         "expected a mapping of setting: value", files={"run.yaml": "- resolution: 64\n"}),
    Case("YAML unknown setting", "train", ["--config", "{tmp}/run.yaml"],
         "{tmp}/run.yaml: unknown setting(s) learning_rat", files={"run.yaml": "learning_rat: 1.0e-3\n"}),
    Case("config is a folder", "train", ["--config", "{tmp}/configs"],
         "config file {tmp}/configs is a folder", files={"configs": None}),
    Case("config missing", "train", ["--config", "{tmp}/nope.yaml"], "config file {tmp}/nope.yaml does not exist"),
    Case("config not text", "train", ["--config", "{tmp}/run.yaml"],
         "config file {tmp}/run.yaml is not a text file", files={"run.yaml": b"\xff\xfe\x00\x01binary"}),
    Case("config unreadable", "train", ["--config", "{tmp}/run.yaml"],
         "config file {tmp}/run.yaml cannot be read (permission denied)", files={"run.yaml": "resolution: 64\n"},
         unreadable="run.yaml"),
    Case("adam_beta1 1.5", "train", [*TRAIN, "--adam_beta1", "1.5"],
         "adam_beta1='1.5': must be at least 0 and less than 1"),
    Case("adam_beta2 1", "train", [*TRAIN, "--adam_beta2", "1"], "adam_beta2='1': must be at least 0 and less than 1"),
    Case("adam_epsilon 0", "train", [*TRAIN, "--adam_epsilon", "0"], "adam_epsilon='0': must be greater than 0"),
    Case("adam_weight_decay negative", "train", [*TRAIN, "--adam_weight_decay", "-0.1"],
         "adam_weight_decay='-0.1': must be at least 0"),
    Case("learning_rate inf", "train", [*TRAIN, "--learning_rate", "inf"], "learning_rate='inf': must be a finite number"),
    Case("learning_rate nan", "train", [*TRAIN, "--learning_rate", "nan"], "learning_rate='nan': must be a finite number"),
    Case("learning_rate 0", "train", [*TRAIN, "--learning_rate", "0"], "learning_rate='0': must be greater than 0"),
    Case("learning_rate text", "train", [*TRAIN, "--learning_rate", "fast"], "learning_rate='fast': expected a number"),
    Case("resolution not a multiple of 8", "train", [*TRAIN, "--resolution", "100"],
         "resolution='100': must be a multiple of 8"),
    Case("resolution 0", "train", [*TRAIN, "--resolution", "0"], "resolution='0': must be greater than 0"),
    Case("resolution text", "train", [*TRAIN, "--resolution", "64px"], "resolution='64px': expected a whole number"),
    Case("max_train_steps 0", "train", [*TRAIN, "--max_train_steps", "0"], "max_train_steps='0': must be at least 1"),
    Case("repeats 0", "train", [*TRAIN, "--repeats", "0"], "repeats='0': must be at least 1"),
    Case("repeats -1", "train", [*TRAIN, "--repeats", "-1"], "repeats='-1': must be at least 1"),
    Case("train_batch_size 0", "train", [*TRAIN, "--train_batch_size", "0"], "train_batch_size='0': must be at least 1"),
    Case("mixed_precision fp16", "train", [*TRAIN, "--mixed_precision", "fp16"],
         "mixed_precision='fp16': must be one of auto, no, bf16"),
    Case("seed negative", "train", [*TRAIN, "--seed", "-1"], "seed='-1': must be at least 0"),
    Case("placeholder with a space", "train", [*TRAIN, "--placeholder_token", "<my dog>"],
         "placeholder_token='<my dog>': must be one word without spaces"),
    Case("several problems at once", "train", [*TRAIN, "--resolution", "7", "--adam_beta1", "2"],
         "invalid training settings: resolution='7': must be a multiple of 8 (e.g. 512, or 64 for 'tiny'); "
         "adam_beta1='2'"),
    Case("unsupported diffusers flag", "train", [*TRAIN, "--push_to_hub"], "unsupported flag(s) of the diffusers "
         "script: --push_to_hub"),
    # --- helpers.train: the concept folder (checked after the tokenizer, before any weights) ---------
    Case("train_data_dir is a file", "train", ["--pretrained_model_name_or_path", "toyworld", "--resolution", "64",
         "--train_data_dir", "{tmp}/pip.png", "--output_dir", "{tmp}/out"], "pip.png: is a file, not a folder",
         files={"pip.png": png()}),
    Case("train_data_dir missing", "train", ["--pretrained_model_name_or_path", "toyworld", "--resolution", "64",
         "--train_data_dir", "{tmp}/nope", "--output_dir", "{tmp}/out"], "{tmp}/nope: does not exist"),
    Case("concept folder without pictures", "train", ["--pretrained_model_name_or_path", "toyworld", "--resolution",
         "64", "--train_data_dir", "{tmp}/concept", "--output_dir", "{tmp}/out"],
         "contains no images (only files that are not pictures: .DS_Store, README.md)",
         files={"concept/README.md": "# my toy", "concept/.DS_Store": b"\0\0"}),
    Case("num_vectors past CLIP's 77 tokens", "train", ["--pretrained_model_name_or_path", "toyworld", "--resolution",
         "64", "--train_data_dir", SAMPLE, "--output_dir", "{tmp}/out", "--num_vectors", "100"],
         "num_vectors=100: at most 68 vectors fit in a prompt (CLIP reads 77 tokens and the longest prompt template, "
         "'a close-up photo of a {{}}', takes 9 of them), so vectors past that would never train. Fix: pass "
         "--num_vectors 68 or fewer."),
    Case("0-byte picture", "train", ["--pretrained_model_name_or_path", "toyworld", "--resolution", "64",
         "--train_data_dir", "{tmp}/concept", "--output_dir", "{tmp}/out"], "zero.png: empty file (0 bytes)",
         files={"concept/a.png": png(), "concept/zero.png": b""}),
    Case("corrupt picture", "train", ["--pretrained_model_name_or_path", "toyworld", "--resolution", "64",
         "--train_data_dir", "{tmp}/concept", "--output_dir", "{tmp}/out"], "cut.png: corrupt or truncated image",
         files={"concept/a.png": png(), "concept/cut.png": png()[:-30]}),
    # --- helpers.dreambooth: the same schema as helpers.train, the same folder and checkpoint checks ----
    Case("dreambooth: adam_beta2 1", "dreambooth", [*DREAM, "--adam_beta2", "1"],
         "invalid DreamBooth setting: adam_beta2='1': must be at least 0 and less than 1 (e.g. 0.999)"),
    Case("dreambooth: learning_rate inf", "dreambooth", [*DREAM, "--learning_rate", "inf"],
         "learning_rate='inf': must be a finite number"),
    Case("dreambooth: resolution 60", "dreambooth", [*DREAM, "--resolution", "60"],
         "resolution='60': must be a multiple of 8 (e.g. 512, or 64 for 'toyworld')"),
    Case("dreambooth: rank 0", "dreambooth", [*DREAM, "--rank", "0"], "rank='0': must be at least 1 (4 to 16 is usual)"),
    Case("dreambooth: mixed_precision fp16", "dreambooth", [*DREAM, "--mixed_precision", "fp16"],
         "must be one of auto, no, bf16 (fp16 is a GPU format"),
    Case("dreambooth: YAML learning_rate text", "dreambooth", ["--config", "{tmp}/run.yaml"],
         "{tmp}/run.yaml: invalid DreamBooth setting: learning_rate='5e-4x': expected a number",
         files={"run.yaml": f"instance_data_dir: {SAMPLE}\ninstance_prompt: a sks toy\nlearning_rate: 5e-4x\n"}),
    Case("dreambooth: YAML syntax error", "dreambooth", ["--config", "{tmp}/run.yaml"],
         "config file {tmp}/run.yaml, line 3, column 1: YAML syntax error", files={"run.yaml": "rank: 4\nseed: [1\n"}),
    Case("dreambooth: output_dir is a file", "dreambooth", DREAM, "output_dir='{tmp}/out' is a file",
         files={"out": "a file"}),
    Case("dreambooth: fresh run into an interrupted run", "dreambooth", DREAM,
         "output_dir {tmp}/out holds an interrupted run (seed 0, pretrained_model_name_or_path 'tiny', rank 4, "
         "train_text_encoder False, max_train_steps 8, last checkpoint checkpoint-8). Fix: resume it with "
         "--resume_from_checkpoint latest", files=DREAM_CKPT),
    Case("dreambooth: resume past the end", "dreambooth", [*DREAM, "--resume_from_checkpoint", "latest",
         "--max_train_steps", "3"], "checkpoint-8 was saved at step 8, after this run's last step (max_train_steps=3)."
         " Fix: pass --max_train_steps 8 or more to continue from it.", files=DREAM_CKPT),
    Case("dreambooth: resume with another rank", "dreambooth", [*DREAM, "--resume_from_checkpoint", "latest",
         "--rank", "8"], "holds another run than the one resumed (rank 4 there, 8 here)", files=DREAM_CKPT),
    Case("dreambooth: resume without a checkpoint", "dreambooth", [*DREAM, "--resume_from_checkpoint", "latest"],
         "resume_from_checkpoint='latest' but {tmp}/out/checkpoints holds no checkpoint",
         files={"out/dreambooth_config.yaml": DREAM_RUN}),
    # --- sizes and folders that slipped through (issue 48) ---------------------------------------------
    Case("resolution 100000", "train", [*TRAIN, "--resolution", "100000"],
         "resolution='100000': must be greater than 0 and at most 2048"),
    Case("dreambooth: resolution 100000", "dreambooth", [*DREAM, "--resolution", "100000"],
         "resolution='100000': must be greater than 0 and at most 2048"),
    Case("generate at resolution 100000", "inference", [*INFER, "--resolution", "100000"],
         "--resolution 100000: at most 2048 (Stable Diffusion models are trained at 512 to 1024 px)"),
    # --- a model of a family neither trainer can train (issue 46): one line naming the two they can ---
    Case("model of an unsupported family", "train",
         [*TRAIN, "--resolution", "64", "--pretrained_model_name_or_path", "{tmp}/flux"],
         "model {tmp}/flux is a FluxPipeline, which this package cannot train: the supported families are "
         "Stable Diffusion v1/v2 (StableDiffusionPipeline) and Stable Diffusion XL (StableDiffusionXLPipeline)",
         files={"flux/model_index.json": '{"_class_name": "FluxPipeline"}'}),
    Case("dreambooth: model of an unsupported family", "dreambooth",
         [*DREAM, "--pretrained_model_name_or_path", "{tmp}/sd3"],
         "model {tmp}/sd3 is a StableDiffusion3Pipeline, which this package cannot train: the supported "
         "families are Stable Diffusion v1/v2", files={"sd3/model_index.json": '{"_class_name": "StableDiffusion3Pipeline"}'}),
    Case("batch above the views", "train", [*TRAIN, "--train_batch_size", "100000"],
         "train_batch_size=100000: more than the 500 views there are to fill a batch with (5 pictures x repeats "
         "100). Fix: --train_batch_size 500 or less."),
    Case("batch above the views with 2 repeats", "train", [*TRAIN, "--repeats", "2", "--train_batch_size", "11"],
         "train_batch_size=11: more than the 10 views there are to fill a batch with (5 pictures x repeats 2)"),
    Case("dreambooth: batch above the pictures", "dreambooth", [*DREAM, "--train_batch_size", "6"],
         "train_batch_size=6: more than the 5 views there are to fill a batch with (5 subject pictures). "
         "Fix: --train_batch_size 5 or less."),
    Case("concept folder of 1001 files", "train", ["--train_data_dir", "{tmp}/photos", "--output_dir", "{tmp}/out"],
         "photos: holds 1,001 entries, more than the 1,000 a concept folder may hold",
         files={f"photos/{i:04}.png": b"" for i in range(1001)}),
    Case("dreambooth: concept folder of 1001 files", "dreambooth", [*DREAM[:3], "{tmp}/photos", *DREAM[4:]],
         "photos: holds 1,001 entries, more than the 1,000 a concept folder may hold",
         files={f"photos/{i:04}.png": b"" for i in range(1001)}),
    Case("logging_dir a file", "train", [*TRAIN, "--logging_dir", "{tmp}/notes.txt"],
         "logging_dir {tmp}/notes.txt is a file: TensorBoard writes a folder there", files={"notes.txt": "x"}),
    Case("logging_dir under a file", "train", [*TRAIN, "--logging_dir", "notes.txt/tb"],
         "logging_dir {tmp}/out/notes.txt/tb lies under {tmp}/out/notes.txt, which is a file",
         files={"out/notes.txt": "x"}),
    Case("logging_dir not writable", "train", [*TRAIN, "--logging_dir", "{tmp}/ro/tb"],
         "logging_dir {tmp}/ro/tb: {tmp}/ro is not writable", files={"ro": None}, unwritable="ro"),
    Case("dreambooth: logging_dir a file", "dreambooth", [*DREAM, "--logging_dir", "{tmp}/notes.txt"],
         "logging_dir {tmp}/notes.txt is a file", files={"notes.txt": "x"}),
    # --- planted links: a run never writes through one (issue 48) -------------------------------------
    Case("lock file a link", "train", TRAIN, "output_dir {tmp}/out: .output_dir.lock is a symbolic link (to "
         "{tmp}/victim.txt), where a run keeps its lock", files=PRECIOUS, links={"out/.output_dir.lock": "victim.txt"}),
    Case("lock file a folder", "train", TRAIN, "output_dir {tmp}/out: .output_dir.lock is a folder",
         files={"out/.output_dir.lock": None}),
    Case("settings file a link", "train", TRAIN, "output_dir {tmp}/out: train_config.yaml is a symbolic link (to "
         "{tmp}/victim.txt); a run writes its own files and never through a link", files=PRECIOUS,
         links={"out/train_config.yaml": "victim.txt"}),
    Case("dreambooth: lock file a link", "dreambooth", DREAM, "output_dir {tmp}/out: .output_dir.lock is a symbolic "
         "link (to {tmp}/victim.txt)", files=PRECIOUS, links={"out/.output_dir.lock": "victim.txt"}),
    Case("dreambooth: LoRA weights a link", "dreambooth", DREAM, "output_dir {tmp}/out: "
         "pytorch_lora_weights.safetensors is a symbolic link (to {tmp}/victim.txt)", files=PRECIOUS,
         links={"out/pytorch_lora_weights.safetensors": "victim.txt"}),
    Case("dreambooth: checkpoints a link", "dreambooth", DREAM, "output_dir {tmp}/out: checkpoints is a symbolic "
         "link (to {tmp}/elsewhere)", files={"elsewhere/keep.txt": "x", "out": None},
         links={"out/checkpoints": "elsewhere"}),
    # --- helpers.launch passes the training flags through the same checks -----------------------------
    Case("launch: nproc_per_node 0", "launch", ["--nproc_per_node", "0", *LAUNCH, "--", *TRAIN],
         "--nproc_per_node 0: must be at least 1"),
    Case("launch: threads_per_process 0", "launch", ["--threads_per_process", "0", *LAUNCH, "--", *TRAIN],
         "--threads_per_process 0: must be at least 1"),
    Case("launch: more ranks than this machine can start", "launch", ["--nproc_per_node", "100000", *LAUNCH, "--",
         *TRAIN], "--nproc_per_node 100000: 100000 ranks on this machine cannot start, each takes ~0.5 GiB"),
    Case("launch: train_data_dir not set", "launch", [*LAUNCH, "--", "--output_dir", "{tmp}/out"],
         "train_data_dir is not set. Fix: pass a folder of 3-5 images of your concept"),
    Case("launch: a finished run in output_dir", "launch", [*LAUNCH, "--", *TRAIN], "output_dir {tmp}/out already "
         "holds a finished run (run_summary.json)", files={"out/run_summary.json": "{}", "out/train_config.yaml": ""}),
    Case("launch: dreambooth, a finished run in output_dir", "launch", [*LAUNCH, "--module", "helpers.dreambooth",
         "--", *DREAM], "output_dir {tmp}/out already holds a finished run (run_summary.json)",
         files={"out/run_summary.json": "{}", "out/dreambooth_config.yaml": ""}),
    Case("launch: dreambooth, no checkpoint to resume", "launch", [*LAUNCH, "--module", "helpers.dreambooth", "--",
         *DREAM, "--resume_from_checkpoint", "latest"], "no checkpoint", files={"out/dreambooth_config.yaml": ""}),
    Case("launch: adam_beta1 1.5", "launch", ["--launcher", "torchrun", "--dry_run", "--", *TRAIN, "--adam_beta1",
         "1.5"], "adam_beta1='1.5': must be at least 0 and less than 1"),
    # --- argparse's usage errors: one line naming --help, not the whole usage ------------------------
    Case("launch: -- with nothing after it", "launch", [*LAUNCH, "--"],
         "error: no training flags: add -- and the helpers.train flags, e.g. -- --train_data_dir DIR (see "
         "python -m helpers.launch --help)"),
    Case("launch: --backend nccl", "launch", ["--backend", "nccl", *LAUNCH, "--", *TRAIN],
         "error: argument --backend: invalid choice: 'nccl' (choose from 'auto', 'gloo', 'ccl') (see python -m "
         "helpers.launch --help)"),
    Case("train: a flag it does not have", "train", [*TRAIN, "--bogus"],
         "error: unrecognized arguments: --bogus (see python -m helpers.train --help)"),
    Case("dreambooth: a flag it does not have", "dreambooth", [*DREAM, "--bogus"],
         "error: unrecognized arguments: --bogus (see python -m helpers.dreambooth --help)"),
    Case("inference: no sub-command", "inference", ["bogus"],
         "error: argument command: invalid choice: 'bogus'"),
    Case("toyworld: no such sub-command", "toyworld", ["bogus"],
         "error: argument command: invalid choice: 'bogus' (choose from 'build', 'score', 'render-sample') (see "
         "python -m helpers.toyworld --help)"),
    Case("launch: --backend ccl not built", "launch", ["--backend", "ccl", "--dry_run", "--", *TRAIN],
         "--backend ccl: the ccl extension is not built for this torch and oneCCL: run `make setup` "
         "(or use --backend gloo)", ccl_not_built=True),
    # --- helpers.inference: learned embeddings and folders ------------------------------------------
    Case("embeddings empty", "inference", [*INFER, "--learned_embeds", "{tmp}/learned_embeds.safetensors"],
         "learned_embeds '{tmp}/learned_embeds.safetensors' is empty (0 bytes)",
         files={"learned_embeds.safetensors": b""}),
    Case("embeddings corrupt", "inference", [*INFER, "--learned_embeds", "{tmp}/learned_embeds.safetensors"],
         "learned_embeds '{tmp}/learned_embeds.safetensors' is not a readable safetensors file",
         files={"learned_embeds.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"}),
    Case("embeddings truncated", "inference", [*INFER, "--learned_embeds", "{tmp}/learned_embeds.safetensors"],
         "is not a readable safetensors file",
         files={"learned_embeds.safetensors": safetensors_bytes({"<pip>": torch.ones(1, 32)})[:-8]}),
    Case("embeddings NaN", "inference", [*INFER, "--learned_embeds", "{tmp}/learned_embeds.safetensors"],
         "learned_embeds '{tmp}/learned_embeds.safetensors': 32 of the 32 numbers of '<pip>' are NaN or infinite",
         files={"learned_embeds.safetensors": safetensors_bytes({"<pip>": torch.full((1, 32), float("nan"))})}),
    Case("embeddings infinite", "inference", [*INFER, "--learned_embeds", "{tmp}/run"],
         "1 of the 64 numbers of '<pip>' are NaN or infinite",
         files={"run/learned_embeds.safetensors": safetensors_bytes(
             {"<pip>": torch.tensor([[0.0] * 63 + [float("inf")]]).view(2, 32)})}),
    Case("embeddings of two tokens", "inference", [*INFER, "--learned_embeds", "{tmp}/e.safetensors"],
         "holds 2 tensors (a, b)", files={"e.safetensors": safetensors_bytes({"a": torch.ones(1, 4), "b": torch.ones(1, 4)})}),
    Case("embeddings not floats", "inference", [*INFER, "--learned_embeds", "{tmp}/e.safetensors"],
         "is not [num_vectors, hidden] floating-point vectors",
         files={"e.safetensors": safetensors_bytes({"<pip>": torch.ones(1, 4, dtype=torch.int64)})}),
    Case("embeddings .bin", "inference", [*INFER, "--learned_embeds", "{tmp}/learned_embeds.bin"],
         "expected a .safetensors file", files={"learned_embeds.bin": b"torch pickle"}),
    Case("embeddings missing", "inference", [*INFER, "--learned_embeds", "{tmp}/run"],
         "learned_embeds '{tmp}/run/learned_embeds.safetensors' does not exist", files={"run": None}),
    Case("generate into a file", "inference", ["generate", "--model", "toyworld", "--prompt", "a", "--output_dir",
         "{tmp}/images.png"], "--output_dir '{tmp}/images.png' is a file", files={"images.png": png()}),
    Case("generate with 0 steps", "inference", [*INFER, "--num_inference_steps", "0"],
         "--num_inference_steps 0: must be at least 1"),
    Case("generate at resolution 60", "inference", [*INFER, "--resolution", "60"],
         "--resolution 60: must be a positive multiple of 8"),
    Case("generate 0 images per prompt", "inference", [*INFER, "--num_images_per_prompt", "0"],
         "--num_images_per_prompt 0: must be at least 1"),
    Case("generate with 0 timed repeats", "inference", [*INFER, "--repeats", "0"], "--repeats 0: must be at least 1"),
    Case("generate with NaN guidance", "inference", [*INFER, "--guidance_scale", "nan"],
         "--guidance_scale nan: must be a finite number of 0 or more"),
    # --- helpers.toyworld score ----------------------------------------------------------------------
    Case("toyworld: score 0 images", "toyworld", [*SCORE, "--num_images", "0"], "--num_images 0: must be at least 1"),
    Case("toyworld: score -2 images", "toyworld", [*SCORE, "--num_images", "-2"], "--num_images -2: must be at least 1"),
    Case("toyworld: score with 0 steps", "toyworld", [*SCORE, "--num_inference_steps", "0"],
         "--num_inference_steps 0: must be at least 1"),
    # --- helpers.toyworld build ----------------------------------------------------------------------
    Case("toyworld: build an unknown family", "toyworld", ["build", "--family", "sd3", "--output_dir", "{tmp}/m"],
         "error: argument --family: invalid choice: 'sd3' (choose from 'sd1', 'sdxl') (see python -m "
         "helpers.toyworld build --help)"),
    Case("toyworld: an SD v1 setting for SDXL", "toyworld", ["build", "--family", "sdxl", "--vae_steps", "10",
         "--output_dir", "{tmp}/m"], "--vae_steps: the sdxl build has no such setting (only the sd1 build has). "
         "Fix: leave it out, or build with --family sd1."),
    Case("toyworld: an SDXL setting for SD v1", "toyworld", ["build", "--base_model", "toyworld", "--output_dir",
         "{tmp}/m"], "--base_model: the sd1 build has no such setting (only the sdxl build has)"),
    Case("toyworld: SDXL from a random model", "toyworld", ["build", "--family", "sdxl", "--base_model", "tiny",
         "--output_dir", "{tmp}/m"], "--base_model 'tiny' is neither 'toyworld' nor a folder"),
    Case("toyworld: SDXL from a model without a judge", "toyworld", ["build", "--family", "sdxl", "--base_model",
         "{tmp}/sd", "--output_dir", "{tmp}/m"], "--base_model '{tmp}/sd' is not an SD v1 toy world with a judge",
         files={"sd/model_index.json": '{"_class_name": "StableDiffusionPipeline"}'}),
    Case("toyworld: SDXL from an SDXL model", "toyworld", ["build", "--family", "sdxl", "--base_model", "{tmp}/xl",
         "--output_dir", "{tmp}/m"], "--base_model '{tmp}/xl' is not an SD v1 toy world with a judge",
         files={"xl/model_index.json": '{"_class_name": "StableDiffusionXLPipeline"}',
                "xl/judge/model.safetensors": b"x"}),
    Case("compare against a non-export", "inference", ["compare", "--model", "toyworld", "--prompt", "a",
         "--openvino_dir", "{tmp}/ov"], "--openvino_dir '{tmp}/ov' is not an exported OpenVINO pipeline",
         files={"ov/README.md": "x"}),
    # --- helpers.cluster.azure: issue 13's spec edge cases and bad cluster files ------------------------------
    Case("node_count 1001", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "node_count=1001: must be an integer from 1 to 1000", files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\n"
                                                                      "node_count: 1001\n"}),
    Case("ssh from 0.0.0.0/1", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "ssh_source_cidr='0.0.0.0/1' allows SSH from 2,147,483,648 addresses (2^31), more than a /16",
         files={"cluster.yaml": "ssh_source_cidr: 0.0.0.0/1\n"}),
    Case("ssh from ::/1", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "ssh_source_cidr='::/1' allows SSH from 170,141,183,460,469,231,731,687,303,715,884,105,728 addresses "
         "(2^127), more than a /48", files={"cluster.yaml": "ssh_source_cidr: ::/1\n"}),
    Case("ssh from IPv4-mapped ::ffff:0.0.0.0/97", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "ssh_source_cidr='::ffff:0.0.0.0/97' (the IPv4 range 0.0.0.0/1) allows SSH from 2,147,483,648 addresses",
         files={"cluster.yaml": "ssh_source_cidr: '::ffff:0.0.0.0/97'\n"}),
    Case("ssh from all of IPv4, IPv4-mapped", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "this opens SSH to the whole internet", files={"cluster.yaml": "ssh_source_cidr: '::ffff:0:0/96'\n"}),
    Case("vm_size unknown and unpriced", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "vm_size='Standard_Bogus_v9': no price in helpers.cluster.prices",
         files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\nvm_size: Standard_Bogus_v9\n"}),
    Case("location unknown", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "location='marsnorth': not an Azure region known here (nearest names: uaenorth, germanynorth, italynorth)",
         files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\nlocation: marsnorth\n"}),
    Case("cost for -5 hours", "azure", ["plan", "--config", "{tmp}/cluster.yaml", "--hours", "-5"],
         "hours=-5: must be a positive number of hours", files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\n"}),
    Case("cost at a NaN price", "azure", ["plan", "--config", "{tmp}/cluster.yaml", "--vm-price-per-hour", "nan"],
         "vm_price_per_hour=nan: must be a price in USD of 0 or more", files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\n"}),
    Case("ssh from a /15", "azure", ["plan", "--config", "{tmp}/cluster.yaml"], "allows SSH from 131,072 addresses",
         files={"cluster.yaml": "ssh_source_cidr: 10.0.0.0/15\n"}),
    Case("ssh from a /47", "azure", ["plan", "--config", "{tmp}/cluster.yaml"], "more than a /48",
         files={"cluster.yaml": "ssh_source_cidr: 2001:db8::/47\n"}),
    Case("ssh from everywhere, even with the opt-in", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "this opens SSH to the whole internet",
         files={"cluster.yaml": "ssh_source_cidr: 0.0.0.0/0\nallow_wide_ssh_source: true\n"}),
    Case("opt-in not a boolean", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "allow_wide_ssh_source='sure': must be true or false",
         files={"cluster.yaml": "ssh_source_cidr: 0.0.0.0/1\nallow_wide_ssh_source: sure\n"}),
    Case("cluster YAML syntax error", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "cluster file {tmp}/cluster.yaml, line 2, column 1: YAML syntax error",
         files={"cluster.yaml": "ssh_source_cidr: [203.0.113.7/32\n"}),
    Case("cluster YAML a list", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "expected a mapping of key: value", files={"cluster.yaml": f"- ssh_source_cidr: {CIDR}\n"}),
    Case("cluster YAML unknown key", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "unknown keys ['nodes']", files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\nnodes: 3\n"}),
    Case("cluster YAML without ssh_source_cidr", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "ssh_source_cidr is required", files={"cluster.yaml": "node_count: 2\n"}),
    Case("cluster vnet IPv6", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "vnet_prefix='fd00::/8': not an IPv4 range", files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\n"
                                                                          "vnet_prefix: fd00::/8\n"}),
    Case("cluster file is a folder", "azure", ["plan", "--config", "{tmp}/cluster"],
         "cluster file {tmp}/cluster is a folder", files={"cluster": None}),
    Case("cluster file missing", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "{tmp}/cluster.yaml does not exist. Fix: copy notebooks/cluster.example.yaml"),
    Case("cluster file unreadable", "azure", ["plan", "--config", "{tmp}/cluster.yaml"],
         "cluster file {tmp}/cluster.yaml cannot be read (permission denied)",
         files={"cluster.yaml": f"ssh_source_cidr: {CIDR}\n"}, unreadable="cluster.yaml"),
    # --- helpers.training.data ---------------------------------------------------------------------------------
    Case("data: folder missing", "data", ["validate", "{tmp}/nope"], "{tmp}/nope: does not exist"),
    Case("data: a picture, not its folder", "data", ["validate", "{tmp}/a.png"], "a.png: is a file, not a folder",
         files={"a.png": png()}),
    Case("data: picture unreadable", "data", ["validate", "{tmp}/concept"], "b.png: cannot be read (Permission denied)",
         files={"concept/a.png": png(), "concept/b.png": png()}, unreadable="concept/b.png"),
]  # fmt: skip


def _finished_run(config_file: str, learning_rate: str = "") -> dict:
    """A run that finished at step 8 whose last kept checkpoint is checkpoint-4, as each method names
    its settings file (nothing is loaded before the checks refuse)."""
    run = f"max_train_steps: 8\n{learning_rate}"
    return {f"out/{config_file}": run, "out/run_summary.json": '{"steps": 8}',
            f"out/checkpoints/checkpoint-4/{config_file}": run,
            "out/checkpoints/checkpoint-4/random_states_0.pkl": b"x"}  # fmt: skip


# The resume checks are the run loop's: the same cases for both methods.
CASES += [
    case
    for cli, base, config_file in (("train", TRAIN, "train_config.yaml"), ("dreambooth", DREAM, "dreambooth_config.yaml"))
    for case in (
        Case(f"{cli}: resume a finished run backwards", cli, [*base, "--resume_from_checkpoint", "latest",
             "--max_train_steps", "6"], "output_dir {tmp}/out holds a run that finished at step 8; resuming it "
             "with max_train_steps=6 would replace that result by an earlier step's. Fix: pass --max_train_steps 8 "
             "or more to continue it, or choose another output_dir.", files=_finished_run(config_file)),
        Case(f"{cli}: resume with another learning rate", cli, [*base, "--resume_from_checkpoint", "latest",
             "--learning_rate", "0.002"], "resume_from_checkpoint {tmp}/out/checkpoints/checkpoint-4 was trained with "
             "learning_rate 0.001, this run asks for 0.002; the checkpoint's optimizer would go on with 0.001. Fix: "
             "resume with --learning_rate 0.001, or start a new run in another output_dir.",
             files=_finished_run(config_file, "learning_rate: 0.001\n")),
    )
]  # fmt: skip


def _make(tmp: Path, files: dict[str, str | bytes | None]) -> None:
    for name, content in files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def _link(tmp: Path, links: dict[str, str]) -> None:
    for name, target in links.items():
        (tmp / name).symlink_to(tmp / target)


def _tree(tmp: Path) -> dict[str, tuple[int, int, int]]:
    return {
        str(p.relative_to(tmp)): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(tmp.rglob("*"))
    }


def _deny(monkeypatch, path: Path, what: str) -> None:
    """Refuse to read the file ``path`` or to write into the folder ``path``, as the OS refuses another user."""
    if what == "write":
        from helpers.training import schema

        real_access = os.access
        monkeypatch.setattr(
            schema.os, "access", lambda p, mode: False if Path(p) == path else real_access(p, mode)
        )
        return
    real_read_text, real_image_open = Path.read_text, Image.open

    def denied(name):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(name))

    def read_text(self, *args, **kwargs):
        return denied(self) if self == path else real_read_text(self, *args, **kwargs)

    def image_open(fp, *args, **kwargs):
        return denied(fp) if Path(fp) == path else real_image_open(fp, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(data.Image, "open", image_open)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any command gets as far as loading model weights."""
    import diffusers

    import helpers.inference.command as inference_command
    from helpers.training import models

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_components", loaded)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", classmethod(loaded))
    for name in ("load_pytorch_pipeline", "load_openvino_pipeline", "export_openvino"):
        monkeypatch.setattr(inference_command, name, loaded)


def run_in_process(cli: str, argv: list[str]) -> int:
    """The command's exit code, argparse's own exit (a usage error) included."""
    try:
        return _run_in_process(cli, argv)
    except SystemExit as done:
        return done.code


def _run_in_process(cli: str, argv: list[str]) -> int:
    if cli == "train":
        from helpers import train

        return train.cli(argv)
    if cli == "launch":
        from helpers import launch

        return launch.main(launch.parse_args(argv))
    if cli == "inference":
        from helpers import inference

        return inference.cli(argv)
    if cli == "azure":
        from helpers.cluster import azure

        return azure.cli(argv)
    if cli == "dreambooth":
        from helpers.dreambooth import command

        return command.cli(argv)
    if cli == "toyworld":
        from helpers.toyworld import __main__ as toyworld

        return toyworld.cli(argv)
    return data.cli(argv)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    case, tmp_path, monkeypatch, capsys, no_model_loads
):
    _make(tmp_path, case.files)
    _link(tmp_path, case.links)
    monkeypatch.chdir(tmp_path)
    if case.unreadable:
        if os.geteuid() == 0:  # root reads anything: simulate the refusal another user gets
            _deny(monkeypatch, tmp_path / case.unreadable, "read")
        else:
            (tmp_path / case.unreadable).chmod(0)
    if case.unwritable:
        if os.geteuid() == 0:
            _deny(monkeypatch, tmp_path / case.unwritable, "write")
        else:
            (tmp_path / case.unwritable).chmod(0o555)
    if case.ccl_not_built:
        monkeypatch.setattr(oneccl, "CACHE", tmp_path.parent / f"{tmp_path.name}-no-ccl-build")
        monkeypatch.setattr(oneccl, "_loaded", None)
    before = _tree(tmp_path)
    try:
        code = run_in_process(case.cli, [a.format(tmp=tmp_path) for a in case.argv])
    finally:
        for name in (case.unreadable, case.unwritable):
            if name and os.geteuid() != 0:
                (tmp_path / name).chmod(0o755)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert case.error.format(tmp=tmp_path) in captured.err
    assert _tree(tmp_path) == before  # nothing written, nothing half-written


def test_every_command_is_in_the_table():
    assert {c.cli for c in CASES} == {
        "train",
        "dreambooth",
        "launch",
        "inference",
        "toyworld",
        "azure",
        "data",
    }


# --- what used to crash and is now accepted -------------------------------------------------------


def test_yaml_numbers_written_as_text_are_accepted(tmp_path):
    """Issue 13: ``learning_rate: 5e-4`` and ``resolution: "64"`` (text to YAML) crashed with a TypeError."""
    from helpers.training.config import parse_args

    path = tmp_path / "run.yaml"
    path.write_text('learning_rate: 5e-4\nresolution: "64"\nmax_train_steps: 1e2\n')
    config = parse_args(["--config", str(path), "--output_dir", str(tmp_path / "out")])
    assert (config.learning_rate, config.resolution, config.max_train_steps) == (0.0005, 64, 100)


def test_a_concept_folder_like_a_persons_own_is_accepted(tmp_path, capsys):
    """Issue 14: small pictures and a README beside them are used and skipped, with one warning each."""
    folder = tmp_path / "concept"
    _make(
        folder,
        {"a.png": png((400, 300)), "b.png": png((600, 600)), "README.md": "# my toy", ".DS_Store": b"\0"},
    )
    with pytest.warns(data.ConceptImagesWarning) as record:
        assert data.cli(["validate", str(folder), "--min_size", "512"]) == 0
    assert sorted(str(w.message) for w in record) == [
        f"{folder}: 1 picture(s) smaller than the training resolution 512 px will be resized up (softer detail): "
        "a.png (400x300)",
        f"{folder}: skipped 2 file(s) that are not pictures: .DS_Store, README.md",
    ]
    assert capsys.readouterr().out == f"{folder / 'a.png'}\n{folder / 'b.png'}\n"


# --- the same through the real command line: the exit code the shell sees -------------------------


@pytest.mark.parametrize(
    ("argv", "files", "error"),
    [
        (["helpers.train", *TRAIN, "--adam_beta1", "1.5"], {}, "adam_beta1='1.5': must be at least 0 and less than 1"),
        (["helpers.train", "--config", "{tmp}/run.yaml"], {"run.yaml": "a: [1\n"}, "line 2, column 1: YAML syntax"),
        (["helpers.inference", *INFER, "--learned_embeds", "{tmp}/e.safetensors"], {"e.safetensors": b""},
         "learned_embeds '{tmp}/e.safetensors' is empty (0 bytes)"),
        (["helpers.azure", "plan", "--config", "{tmp}/c.yaml"], {"c.yaml": "ssh_source_cidr: ::/1\n"},
         "allows SSH from 170,141,183,460,469,231,731,687,303,715,884,105,728 addresses"),
        (["helpers.training.data", "validate", "{tmp}/nope"], {}, "{tmp}/nope: does not exist"),
    ],
    ids=["train", "train-yaml", "inference", "azure", "data"],
)  # fmt: skip
def test_python_dash_m_exits_2_with_one_line(tmp_path, argv, files, error):
    _make(tmp_path, files)
    before = _tree(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", *(a.format(tmp=tmp_path) for a in argv)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and error.format(tmp=tmp_path) in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert _tree(tmp_path) == before

"""Before a job starts: helpers.launch's warning when this node's processes need more memory than it has."""

from __future__ import annotations

import pytest

from helpers import launch
from helpers.launching import preflight
from helpers.training import data

GIB = 2**30


def _launch(tmp_path, *train, nproc=2, module=()):
    args = launch.parse_args(
        ["--launcher", "torchrun", "--nproc_per_node", str(nproc), *module, "--dry_run", "--",
         "--output_dir", str(tmp_path / "out"), *train]
    )  # fmt: skip
    return launch.main(args)


SD15 = ["--train_data_dir", str(data.sample_concept_dir()), "--resolution", "256", "--mixed_precision", "no"]


def test_launch_warns_in_one_line_when_the_processes_need_more_than_this_node_has(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 16 * GIB)
    assert _launch(tmp_path, *SD15) == 0  # the Hub's SD v1.5 (the default model): 8.3 GiB a process
    assert capsys.readouterr().err == (
        "warning: 2 processes per node × ~8.3 GiB each (fp32, 256 px) need 16.7 GiB; this node has 16.0 GiB"
        " — expect swapping or an out-of-memory kill; pass --nproc_per_node 1\n"
    )


def test_launch_says_nothing_when_the_processes_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 32 * GIB)
    assert _launch(tmp_path, *SD15) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "train, module",
    [
        (["--pretrained_model_name_or_path", "tiny", "--resolution", "64"], ()),  # not the measured model
        (["--instance_data_dir", str(data.sample_concept_dir()), "--instance_prompt", "a sks toy"],
         ("--module", "helpers.dreambooth")),  # its memory is not measured
    ],
    ids=["tiny", "dreambooth"],
)  # fmt: skip
def test_no_warning_where_the_measurement_does_not_apply(tmp_path, capsys, monkeypatch, train, module):
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 1 * GIB)
    default_data = [] if module else ["--train_data_dir", str(data.sample_concept_dir())]
    assert _launch(tmp_path, *default_data, *train, module=module) == 0
    assert capsys.readouterr().err == ""


def test_memory_warning_counts_every_node_on_this_machine_and_says_when_none_fits():
    assert preflight.memory_warning(2, 256, "bf16", nodes_here=2, node_bytes=8 * GIB) == (
        "warning: 4 processes on this machine × ~5.7 GiB each (bf16, 256 px) need 23.0 GiB; this node has "
        "8.0 GiB — expect swapping or an out-of-memory kill; not even one process per node fits: use a node "
        "with more memory"
    )
    assert preflight.memory_warning(1, 256, "bf16", node_bytes=6 * GIB) is None

"""helpers.launching.distributed: layouts, hostfiles, accelerate configs, launch commands, pre-flight.

Multi-host commands are run for real: every MPI flavour starts the exact 4-node x 4-process
command it was given, on "nodes" that a stand-in for ssh runs on this machine.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import launch
from helpers.core import errors
from helpers.core.errors import DistributedError
from helpers.launching import accelerate_config, commands, preflight
from helpers.launching.layout import (
    DEFAULT_PORT,
    ClusterLayout,
    MpiFlavour,
    free_port,
    is_local_host,
    physical_cores,
    write_hostfile,
)
from helpers.ranks import backend, oneccl
from helpers.training import data
from helpers.workshop import forms

HOSTS4 = ("node1", "node2", "node3", "node4")
MPIRUNS = {
    MpiFlavour.INTEL: Path(sys.executable).parent / "mpirun",
    MpiFlavour.MPICH: Path("/usr/bin/mpirun.mpich"),
    MpiFlavour.OPENMPI: Path("/usr/bin/mpirun.openmpi"),
}
INSTALL = {
    MpiFlavour.INTEL: "pip install impi-rt==2021.18.1 (make setup)",
    MpiFlavour.MPICH: "apt-get install mpich",
    MpiFlavour.OPENMPI: "apt-get install openmpi-bin",
}
# How each flavour is told to use another ssh program, without changing the command line.
SSH_OVERRIDE = {
    MpiFlavour.INTEL: lambda ssh: {"I_MPI_HYDRA_BOOTSTRAP": "ssh", "I_MPI_HYDRA_BOOTSTRAP_EXEC": ssh},
    MpiFlavour.MPICH: lambda ssh: {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": ssh},
    MpiFlavour.OPENMPI: lambda ssh: {"OMPI_MCA_plm_rsh_agent": ssh},
}


def mpirun_for(flavour: MpiFlavour) -> str:
    path = MPIRUNS[flavour]
    if not path.exists():
        pytest.skip(f"{flavour.value} is not installed here: {INSTALL[flavour]}")
    return str(path)


# --- layout and hostfiles ------------------------------------------------------------------------


def test_local_layout_defaults():
    layout = ClusterLayout.local(2)
    assert layout.is_local and layout.world_size == 2 and layout.num_machines == 1
    assert layout.main_process_ip == "127.0.0.1" and layout.main_process_port != DEFAULT_PORT
    with socket.socket() as s:  # on one machine the default is a port free now, not 29500
        s.bind(("127.0.0.1", layout.main_process_port))
    assert layout.threads_per_process == max(1, physical_cores() // 2)
    assert ClusterLayout(("node1", "node2"), 2, threads_per_process=1).main_process_port == DEFAULT_PORT


def test_a_port_in_use_on_this_machine_is_one_line_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """The second of two jobs given the same port: refused before anything is written or started."""
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedError) as err:
            preflight.check_port(ClusterLayout.local(2, main_process_port=port, threads_per_process=1))
        assert str(err.value) == (
            f"--main_process_port {port} is in use on this machine (another job?): pass another free port, or "
            "leave the flag out on one machine (a free port is then picked)"
        )
        out = tmp_path / "out"
        args = launch.parse_args(["--nproc_per_node", "2", "--main_process_port", str(port), "--",
                                  "--train_data_dir", str(data.sample_concept_dir()), "--output_dir", str(out)])  # fmt: skip
        assert launch.main(args) == 2
    assert capsys.readouterr().err == f"error: {err.value}\n" and not out.exists()
    preflight.check_port(ClusterLayout.local(2, main_process_port=port, threads_per_process=1))  # free again


def test_port_0_picks_a_port_free_on_this_machine():
    layout = ClusterLayout.local(2, main_process_port=0)
    assert 1 <= layout.main_process_port <= 65535
    with socket.socket() as s:  # free: the rendezvous can listen on it
        s.bind(("127.0.0.1", layout.main_process_port))
    assert commands.job_env(layout)["MASTER_PORT"] == str(layout.main_process_port)


def test_remote_layout_uses_first_host_as_main():
    layout = ClusterLayout(HOSTS4, nproc_per_node=4, threads_per_process=8)
    assert not layout.is_local and layout.world_size == 16 and layout.main_process_ip == "node1"


@pytest.mark.parametrize(
    "text",
    [
        "node1\nnode2\n",
        "node1:4\nnode2:4\n",
        "# cluster\nnode1 slots=4  # head\n\nnode2 slots=4 max_slots=8\n",
    ],
)
def test_hostfile_syntaxes(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    layout = ClusterLayout.from_hostfile(path)
    assert layout.hosts == ("node1", "node2")
    assert layout.nproc_per_node == (1 if ":" not in text and "slots" not in text else 4)
    assert ClusterLayout.from_hostfile(path, nproc_per_node=3).nproc_per_node == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "lists no host"),
        ("node1 extra words\n", r"hosts:1: cannot read"),
        ("node1:2\nnode2:4\n", "different slot counts"),
        ("node1\nnode1\n", "more than once"),
    ],
)
def test_bad_hostfiles_name_the_problem(tmp_path, text, match):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(errors.DistributedError, match=match):
        ClusterLayout.from_hostfile(path)


def test_missing_hostfile_and_bad_values():
    with pytest.raises(errors.DistributedError, match="does not exist"):
        ClusterLayout.from_hostfile("/no/such/hostfile")
    with pytest.raises(errors.DistributedError, match="nproc_per_node=0"):
        ClusterLayout.local(0)
    with pytest.raises(errors.DistributedError, match="main_process_port=70000"):
        ClusterLayout.local(1, main_process_port=70000)
    with pytest.raises(errors.DistributedError, match="main_process_port=-1: .* or 0 for one that is free"):
        ClusterLayout.local(1, main_process_port=-1)
    with pytest.raises(errors.DistributedError, match="hosts="):
        ClusterLayout(())


@pytest.mark.parametrize("flavour", list(MpiFlavour))
def test_write_hostfile_round_trips(tmp_path, flavour):
    layout = ClusterLayout(HOSTS4, nproc_per_node=4, threads_per_process=1)
    path = write_hostfile(layout, tmp_path / "hostfile", flavour)
    assert path.read_text().splitlines()[0] == ("node1:4" if flavour.hydra else "node1 slots=4")
    assert ClusterLayout.from_hostfile(path).hosts == HOSTS4


# --- accelerate configs --------------------------------------------------------------------------


def test_configs_load_with_accelerates_loader(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    layout = ClusterLayout(HOSTS4, nproc_per_node=4, main_process_ip="10.0.0.4", main_process_port=29555)
    paths = accelerate_config.write_accelerate_configs(layout, tmp_path / "cfg", mixed_precision="bf16")
    assert [p.name for p in paths] == [f"accelerate_config_node{k}.yaml" for k in range(4)]
    for k, path in enumerate(paths):
        cfg = load_config_from_file(str(path))
        assert isinstance(cfg, ClusterConfig)
        assert cfg.distributed_type == DistributedType.MULTI_CPU and cfg.use_cpu is True
        assert (cfg.machine_rank, cfg.num_machines, cfg.num_processes) == (k, 4, 16)
        assert (cfg.main_process_ip, cfg.main_process_port) == ("10.0.0.4", 29555)
        assert cfg.mixed_precision == "bf16" and cfg.mpirun_config == {} and cfg.rdzv_backend == "static"
        # every key carries a comment saying why
        keys = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
        assert keys and all("  # " in ln for ln in keys)


def test_mixed_precision_no_stays_a_string_and_auto_resolves(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from helpers.core import cpu

    layout = ClusterLayout.local(2)
    for requested, expected in [("no", "no"), ("auto", cpu.choose_precision("auto").mixed_precision)]:
        (path,) = accelerate_config.write_accelerate_configs(layout, tmp_path / requested, requested)
        assert load_config_from_file(str(path)).mixed_precision == expected
    with pytest.raises(errors.DistributedError, match="mixed_precision='fp16'"):
        accelerate_config.write_accelerate_configs(layout, tmp_path, "fp16")
    with pytest.raises(errors.DistributedError, match="machine_rank=1"):
        accelerate_config.render_accelerate_config(layout, machine_rank=1)


def test_our_answers_reproduce_the_interactive_accelerate_config(monkeypatch):
    """Feed our answers to accelerate's own questionnaire: it must ask exactly our questions and
    produce the same settings as our file."""
    import accelerate.commands.config.cluster as cluster
    import accelerate.commands.config.config as config

    layout = ClusterLayout(HOSTS4, nproc_per_node=2, main_process_ip="10.0.0.4", main_process_port=29501)
    text = accelerate_config.render_accelerate_config(
        layout, machine_rank=2, mixed_precision="no", mpirun_hostfile="/tmp/hosts"
    )
    answers = {a.question.strip(): a.answer for a in accelerate_config.config_answers(text) if a.question}
    asked = []

    def ask_field(question, convert_value=None, default=None, error_message=None):
        asked.append(question.strip())
        answer = answers[question.strip()]
        return convert_value(answer) if convert_value else answer

    def ask_options(question, options, convert_value=None, default=0):
        asked.append(question.strip())
        index = [str(o) for o in options].index(answers[question.strip()])
        return convert_value(index) if convert_value else options[index]

    for module in (cluster, config):
        monkeypatch.setattr(module, "_ask_field", ask_field, raising=False)
        monkeypatch.setattr(module, "_ask_options", ask_options)
    produced = config.get_user_input().to_dict()
    assert asked == list(answers)  # same questions, same order
    ours = yaml.safe_load(text)
    for key, value in ours.items():
        assert produced.get(key, value) == value, key
    assert {k for k in ours if k not in produced} <= {"dynamo_config"}  # {} is dropped by to_dict


def test_template_asset_is_annotated_and_loads(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    template = accelerate_config.CONFIG_TEMPLATE.read_text()
    assert "<HEAD_NODE_IP>" in template and "<MACHINE_RANK>" in template
    path = tmp_path / "t.yaml"
    path.write_text(template)  # placeholders are strings: still a file accelerate's loader reads
    assert load_config_from_file(str(path)).main_process_ip == "<HEAD_NODE_IP>"


@pytest.mark.slow
def test_mpirun_config_lets_accelerate_launch_start_all_ranks(tmp_path):
    """The 'yes' answer to 'launch mpirun?': `accelerate launch --config_file` alone starts both ranks,
    and they form one group: an all-reduce sums both. (It also keeps rank 0 from exiting while rank 1
    is still connecting: without a collective, gloo's init returned on rank 0 first, and rank 0's exit
    failed rank 1's connect with "Connection closed by peer", 3 times in about 170 runs beside another job.)"""
    layout = ClusterLayout.local(2, main_process_port=free_port())
    hostfile = write_hostfile(layout, tmp_path / "hostfile", MpiFlavour.INTEL)
    (config,) = accelerate_config.write_accelerate_configs(layout, tmp_path, mpirun_hostfile=hostfile)
    script = tmp_path / "world.py"
    script.write_text(
        "import torch\nfrom accelerate import Accelerator\na = Accelerator(cpu=True)\n"
        "t = torch.ones(1)\ntorch.distributed.all_reduce(t)\n"
        "print(f'WORLD {a.process_index} {a.num_processes} {t.item():g}', flush=True)\na.end_training()\n"
    )
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # The ranks share one stdout through mpirun, which may join their lines: match, don't split.
    assert sorted(re.findall(r"WORLD \d+ \d+ \d+", out.stdout)) == ["WORLD 0 2 2", "WORLD 1 2 2"]


# --- flavour, backend, environment ----------------------------------------------------------------


@pytest.mark.parametrize("flavour", list(MpiFlavour))
def test_detect_mpi_flavour(flavour):
    assert commands.detect_mpi_flavour(mpirun_for(flavour)) is flavour


def test_detect_rejects_a_program_that_is_not_mpi():
    with pytest.raises(errors.DistributedError, match="not Intel MPI, MPICH or Open MPI"):
        commands.detect_mpi_flavour(shutil.which("python3") or sys.executable)


@pytest.fixture
def no_ccl_build(monkeypatch, tmp_path):
    """This process as on a machine where ``make setup`` did not build the ccl extension: its build
    folder is an empty one (the wheels stay installed) and nothing is loaded yet."""
    monkeypatch.setattr(oneccl, "CACHE", tmp_path / "no-ccl-build")
    monkeypatch.setattr(oneccl, "_loaded", None)


NOT_BUILT = "the ccl extension is not built for this torch and oneCCL: run `make setup`"


def test_ranks_start_the_backend_the_launcher_put_in_their_environment(monkeypatch, no_ccl_build):
    """init_backend (called by both trainers before Accelerator()) reads WORKSHOP_BACKEND: gloo
    is left to accelerate; ccl where it is not built and an unknown name are one clear error."""
    import torch.distributed as dist

    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert backend.init_backend() == "gloo" and not dist.is_initialized()
    monkeypatch.setenv(backend.BACKEND_ENV, "ccl")
    with pytest.raises(errors.DistributedError) as raised:
        backend.init_backend()
    assert str(raised.value) == (
        f"backend 'ccl' (WORKSHOP_BACKEND) cannot be used on {socket.gethostname()}: {NOT_BUILT} "
        "(on every node), or launch with --backend gloo"
    )
    assert not dist.is_initialized()
    monkeypatch.setenv(backend.BACKEND_ENV, "nccl")
    with pytest.raises(errors.DistributedError, match="WORKSHOP_BACKEND='nccl': use 'gloo' or 'ccl'"):
        backend.init_backend()


def test_backend_auto_is_ccl_where_it_loads_and_gloo_where_not_built(no_ccl_build):
    assert backend.select_backend() == "gloo"
    assert backend.resolve_backend("auto") == backend.resolve_backend(None) == "gloo"
    assert backend.resolve_backend("gloo") == "gloo"
    with pytest.raises(errors.DistributedError) as raised:
        backend.resolve_backend("ccl")
    assert str(raised.value) == f"--backend ccl: {NOT_BUILT} (or use --backend gloo)"
    with pytest.raises(errors.DistributedError, match="--backend nccl: use auto, gloo or ccl"):
        backend.resolve_backend("nccl")


def test_backend_auto_is_ccl_where_built():
    ok, reason = oneccl.available()
    if not ok:
        pytest.skip(f"ccl cannot be used here: {reason}")
    assert (
        backend.select_backend() == backend.resolve_backend("auto") == backend.resolve_backend("ccl") == "ccl"
    )


def test_ranks_on_this_machine_need_room_in_dev_shm_for_ccl(monkeypatch, caplog):
    """libfabric's shm transport (ccl, every rank on one machine) wants 64 MiB of /dev/shm per CPU
    as each rank starts, and a container's is often 64 MB: auto is then gloo with a warning saying
    why, ccl asked for is one line; a job over several machines (tcp) is not held to it."""

    def statvfs(free_mib: int):
        return lambda path: os.statvfs_result((4096, 4096, 0, 0, free_mib * 256, 0, 0, 0, 0, 255))

    monkeypatch.setattr(os, "statvfs", statvfs(128))
    assert oneccl.shared_memory_shortfall(cpus=2) is None
    monkeypatch.setattr(os, "statvfs", statvfs(64))
    short = (
        "/dev/shm has 64 MiB free, and oneCCL's shared-memory transport needs 128 MiB on this machine "
        "(64 MiB per CPU, 2 CPUs): give it more (a container: docker run --shm-size=1g ...) or free some"
    )
    assert oneccl.shared_memory_shortfall(cpus=2) == short
    monkeypatch.setattr(oneccl, "available", lambda: (True, "ccl from this workshop's extension"))
    monkeypatch.setattr(oneccl, "shared_memory_shortfall", lambda: short)
    with caplog.at_level("WARNING", logger=backend.logger.name):
        assert backend.resolve_backend("auto", one_machine=True) == "gloo"
    assert [r.getMessage() for r in caplog.records] == [f"--backend auto: gloo, not ccl: {short}"]
    with pytest.raises(errors.DistributedError) as raised:
        backend.resolve_backend("ccl", one_machine=True)
    assert str(raised.value) == f"--backend ccl: {short} (or use --backend gloo)"
    assert backend.resolve_backend("auto") == backend.resolve_backend("ccl") == "ccl"  # several machines


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounting a tmpfs needs root")
def test_launch_with_ccl_refuses_a_small_dev_shm_in_one_line_before_anything(tmp_path):
    """The real check on a real small /dev/shm (Docker's default, 64 MB, mounted in a private mount
    namespace): --backend ccl is one error line and exit 2 before any file is written."""
    ok, reason = oneccl.available()
    if not ok:
        pytest.skip(f"ccl cannot be used here: {reason}")
    flags = ["--train_data_dir", str(data.sample_concept_dir()), "--output_dir", str(tmp_path / "out")]
    launch_line = shlex.join(
        [sys.executable, "-m", "helpers.launch", "--backend", "ccl", "--dry_run", "--", *flags]
    )
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64M tmpfs /dev/shm && {launch_line}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(
        r"error: --backend ccl: /dev/shm has 64 MiB free, and oneCCL's shared-memory transport needs \d+ MiB "
        r"on this machine \(64 MiB per CPU, \d+ CPUs\): give it more \(a container: docker run "
        r"--shm-size=\d+g \.\.\.\) or free some \(or use --backend gloo\)\n",
        done.stderr,
    ), done.stderr
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_job_env_is_explicit_and_ccl_adds_oneccls_variables_with_reasons():
    layout = ClusterLayout(HOSTS4, nproc_per_node=4, threads_per_process=6, network_interface="eth1")
    env = commands.job_env(layout)
    assert env == {
        "MASTER_ADDR": "node1", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "6",
        "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "eth1", "WORKSHOP_BACKEND": "gloo",
    }  # fmt: skip
    variables = oneccl.environment(4, 4, physical_cores(), 6, "eth1")
    assert commands.backend_variables(layout, "ccl") == variables
    assert commands.job_env(layout, "ccl") == {
        **env,
        "WORKSHOP_BACKEND": "ccl",
        **{n: v for n, v, _ in variables},
    }
    ccl = commands.job_env(layout, "ccl")
    assert (ccl["FI_PROVIDER"], ccl["FI_TCP_IFACE"], ccl["CCL_KVS_IFACE"]) == ("tcp", "eth1", "eth1")
    assert commands.backend_variables(layout, "gloo") == []
    (cmd,) = commands.launch_commands(
        layout, [], "mpirun", flavour=MpiFlavour.MPICH, mpirun="mpirun", backend="ccl"
    )
    assert cmd.notes == tuple(f"{n}={v}: {why}" for n, v, why in variables)
    assert "-genv FI_TCP_IFACE eth1" in cmd.shell() and "-genv WORKSHOP_BACKEND ccl" in cmd.shell()
    with pytest.raises(errors.DistributedError, match="backend='nccl'"):
        commands.job_env(layout, "nccl")


# --- commands ----------------------------------------------------------------------------------------


def test_hydra_command_syntax():
    layout = ClusterLayout(
        HOSTS4, 4, main_process_ip="10.0.0.4", threads_per_process=2, network_interface="eth0"
    )
    (intel,) = commands.launch_commands(
        layout, ["--seed", "1"], flavour=MpiFlavour.INTEL, mpirun="mpirun", hostfile="hf"
    )
    argv = list(intel.argv)
    assert argv[:8] == ["mpirun", "-l", "-f", "hf", "-n", "16", "-ppn", "4"]
    assert intel.env == {"I_MPI_HYDRA_IFACE": "eth0"}
    assert "-genv MASTER_ADDR 10.0.0.4 -genv MASTER_PORT 29500 -genv OMP_NUM_THREADS 2" in intel.shell()
    assert argv[-4:] == ["-m", "helpers.train", "--seed", "1"]
    assert argv[argv.index(sys.executable) : argv.index(sys.executable) + 3] == [
        sys.executable, "-m", "accelerate.commands.launch",
    ]  # fmt: skip
    (mpich,) = commands.launch_commands(layout, [], flavour=MpiFlavour.MPICH, mpirun="mpirun", hostfile="hf")
    assert "-iface eth0" in mpich.shell() and not mpich.env


def test_openmpi_command_syntax():
    layout = ClusterLayout(HOSTS4, 4, threads_per_process=2, network_interface="eth0")
    (cmd,) = commands.launch_commands(layout, [], flavour=MpiFlavour.OPENMPI, mpirun="mpirun", hostfile="hf")
    line = cmd.shell()
    assert "--hostfile hf -n 16 --npernode 4" in line and "--bind-to none" in line
    assert "-x MASTER_ADDR=node1 -x MASTER_PORT=29500 -x OMP_NUM_THREADS=2" in line
    assert "--mca btl_tcp_if_include eth0" in line
    assert ("--allow-run-as-root" in line) == (os.geteuid() == 0)


def test_local_commands_need_no_hostfile():
    layout = ClusterLayout.local(2)
    (hydra,) = commands.launch_commands(layout, [], flavour=MpiFlavour.INTEL, mpirun="mpirun")
    (ompi,) = commands.launch_commands(layout, [], flavour=MpiFlavour.OPENMPI, mpirun="mpirun")
    assert "-hosts localhost -n 2 -ppn 2" in hydra.shell() and "--host localhost:2 -n 2" in ompi.shell()


def test_without_config_file_the_accelerate_settings_go_inline():
    layout = ClusterLayout(HOSTS4, 2, threads_per_process=1)
    (cmd,) = commands.launch_commands(layout, [], flavour=MpiFlavour.INTEL, mpirun="mpirun")
    assert (
        "--cpu --num_machines 4 --num_processes 8 --main_process_ip node1 --main_process_port 29500"
        in cmd.shell()
    )
    (cfg,) = commands.launch_commands(
        layout, [], flavour=MpiFlavour.INTEL, mpirun="mpirun", config_file="c.yaml"
    )
    assert f"--config_file {os.path.abspath('c.yaml')} -m helpers.train" in cfg.shell()


def test_torchrun_commands_parse_with_torchruns_own_parser():
    from torch.distributed.run import get_args_parser

    layout = ClusterLayout(HOSTS4, 4, main_process_ip="10.0.0.4", threads_per_process=2)
    cmds = commands.launch_commands(layout, ["--seed", "1"], "torchrun", log_dir="run logs")
    assert [c.host for c in cmds] == list(HOSTS4) and [c.rank_offset for c in cmds] == [0, 4, 8, 12]
    for k, cmd in enumerate(cmds):
        assert cmd.argv[:3] == (sys.executable, "-m", "torch.distributed.run")
        args = get_args_parser().parse_args(list(cmd.argv[3:]))
        assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("4", k, "4")
        assert args.log_dir == os.path.abspath("run logs")  # a path with a space stays one argument
        assert (args.master_addr, args.master_port, args.module) == ("10.0.0.4", 29500, True)
        assert (args.training_script, args.training_script_args) == ("helpers.train", ["--seed", "1"])
        assert cmd.env["OMP_NUM_THREADS"] == "2" and "MASTER_ADDR" not in cmd.env


def test_bad_launcher_is_named():
    with pytest.raises(errors.DistributedError, match="launcher='srun'"):
        commands.launch_commands(ClusterLayout.local(1), [], "srun")


@pytest.mark.parametrize("flavour", list(MpiFlavour))
def test_four_nodes_by_four_processes_run_as_planned(tmp_path, fake_ssh, flavour):
    """The exact 4 x 4 command of each flavour, run on four ssh stand-ins: 16 ranks, 4 per node,
    every rank with the environment we set."""
    mpirun = mpirun_for(flavour)
    layout = ClusterLayout(
        HOSTS4, 4, main_process_ip="10.9.8.7", main_process_port=29777, threads_per_process=3
    )
    hostfile = write_hostfile(layout, tmp_path / "hostfile", flavour)
    probe = ["sh", "-c", 'echo "ON $FAKE_HOST $MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS"']
    (cmd,) = commands.launch_commands(layout, [], mpirun=mpirun, hostfile=hostfile, program=probe)
    env = dict(os.environ, **cmd.env, **SSH_OVERRIDE[flavour](str(fake_ssh)))
    env["PATH"] = f"{Path(mpirun).parent}{os.pathsep}{env['PATH']}"
    out = subprocess.run(cmd.argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    tagged = {}
    pattern = r"\[(\d+)\] " if flavour.hydra else r"\[\d+,(\d+)\]<stdout>:"
    for line in out.stdout.splitlines():
        m = re.match(pattern + r"ON (\S+) (.*)$", line)
        if m:
            tagged[int(m[1])] = (m[2], m[3])
    assert sorted(tagged) == list(range(16))
    assert all(tagged[r] == (HOSTS4[r // 4], "10.9.8.7 29777 3") for r in range(16)), tagged
    assert set((tmp_path / "ssh_hosts.log").read_text().split()) == set(HOSTS4)


# --- pre-flight ----------------------------------------------------------------------------------------


def test_preflight_on_this_machine_finds_nothing_wrong(tmp_path):
    layout = ClusterLayout(("localhost",), 2, main_process_port=free_port())
    assert preflight.preflight(layout, tmp_path) == []


def test_preflight_reports_missing_data_busy_port_and_unknown_host(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        layout = ClusterLayout(("localhost", "no-such-node.invalid"), 1, main_process_ip="localhost",
                                 main_process_port=port, threads_per_process=1)  # fmt: skip
        problems = preflight.preflight(layout, tmp_path / "missing", timeout=5)
    found = {(p.host, p.check) for p in problems}
    assert found == {("localhost", "files"), ("localhost", "port"), ("no-such-node.invalid", "ssh")}
    ssh_problem = next(p for p in problems if p.check == "ssh")
    assert "no-such-node.invalid" in ssh_problem.detail and "BatchMode" in ssh_problem.fix
    assert next(p for p in problems if p.check == "port").detail == f"port {port} is in use"


def test_preflight_over_ssh_compares_versions(tmp_path, fake_ssh):
    """Through the ssh stand-in the probe runs remotely; same interpreter, so nothing differs."""
    layout = ClusterLayout(("nodeA", "nodeB"), 1, main_process_port=free_port(), threads_per_process=1)
    assert preflight.preflight(layout, tmp_path, ssh=(str(fake_ssh),)) == []
    assert set((tmp_path / "ssh_hosts.log").read_text().split()) == {"nodeA", "nodeB"}


def test_config_form_writes_the_files_with_the_parameters_defaults(tmp_path):
    form = forms.config_form(nproc_per_node=3, main_process_port=29999, mixed_precision="no",
                         config_dir=str(tmp_path / "cfg"))  # fmt: skip
    values = [c.value for c in form.children[:5]]
    assert values == ["", 3, 29999, "no", str(tmp_path / "cfg")]
    form.children[5].click()  # what pressing the button does
    cfg = yaml.safe_load((tmp_path / "cfg" / "accelerate_config_node0.yaml").read_text())
    assert (cfg["num_processes"], cfg["main_process_port"], cfg["mixed_precision"]) == (3, 29999, "no")


def test_local_host_detection_knows_this_machines_addresses():
    assert is_local_host("localhost") and is_local_host("127.0.0.1") and is_local_host(socket.gethostname())
    assert not is_local_host("no-such-node.invalid")

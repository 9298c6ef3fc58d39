"""Two "hosts" that are network namespaces on this machine: real interfaces, real sshd, real MPI.

Each host is a Linux network namespace with two links to the other: ``mgmt0`` (10.78.0.x, where
its own sshd listens; ssh is the only thing on it) and ``data0`` (10.77.0.x, the job's network).
The namespaces share this machine's hostname, which resolves to 127.0.0.1 here: inside each
namespace its own loopback, which the other host cannot reach, so gloo's default (the address
of the hostname) would not connect them. The launcher passes the interface the nodes talk over,
as on a VM with several NICs, and the test measures that the job's bytes went over it, on gloo and
on ccl (oneCCL's tcp transport, ``FI_TCP_IFACE``/``CCL_KVS_IFACE``), and that no socket of the
job's Python processes was ever on ``mgmt0`` (``ss`` polled in both namespaces during the run).
ssh checks host keys
against a known_hosts file written here (``StrictHostKeyChecking yes``), with keys made for the
test, through an ssh config placed first on ``PATH`` for the launcher and the MPI it starts.

Needs root, ``ip`` and ``sshd`` (``make system-packages`` installs openssh-server); skips with
the reason where namespaces cannot be made (e.g. an unprivileged container).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launching import layout
from helpers.ranks import oneccl
from helpers.training import data

pytestmark = pytest.mark.slow

HOSTS = {"hostA": ("10.78.0.1", "10.77.0.1"), "hostB": ("10.78.0.2", "10.77.0.2")}  # mgmt, data
STEPS = 2


def _run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=check)


def _in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def _counters(ns: str, link: str = "data0") -> int:
    """Bytes received plus sent on ``link`` inside ``ns``."""
    out = _run(*_in_ns(ns, "cat", f"/sys/class/net/{link}/statistics/rx_bytes",
                       f"/sys/class/net/{link}/statistics/tx_bytes")).stdout  # fmt: skip
    return sum(int(v) for v in out.split())


_PYTHON_SOCKET = re.compile(r"^\S+\s+\S+\s+(\S+):\d+\s+.*users:\(\(\"python")


def _python_addresses(ns: str) -> set[str]:
    """Local addresses other than loopback of the established TCP sockets of Python processes in
    ``ns`` (``ss``), IPv4-mapped IPv6 ones as IPv4."""
    out = _run(*_in_ns(ns, "ss", "-tnpH", "state", "established"), check=False).stdout
    found = set()
    for line in out.splitlines():
        if m := _PYTHON_SOCKET.match(line):
            address = ipaddress.ip_address(m.group(1).strip("[]"))
            address = getattr(address, "ipv4_mapped", None) or address
            if not address.is_loopback:
                found.add(str(address))
    return found


def _known_host(host: str, public_key: Path) -> str:
    """A known_hosts line: the host's name and ssh address, then the key type and key."""
    kind, key = public_key.read_text().split()[:2]
    return f"{host},{HOSTS[host][0]} {kind} {key}"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for program in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(program) is None:
            return f"{program} is not installed"
    if not Path("/usr/sbin/sshd").exists():
        return "sshd is not installed (make system-packages installs openssh-server)"
    probe = f"wsprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"this machine does not allow network namespaces: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two namespaced hosts with sshd; yields (namespaces, folder with ssh config, hostfile and bin)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("netns")
    tag = f"{os.getpid() % 100000}"
    names = {host: f"ws{tag}{host[-1].lower()}" for host in HOSTS}  # ws12345a, ws12345b
    sshds: list[subprocess.Popen] = []
    try:
        for ns in names.values():
            _run("ip", "netns", "add", ns)
            _run(*_in_ns(ns, "ip", "link", "set", "lo", "up"))
        for index, link in enumerate(("mgmt0", "data0")):
            a, b = f"w{tag}{index}a", f"w{tag}{index}b"  # temporary names, renamed inside
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            for (host, ns), temp in zip(names.items(), (a, b), strict=True):
                _run("ip", "link", "set", temp, "netns", ns)
                _run(*_in_ns(ns, "ip", "link", "set", temp, "name", link))
                _run(*_in_ns(ns, "ip", "addr", "add", f"{HOSTS[host][index]}/24", "dev", link))
                _run(*_in_ns(ns, "ip", "link", "set", link, "up"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "id"))
        (root / "authorized_keys").write_text((root / "id.pub").read_text())
        known = []
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
        for host, ns in names.items():
            key = root / f"host_key_{host}"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
            known.append(_known_host(host, root / f"{key.name}.pub"))
            config = root / f"sshd_{host}.conf"
            config.write_text(
                f"ListenAddress {HOSTS[host][0]}\nHostKey {key}\nPidFile {root / f'sshd_{host}.pid'}\n"
                f"AuthorizedKeysFile {root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "AcceptEnv none\n"
            )
            with (root / f"sshd_{host}.log").open("w") as log:  # sshd keeps its own copy of the file
                sshds.append(subprocess.Popen(_in_ns(ns, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)),
                                              stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        (root / "known_hosts").write_text("\n".join(known) + "\n")
        (root / "ssh_config").write_text(
            "".join(f"Host {host}\n  HostName {mgmt}\n" for host, (mgmt, _) in HOSTS.items())
            + f"Host *\n  User root\n  IdentityFile {root / 'id'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {root / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n  LogLevel ERROR\n"
        )
        bin_dir = root / "bin"  # `ssh` for the launcher and the MPI it starts: this config, nothing else
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {root / "ssh_config"} "$@"\n')
        (bin_dir / "ssh").chmod(0o755)
        (root / "hostfile").write_text("hostA\nhostB\n")
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        deadline = time.monotonic() + 20
        for host in HOSTS:  # from hostA, each sshd answers with the key known_hosts expects
            while True:
                ok = subprocess.run(_in_ns(names["hostA"], str(bin_dir / "ssh"), host, "true"),
                                    capture_output=True, text=True, timeout=15, env=env)  # fmt: skip
                if ok.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {host} did not answer within 20 s: {ok.stderr.strip()}")
                time.sleep(0.2)
        yield {"names": names, "root": root, "env": env}
    finally:
        for proc in sshds:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for ns in names.values():
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                _run("kill", "-9", pid, check=False)
            _run("ip", "netns", "del", ns, check=False)  # removes its veth ends, and so their peers


def _launch(
    hosts, launcher: str, out: Path, *extra: str, timeout: float = 600, sockets: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m helpers.launch`` started on hostA, two nodes x one process, over data0.

    With ``sockets`` (a dict), every 0.2 s while the job runs it gathers per host the local
    addresses of the Python processes' TCP sockets."""
    root = hosts["root"]
    argv = [
        sys.executable, "-m", "helpers.launch", "--launcher", launcher, "--hostfile", str(root / "hostfile"),
        "--nproc_per_node", "1", "--threads_per_process", "1", "--network_interface", "data0",
        "--main_process_ip", HOSTS["hostA"][1], "--main_process_port", str(layout.free_port()),
        "--exit_grace_seconds", "30", *extra, "--",
        "--pretrained_model_name_or_path", "tiny", "--train_data_dir", str(data.sample_concept_dir()),
        "--placeholder_token", "<dicoo>", "--initializer_token", "toy", "--resolution", "64",
        "--max_train_steps", str(STEPS), "--train_batch_size", "1", "--seed", "0", "--mixed_precision", "no",
        "--output_dir", str(out),
    ]  # fmt: skip
    if sockets is None:
        return subprocess.run(_in_ns(hosts["names"]["hostA"], *argv), capture_output=True, text=True,
                              timeout=timeout, env=hosts["env"], cwd=out.parent)  # fmt: skip
    logs = [out.parent / f"launch_{name}.log" for name in ("stdout", "stderr")]  # files: a pipe could fill
    with logs[0].open("w") as stdout, logs[1].open("w") as stderr:
        proc = subprocess.Popen(_in_ns(hosts["names"]["hostA"], *argv), stdout=stdout, stderr=stderr,
                                text=True, env=hosts["env"], cwd=out.parent)  # fmt: skip
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            for host, ns in hosts["names"].items():
                sockets.setdefault(host, set()).update(_python_addresses(ns))
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    stdout, stderr = (log.read_text() for log in logs)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize(
    ("launcher", "backend"), [("mpirun", "gloo"), ("torchrun", "gloo"), ("mpirun", "ccl")]
)
def test_two_namespaced_hosts_train_over_the_chosen_interface(hosts, launcher, backend, tmp_path):
    if backend == "ccl" and not oneccl.available()[0]:
        pytest.skip(f"ccl cannot be used here: {oneccl.available()[1]}")
    before = {host: _counters(ns) for host, ns in hosts["names"].items()}
    sockets: dict[str, set[str]] = {}
    done = _launch(hosts, launcher, tmp_path / "run", "--backend", backend, sockets=sockets)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == STEPS and summary["backend"] == backend
    # The job's Python processes (ranks, launchers) had sockets on data0 and never on mgmt0.
    assert sockets == {host: {data} for host, (_, data) in HOSTS.items()}
    assert summary["embeddings_identical_across_ranks"] is True
    # ssh runs on mgmt0 only, so every byte on data0 is the job's: the rendezvous, the backend's
    # connections and its all-reduces (STEPS x 128 bytes at least), in both namespaces.
    moved = {host: _counters(ns) - before[host] for host, ns in hosts["names"].items()}
    assert min(moved.values()) > STEPS * summary["allreduce_bytes_per_step"], moved
    logs = {host: (hosts["root"] / f"sshd_{host}.log").read_text() for host in HOSTS}
    assert "Accepted publickey for root" in logs["hostB"]  # hostB's rank came over ssh


def test_a_host_key_that_does_not_match_is_refused_before_training(hosts, tmp_path):
    """known_hosts holds another key for hostB: the pre-flight check names ssh and the host."""
    root = hosts["root"]
    good = (root / "known_hosts").read_text()
    other = tmp_path / "other_key"
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other))
    forged = [_known_host("hostB", tmp_path / "other_key.pub") if ln.startswith("hostB,") else ln
              for ln in good.splitlines()]  # fmt: skip
    try:
        (root / "known_hosts").write_text("\n".join(forged) + "\n")
        probe = subprocess.run(
            _in_ns(hosts["names"]["hostA"], sys.executable, "-c",
                   "import json, sys; from helpers.launching.layout import ClusterLayout; "
                   "from helpers.launching.preflight import preflight; "
                   "layout = ClusterLayout.create(sys.argv[1], 1, main_process_ip=sys.argv[2]); "
                   "print(json.dumps([[p.host, p.check, p.detail] for p in preflight(layout, sys.argv[3])]))",
                   str(root / "hostfile"), HOSTS["hostA"][1], str(data.sample_concept_dir())),
            capture_output=True, text=True, timeout=300, env=hosts["env"],
        )  # fmt: skip
    finally:
        (root / "known_hosts").write_text(good)
    assert probe.returncode == 0, probe.stderr[-2000:]
    problems = json.loads(probe.stdout.strip().splitlines()[-1])
    assert [p[:2] for p in problems] == [["hostB", "ssh"]], problems
    assert "Host key verification failed" in problems[0][2]

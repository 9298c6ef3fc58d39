"""Before a job starts: can every node be reached, does it have the packages, files and a free port."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from helpers.launching.layout import ClusterLayout, is_local_host

PREFLIGHT_PACKAGES = (
    "torch",
    "ray",  # --launcher ray: every node must run the driver's Ray (and torch)
    "accelerate",
    "diffusers",
    "transformers",
    "safetensors",
    "sd-cpu-workshop-helpers",
)


_PROBE = r"""
import json, os, socket, sys
from importlib import metadata
req = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0], "packages": {}, "paths": {}, "port_free": None}
for p in req["packages"]:
    try:
        out["packages"][p] = metadata.version(p)
    except metadata.PackageNotFoundError:
        out["packages"][p] = None
for p in req["paths"]:
    out["paths"][p] = os.path.exists(p)
if req["port"]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", req["port"]))
        out["port_free"] = True
    except OSError:
        out["port_free"] = False
    s.close()
print("PROBE " + json.dumps(out))
"""


_SSH_FIX = (
    "make `ssh -o BatchMode=yes HOST true` work without a prompt: notebook 01's ssh config and key "
    "(ssh-copy-id), the right host name, the node running"
)


_PORT_FIX = "stop the process holding it (an earlier run?) or pick another main_process_port"


@dataclass(frozen=True)
class PreflightProblem:
    """Something that would stop or silently spoil a multi-node run, on one host, with the fix."""

    host: str
    check: str
    detail: str
    fix: str


def _probe(host: str, request: dict, ssh: Sequence[str], timeout: float) -> tuple[dict | None, str, int]:
    """Run the probe on ``host``; return (answer or None, last error line, exit code)."""
    cmd = [sys.executable, "-c", _PROBE, json.dumps(request)]
    if not is_local_host(host):
        cmd = [*ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}", host, shlex.join(cmd)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)
    except FileNotFoundError:
        return None, f"{cmd[0]} not found", 255
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout + 20:.0f} s", 255
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :]), "", 0
    return None, (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1], out.returncode


def preflight(
    layout: ClusterLayout,
    data_dir: str | os.PathLike,
    *,
    paths: Sequence[str | os.PathLike] = (),
    packages: Sequence[str] = PREFLIGHT_PACKAGES,
    ssh: Sequence[str] = ("ssh",),
    timeout: float = 10.0,
) -> list[PreflightProblem]:
    """Check every node before a multi-node run; return what is wrong (empty: all good).

    Per host: reachable over ssh without a password prompt (``BatchMode``), this interpreter at
    the same path, the same Python and package versions as this machine, ``data_dir`` and
    ``paths`` present; on the head node: ``main_process_port`` free. Hosts that name this
    machine are checked without ssh.

    Args:
        layout: the cluster.
        data_dir: the concept images (relative paths are taken from the current folder).
        paths: more files every node needs (e.g. the accelerate config).
        packages: distributions whose versions must match.
        ssh: the ssh command, e.g. ``("ssh", "-F", "cluster/ssh_config")``.
        timeout: seconds to wait for each ssh connection.
    """
    wanted = [os.path.abspath(p) for p in (data_dir, *paths)]
    head = layout.main_process_ip if layout.main_process_ip in layout.hosts else layout.hosts[0]
    request = {"packages": list(packages), "paths": wanted, "port": 0}
    reference, err, _ = _probe("localhost", request, ssh, timeout)
    if reference is None:
        raise RuntimeError(f"cannot probe this machine itself: {err}")
    env_fix = f"install the same environment at {sys.executable} on every node (make setup)"
    problems: list[PreflightProblem] = []
    for host in layout.hosts:
        request["port"] = int(layout.main_process_port) if host == head else 0
        got, err, code = _probe(host, request, ssh, timeout)
        found: list[tuple[str, str, str]] = []  # (check, detail, fix)
        if got is None and code == 255:  # ssh's own failures exit 255
            found.append(("ssh", err, _SSH_FIX))
        elif got is None:
            found.append(("python", f"{sys.executable} did not run: {err}", env_fix))
        else:
            if got["python"] != reference["python"]:
                found.append(("python", f"Python {got['python']}, here {reference['python']}", env_fix))
            ref = reference["packages"]
            found += [
                ("packages", f"{p} {v}, here {ref[p]}", env_fix)
                for p, v in got["packages"].items()
                if v != ref[p]
            ]
            fix = "copy it to every node at the same path: rsync -a {0} {1}:{0}"
            found += [
                ("files", f"{f} is missing", fix.format(f, host)) for f, ok in got["paths"].items() if not ok
            ]
            if got["port_free"] is False:
                found.append(("port", f"port {layout.main_process_port} is in use", _PORT_FIX))
        problems += [PreflightProblem(host, *f) for f in found]
    return problems

"""Reaching the cluster once it exists: its state (nodes, IPs), ssh config, hostfile, host keys."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from helpers.cluster.azure.spec import ClusterSpec
from helpers.core.errors import InputError
from helpers.core.files import write_text_atomic


class ClusterStateError(InputError):
    """A cluster state (names and IPs of the nodes) is missing or malformed."""


@dataclass(frozen=True)
class Node:
    """One VM of the cluster as Azure reports it."""

    name: str
    role: str
    private_ip: str
    public_ip: str | None = None
    power_state: str = ""


def _first(ips: str | None) -> str:
    return str(ips or "").split(",")[0]  # a VM with several NICs reports "ip1,ip2"


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class ClusterState:
    """Names and IPs of the nodes: what ssh config, hostfile and notebook 04 need."""

    resource_group: str
    admin_user: str
    nodes: tuple[Node, ...]

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @classmethod
    def from_vm_list(cls, rows: Iterable[Mapping[str, Any]] | None) -> ClusterState:
        """Build the state from ``az vm list --show-details --query STATE_QUERY`` rows."""
        rows = list(rows or [])
        heads = [r for r in rows if r.get("role") == "head"]
        if len(heads) != 1:
            raise ClusterStateError(
                f"expected exactly one VM tagged role=head, found {len(heads)} among {rows}"
            )
        ordered = heads + sorted((r for r in rows if r is not heads[0]), key=lambda r: _natural(r["name"]))
        nodes = [Node(r["name"], r.get("role") or "worker", _first(r["private_ip"]), _first(r.get("public_ip")) or None,
                      r.get("power_state") or "") for r in ordered]  # fmt: skip
        return cls(heads[0]["resource_group"], heads[0]["admin_user"], tuple(nodes))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the state as JSON, atomically (temporary name, then rename)."""
        return write_text_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ClusterState:
        """Read a state written by :meth:`save` or by the dry-run script (raw ``vm list`` rows)."""
        path = Path(path)
        if not path.is_file():
            raise ClusterStateError(
                f"{path} does not exist. Fix: create the cluster first (apply with execute)"
            )
        data = json.loads(path.read_text())
        if isinstance(data, list):
            return cls.from_vm_list(data)
        return cls(data["resource_group"], data["admin_user"], tuple(Node(**n) for n in data["nodes"]))


def _ssh_value(text: str) -> str:
    return f'"{text}"' if " " in text else text


def ssh_config(state: ClusterState, identity_file: str, known_hosts: str) -> str:
    """An ssh config: the head by its public IP, workers by private IP through the head.

    Args:
        state: the cluster.
        identity_file: the private key (``ClusterSpec.private_key``).
        known_hosts: the project's known_hosts file (filled by :func:`collect_host_keys`).

    Returns:
        The text of the file; use it as ``ssh -F <file> <node name>``.
    """
    lines = [
        f"# ssh config of the workshop cluster in resource group {state.resource_group} (helpers.cluster.azure).",
        "# Use: ssh -F <this file> <node name>. Host keys are checked against the project known_hosts.",
    ]
    for node in state.nodes:
        lines += [
            "",
            f"Host {node.name}",
            f"    HostName {node.public_ip if node is state.head else node.private_ip}",
        ]
        if node is not state.head:
            lines.append(f"    ProxyJump {state.head.name}")
        lines += [
            f"    User {state.admin_user}",
            f"    IdentityFile {_ssh_value(identity_file)}",
            "    IdentitiesOnly yes",
        ]
        lines += [f"    UserKnownHostsFile {_ssh_value(known_hosts)}", "    StrictHostKeyChecking yes"]
    return "\n".join(lines) + "\n"


def hostfile(state: ClusterState) -> str:
    """One private IP per line, head first: the hosts ``mpirun`` (run on the head) starts ranks on."""
    return "".join(f"{node.private_ip}\n" for node in state.nodes)


def known_hosts_commands(state: ClusterState, ssh_config_path: str) -> list[list[str]]:
    """The two scans that fill the project known_hosts, in order.

    First the head, directly (trust on first use of its public IP); then every node's private IP,
    scanned *from* the head through an ssh connection that already checks the head's key.
    """
    head_scan = ["ssh-keyscan", "-t", "ed25519", str(state.head.public_ip)]
    inner = ["ssh-keyscan", "-t", "ed25519", *(n.private_ip for n in state.nodes)]
    return [head_scan, ["ssh", "-F", ssh_config_path, state.head.name, shlex.join(inner)]]


def collect_host_keys(state: ClusterState, ssh_config_path: str, known_hosts: str) -> Path:
    """Run :func:`known_hosts_commands` and write the known_hosts file (needs real VMs)."""
    text = ""
    for argv in known_hosts_commands(state, ssh_config_path):
        if text:
            write_text_atomic(Path(known_hosts), text)  # the second scan's ssh checks the head's key
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if out.returncode != 0 or not out.stdout.strip():
            raise RuntimeError(f"{shlex.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        text += out.stdout
    return write_text_atomic(Path(known_hosts), text)


def verify_nodes(state: ClusterState, ssh_config_path: str) -> dict[str, str]:
    """Wait for cloud-init on every node over ssh; return each node's ``cloud-init status`` (needs real VMs)."""
    status = {}
    for node in state.nodes:
        argv = ["ssh", "-F", ssh_config_path, node.name, "cloud-init status --wait"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"{node.name}: {shlex.join(argv)} failed: {out.stdout}{out.stderr}".strip())
        status[node.name] = out.stdout.strip()
    return status


def write_cluster_files(spec: ClusterSpec, state: ClusterState) -> dict[str, Path]:
    """Write ``ssh_config`` and ``hostfile`` into ``spec.output_dir``; return their paths and known_hosts'."""
    out = Path(spec.output_dir).resolve()
    known_hosts = out / "known_hosts"
    config = ssh_config(state, spec.private_key, str(known_hosts))
    return {
        "ssh_config": write_text_atomic(out / "ssh_config", config),
        "hostfile": write_text_atomic(out / "hostfile", hostfile(state)),
        "known_hosts": known_hosts,
    }

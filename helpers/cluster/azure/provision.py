"""Create and delete the cluster: :func:`plan` (the ordered ``az`` commands), :func:`to_script`,
:func:`apply` (print them, or run them skipping what exists) and :func:`teardown`.

Every node boots with the same cloud-init (:func:`cloud_init`): the workshop environment
(``make setup``, which installs the pinned Ray with everything else), then Ray as a systemd
service: ``ray start --head`` on the head node, ``ray start --address HEAD:6379`` on the workers,
each bound to its private address (:func:`ray_start_commands`). Ray's ports are reachable only
inside the subnet: the network security group allows node-to-node traffic there and nothing else
but SSH from ``ssh_source_cidr``. Not testable here: cloud-init and Ray on real VMs (the tests check
the rendered text).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import yaml

from helpers.cluster import prices as azure_data
from helpers.cluster.azure import azcli
from helpers.cluster.azure.access import ClusterState
from helpers.cluster.azure.azcli import NOT_FOUND_EXIT_CODE, AzCommand, AzCommandError
from helpers.cluster.azure.spec import PLACEHOLDER, AzureSpecError, ClusterSpec
from helpers.core.files import write_text_atomic

logger = logging.getLogger(__name__)

STATE_QUERY = (
    "[].{name:name, role:tags.role, private_ip:privateIps, public_ip:publicIps, "
    "power_state:powerState, admin_user:osProfile.adminUsername, resource_group:resourceGroup}"
)
_HEREDOC_END = "AZ_PLAN_FILE_EOF"


# PyTorch's own index of CPU-only wheels: on the nodes, `torch==2.13.0` from the Python package
# registry alone would be the multi-GB CUDA build; the CPU index offers 2.13.0+cpu, which pip prefers.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
RAY_PORT = 6379  # the head's GCS port: --ray_address HEAD:6379 (or auto on the head)
RAY_SERVICE = "workshop-ray"
RAY_START_SCRIPT = "/usr/local/bin/workshop-ray-start"
# Ray's CPU count = physical cores, as helpers.launch counts threads (hyper-threads do not speed up GEMMs).
_PHYSICAL_CORES = "$(lscpu -p=Core,Socket | grep -v '^#' | sort -u | wc -l)"


def ray_start_commands(spec: ClusterSpec) -> dict[str, str]:
    """The ``ray start`` of each node, by node name: ``--head`` on the head, ``--address`` on the others.

    Each binds to the node's private address; dashboard and usage statistics off. Ray's token
    authentication is off: only the cluster's own VMs can reach these ports (the subnet's network
    security group), and ``helpers.launch --launcher ray --ray_address auto`` runs on the head.
    """
    ray = f"/home/{spec.admin_user}/workshop/.venv/bin/ray"
    head_ip = spec.node_ips[0]
    common = f"--node-ip-address={{ip}} --num-cpus={_PHYSICAL_CORES} --disable-usage-stats --block"
    head = f"{ray} start --head --port={RAY_PORT} --include-dashboard=false {common}"
    worker = f"{ray} start --address={head_ip}:{RAY_PORT} {common}"
    return {
        name: (head if i == 0 else worker).format(ip=ip)
        for i, (name, ip) in enumerate(zip(spec.node_names, spec.node_ips, strict=True))
    }


def _ray_files(spec: ClusterSpec) -> list[dict[str, str]]:
    """The start script (the node picks its own line by its private address) and its systemd unit."""
    commands = ray_start_commands(spec)
    branches = "\n".join(
        f"  {ip}) exec {commands[name]} ;;" for name, ip in zip(spec.node_names, spec.node_ips, strict=True)
    )
    script = f"""#!/bin/bash
# Ray on this node, bound to its private address: the head starts the cluster, the others join it.
set -euo pipefail
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
for ip in $(hostname -I); do
  case "$ip" in
{branches}
  esac
done
echo "none of this node's addresses ($(hostname -I)) is in the cluster spec" >&2
exit 1
"""
    unit = f"""[Unit]
Description=Ray for the workshop (head or worker, by private address)
After=network-online.target
Wants=network-online.target

[Service]
User={spec.admin_user}
ExecStart={RAY_START_SCRIPT}
ExecStopPost=/home/{spec.admin_user}/workshop/.venv/bin/ray stop --force
# a worker that boots before the head retries until the head answers
Restart=on-failure
RestartSec=15

[Install]
WantedBy=multi-user.target
"""
    return [
        {"path": RAY_START_SCRIPT, "permissions": "0755", "content": script},
        {"path": f"/etc/systemd/system/{RAY_SERVICE}.service", "permissions": "0644", "content": unit},
    ]


def cloud_init(spec: ClusterSpec) -> str:
    """The cloud-config every node boots with: system packages, the repo, ``make setup`` (the
    pinned environment, Ray and the oneCCL wheels included), the ``ccl`` backend built again on its
    own (``make setup`` only notes a failed build; here it fails the node's setup, since every job
    on the cluster runs on ccl as the guides do; a second build is a cache hit), then Ray as the
    ``workshop-ray`` service (see :func:`ray_start_commands`)."""
    home = f"/home/{spec.admin_user}"
    setup = (
        f"set -e; cd {home}; git clone --depth 1 --branch {shlex.quote(spec.repo_ref)} "
        f"{shlex.quote(spec.repo_url)} workshop; PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX} make -C workshop setup; "
        "workshop/.venv/bin/python -m helpers.ranks.oneccl build"
    )
    config = {
        "package_update": True,
        "packages": ["git", "make", "python3-venv", "python3-pip", "build-essential"],
        "write_files": _ray_files(spec),
        "runcmd": [
            ["sudo", "-u", spec.admin_user, "-H", "bash", "-c", setup],
            ["systemctl", "enable", "--now", f"{RAY_SERVICE}.service"],
        ],
        "final_message": "workshop environment ready after $UPTIME s",
    }
    return "#cloud-config\n" + yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=1000)


class _Dumper(yaml.SafeDumper):
    """Safe YAML with files' contents as literal blocks (``|``), readable in the reviewed script."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def _flags(**values: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """``_flags(address_prefixes="10.0.0.0/16", tags=("a=b",))`` -> ``("--address-prefixes", ...)``."""
    argv: tuple[str, ...] = ()
    for name, value in values.items():
        if value is not None and value != ():
            argv += (f"--{name.replace('_', '-')}", *((value,) if isinstance(value, str) else value))
    return argv


def plan(spec: ClusterSpec) -> list[AzCommand]:
    """The ordered ``az`` commands that create the cluster described by ``spec``.

    Nothing runs here; :func:`apply` runs or prints the plan.
    """
    p, rg, loc, subnet_prefix = spec.name_prefix, spec.resource_group, spec.location, spec.subnet_prefix
    tags = tuple(f"{k}={v}" for k, v in spec.tags.items())
    nsg, vnet, subnet, nat, nat_ip, key = (
        f"{p}-{s}" for s in ("nsg", "vnet", "subnet", "nat", "nat-ip", "key")
    )
    pub_key = str(Path(spec.ssh_public_key).expanduser())
    custom_data = str(Path(spec.output_dir) / "cloud-init.yaml")
    row = azure_data.size_series(spec.vm_size)

    def create(what: str, name: str, why: str, parent: tuple[str, ...] = (), upsert: bool = False, **kw: Any):
        """``az <what> create`` in the resource group, checked by the matching ``show``."""
        extra = {k: kw.pop(k) for k in ("writes", "needs") if k in kw}
        where = ("--resource-group", rg, *parent, "--name", name)
        argv = (*what.split(), "create", *where, *_flags(**kw))
        verify = (*what.split(), "show", *where, "--output", "none")
        return AzCommand(argv, why, True, verify, skip_if_found=not upsert, **extra)

    def rule(
        name: str, priority: int, access: str, protocol: str, source: str, dest: str, ports: str, why: str
    ):
        return create(
            "network nsg rule", name, why, ("--nsg-name", nsg), upsert=True, priority=str(priority),
            direction="Inbound", access=access, protocol=protocol, source_address_prefixes=source,
            source_port_ranges="*", destination_address_prefixes=dest, destination_port_ranges=ports,
        )  # fmt: skip

    group = ("group", "create", "--name", rg, "--location", loc, *_flags(tags=tags))
    steps = [
        AzCommand(group, f"resource group {rg} in {loc}: holds everything, so teardown is one delete", True,
                  ("group", "show", "--name", rg, "--output", "none")),
        create("network nsg", nsg, f"network security group {nsg} for the subnet (no per-VM NSG opening SSH)",
               location=loc, tags=tags),
        rule("allow-ssh-from-admin", 100, "Allow", "Tcp", spec.ssh_source_cidr, subnet_prefix, "22",
             f"SSH (port 22) only from {spec.ssh_source_cidr}"),
        rule("allow-intra-subnet", 200, "Allow", "*", subnet_prefix, subnet_prefix, "*",
             f"node-to-node traffic (MPI, gloo) only inside {subnet_prefix}"),
        rule("deny-all-other-inbound", 4096, "Deny", "*", "*", "*", "*",
             "deny every other inbound flow, including Azure's default allow-from-VirtualNetwork"),
        create("network vnet", vnet, f"virtual network {vnet} ({spec.vnet_prefix})",
               location=loc, address_prefixes=spec.vnet_prefix, tags=tags),
        create("network public-ip", nat_ip, f"public IP {nat_ip} of the NAT gateway (outbound only)",
               location=loc, sku="Standard", allocation_method="Static"),
        create("network nat gateway", nat, f"NAT gateway {nat}: outbound internet for workers without public "
               "IPs (apt, git, pip); new subnets no longer get Azure's implicit default outbound access",
               location=loc, public_ip_addresses=nat_ip),
        create("network vnet subnet", subnet, f"subnet {subnet} ({subnet_prefix}) behind {nsg} and {nat}",
               ("--vnet-name", vnet), address_prefixes=subnet_prefix, network_security_group=nsg, nat_gateway=nat),
        create("sshkey", key, f"SSH public key {key} from {pub_key}, uploaded once, used by every node",
               location=loc, public_key=f"@{pub_key}",
               needs={pub_key: f"create it with: ssh-keygen -t ed25519 -f {pub_key.removesuffix('.pub')}"}),
    ]  # fmt: skip
    for i, (name, ip) in enumerate(zip(spec.node_names, spec.node_ips, strict=True)):
        head = i == 0
        why = (
            "head node, the only one with a public IP"
            if head
            else "worker, no public IP (ProxyJump via head)"
        )
        steps.append(create(
            "vm", name, f"{name} ({spec.vm_size}, {ip}): {why}", location=loc, size=spec.vm_size,
            image=spec.image, admin_username=spec.admin_user, authentication_type="ssh", ssh_key_name=key,
            vnet_name=vnet, subnet=subnet, private_ip_address=ip, nsg="",  # "": no NIC-level NSG
            public_ip_address=f"{name}-ip" if head else "", public_ip_sku="Standard" if head else None,
            storage_sku="StandardSSD_LRS", os_disk_size_gb=str(spec.os_disk_gb), custom_data=custom_data,
            accelerated_networking="true" if row and row.accelerated_networking else None,
            tags=(f"role={'head' if head else 'worker'}", *tags), writes={custom_data: cloud_init(spec)},
        ))  # fmt: skip
    steps.append(_read_state(spec))
    return steps


def _read_state(spec: ClusterSpec) -> AzCommand:
    """The plan's last step: the nodes' names, IPs and power states into ``<output_dir>/state.json``."""
    query = ("vm", "list", "--resource-group", spec.resource_group, "--show-details", "--query", STATE_QUERY,
             "--output", "json")  # fmt: skip
    return AzCommand(query, "read names, IPs and power states of the nodes into the state file", False,
                     saves_state=str(Path(spec.output_dir) / "state.json"))  # fmt: skip


def teardown_plan(spec: ClusterSpec) -> list[AzCommand]:
    """The one command that deletes the cluster: its whole resource group."""
    rg = spec.resource_group
    argv, verify = (
        ("group", "delete", "--name", rg, "--yes"),
        ("group", "show", "--name", rg, "--output", "none"),
    )
    return [
        AzCommand(argv, f"delete resource group {rg} and everything in it", True, verify, skip_if_found=False)
    ]


def format_plan(commands: Sequence[AzCommand]) -> str:
    """A numbered, readable listing of a plan (what, whether it changes anything, the command)."""
    lines = []
    for i, cmd in enumerate(commands, 1):
        kind = "creates/changes" if cmd.mutating else "reads"
        lines += [f"{i:>2}. [{kind}] {cmd.description}", f"    {cmd.shell()}"]
    return "\n".join(lines)


def _placeholders(commands: Sequence[AzCommand]) -> list[str]:
    found: list[str] = []
    for cmd in commands:
        for text in (*cmd.argv, *cmd.writes.values()):
            found += [m for m in PLACEHOLDER.findall(text) if m not in found]
    return found


def to_script(commands: Sequence[AzCommand]) -> str:
    """The plan as a bash script a person can review and run (after ``az login``)."""
    q = shlex.quote
    lines = [
        "#!/usr/bin/env bash",
        "# Generated by helpers.cluster.azure (dry run). Review it; it creates billable Azure resources.",
        "set -euo pipefail",
    ]
    if missing := _placeholders(commands):
        lines += [f"echo {q('fill in the placeholders first: ' + ' '.join(missing))} >&2", "exit 1"]
    for cmd in commands:
        for path, fix in cmd.needs.items():
            lines.append(f"test -f {q(path)} || {{ echo {q(f'missing {path}: {fix}')} >&2; exit 1; }}")
    written: set[str] = set()
    for i, cmd in enumerate(commands, 1):
        lines += ["", f"# {i}/{len(commands)}: {cmd.description}"]
        for path, content in cmd.writes.items():
            if path not in written:
                written.add(path)
                end = _HEREDOC_END
                while end in content:  # the end marker must not occur in the file
                    end += "_"
                lines += [f"mkdir -p {q(str(Path(path).parent))}", f"cat > {q(path)} <<'{end}'"]
                lines += [content.rstrip("\n"), end]
        call = cmd.shell()
        if cmd.saves_state:  # a temporary name, then a rename: no half-written state file
            tmp = cmd.saves_state + ".tmp"
            lines += [f"mkdir -p {q(str(Path(cmd.saves_state).parent))}", f"{call} > {q(tmp)}"]
            call = f"mv {q(tmp)} {q(cmd.saves_state)}"
        if cmd.mutating and cmd.verify and cmd.skip_if_found:
            lines += [
                f"if az {shlex.join(cmd.verify)} 2>/dev/null; then",
                f"  echo {q('exists: ' + cmd.description)}",
            ]
            lines += ["else", f"  {call}", "fi"]
        else:
            lines.append(call)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply` did: steps run, steps skipped (already there), the state it saved."""

    ran: list[int]
    skipped: list[int]
    state: ClusterState | None


@overload
def apply(commands: Sequence[AzCommand], dry_run: Literal[True] = ...) -> str: ...
@overload
def apply(commands: Sequence[AzCommand], dry_run: Literal[False]) -> ApplyResult: ...
def apply(commands: Sequence[AzCommand], dry_run: bool = True) -> str | ApplyResult:
    """Print or run a plan.

    Args:
        commands: usually ``plan(spec)``.
        dry_run: True (default) changes nothing and returns the plan as a bash script. False runs
            each step in order through azure-cli in-process: a mutating step whose ``verify``
            finds its resource is skipped; the first failure stops everything.

    Returns:
        The script (dry run), or an :class:`ApplyResult` whose state was also written,
        atomically, to the ``saves_state`` path.

    Raises:
        AzureSpecError: placeholders left in the plan or a needed file missing (before any step).
        AzCommandError: a step failed; its message has az's error.
    """
    if dry_run:
        return to_script(commands)
    if missing := _placeholders(commands):
        raise AzureSpecError(
            f"the plan still contains placeholders {missing}. Fix: set real values in cluster.yaml"
        )
    for cmd in commands:
        for path, fix in cmd.needs.items():
            if not Path(path).is_file():
                raise AzureSpecError(f"{path} does not exist. Fix: {fix}")
    done: list[int] = []
    ran: list[int] = []
    state = None
    for i, cmd in enumerate(commands, 1):
        if cmd.mutating and cmd.verify and cmd.skip_if_found:
            found = azcli.run_az(cmd.verify)
            if found.exit_code == 0:
                logger.info("step %d/%d exists, skipped: %s", i, len(commands), cmd.description)
                done.append(i)
                continue
            if found.exit_code != NOT_FOUND_EXIT_CODE:
                raise AzCommandError(i, cmd, cmd.verify, found, done)
        for path, content in cmd.writes.items():
            write_text_atomic(Path(path), content)
        logger.info("step %d/%d: %s", i, len(commands), cmd.description)
        result = azcli.run_az(cmd.argv)
        if result.exit_code != 0:
            raise AzCommandError(i, cmd, cmd.argv, result, done)
        done.append(i)
        ran.append(i)
        if cmd.saves_state:
            state = ClusterState.from_vm_list(result.value)
            state.save(cmd.saves_state)
    return ApplyResult(ran=ran, skipped=[i for i in done if i not in ran], state=state)


def teardown(spec: ClusterSpec, confirm: str | None = None) -> None:
    """Delete the cluster's resource group and everything in it (waits until it is gone).

    Ray goes with the VMs (each node's ``workshop-ray`` service runs ``ray stop`` when it stops).

    Args:
        spec: the cluster.
        confirm: must equal ``spec.resource_group``: deleting is not undoable.

    Raises:
        AzureSpecError: ``confirm`` missing or different (nothing is deleted).
        AzCommandError: az failed to delete.
    """
    if confirm != spec.resource_group:
        raise AzureSpecError(
            f"confirm={confirm!r}: teardown deletes resource group {spec.resource_group!r} and every resource "
            f"in it. Fix: pass confirm={spec.resource_group!r} to proceed"
        )
    (cmd,) = teardown_plan(spec)
    result = azcli.run_az(cmd.argv)
    if result.exit_code == NOT_FOUND_EXIT_CODE:
        logger.info("resource group %s does not exist: nothing to delete", spec.resource_group)
    elif result.exit_code != 0:
        raise AzCommandError(1, cmd, cmd.argv, result, [])
    (Path(spec.output_dir) / "state.json").unlink(missing_ok=True)

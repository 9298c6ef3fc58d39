"""The workshop's CPU cluster on Azure, as code: plan it, create it, reach it, delete it.

One :class:`ClusterSpec` (a YAML file) describes the cluster. :func:`plan` turns it into an
ordered list of ``az`` commands a person can read before anything costs money;
:func:`apply` prints them as a bash script (``dry_run=True``, the default) or runs them through
azure-cli's in-process API, skipping what already exists and stopping at the first failure.
:func:`ssh_config`, :func:`hostfile` and :func:`collect_host_keys` give notebook 04 its nodes;
:func:`teardown` deletes everything (it insists on an explicit confirmation).

Security by default: SSH is allowed only from ``ssh_source_cidr`` (required, never
``0.0.0.0/0``), nodes talk to each other only inside their subnet, everything else inbound is
denied; only the head node has a public IP and workers are reached through it (``ProxyJump``);
host keys go into a project ``known_hosts`` and are checked (never ``StrictHostKeyChecking no``).
Every node installs the same workshop environment with cloud-init (clone + ``make setup``),
which replaces the snapshot/image cloning of the original guide.

What cannot be exercised on the development machines (no Azure subscription, no web access):
creating real resources, the ``show``-based skipping against real resources, the state read
back from real VMs, ssh and ``ssh-keyscan`` into them, cloud-init on a node, and the prices.
The tests check every planned command against the real ``az`` parser offline, the script, the
failure handling through the in-process CLI, and the exact ssh config and hostfile.
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import json
import logging
import os
import re
import shlex
import subprocess
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, overload

import yaml

from helpers import azure_data
from helpers.files import write_text_atomic

logger = logging.getLogger(__name__)

PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>")
OPEN_TO_EVERYONE = {"*", "0.0.0.0", "0.0.0.0/0", "::/0", "internet", "any"}
NOT_FOUND_EXIT_CODE = 3  # what `az ... show` exits with when the resource does not exist
STATE_QUERY = (
    "[].{name:name, role:tags.role, private_ip:privateIps, public_ip:publicIps, "
    "power_state:powerState, admin_user:osProfile.adminUsername, resource_group:resourceGroup}"
)
_HEREDOC_END = "AZ_PLAN_FILE_EOF"


class AzureSpecError(ValueError):
    """A cluster setting (or a file it names) is invalid; the message names it and the fix."""


class ClusterStateError(ValueError):
    """A cluster state (names and IPs of the nodes) is missing or malformed."""


class UnknownVmSizeWarning(UserWarning):
    """The VM size is not in the capability table, so native bf16 support is unknown."""


@dataclass
class ClusterSpec:
    """Everything that describes the cluster. Field names are the keys of ``cluster.yaml``.

    ``node_count`` counts every node: one head (with a public IP) and ``node_count - 1`` workers.
    Values such as ``<YOUR_PUBLIC_IP>/32`` are placeholders: fine for a plan, refused by
    :func:`apply` when it executes.
    """

    ssh_source_cidr: str
    resource_group: str = "sd-workshop-rg"
    location: str = "eastus"
    vm_size: str = "Standard_D8_v5"
    node_count: int = 2
    image: str = "Debian:debian-12:12-gen2:latest"  # Debian 12: Python 3.11, like the dev machines
    admin_user: str = "azureuser"
    ssh_public_key: str = "~/.ssh/id_ed25519.pub"
    name_prefix: str = "sdw"
    vnet_prefix: str = "10.42.0.0/16"
    subnet_prefix: str = "10.42.1.0/24"
    os_disk_gb: int = 64
    repo_url: str = "https://github.com/<YOUR_ORG>/<YOUR_REPO>.git"
    repo_ref: str = "main"
    output_dir: str = "cluster"
    tags: dict[str, str] = field(default_factory=lambda: {"project": "sd-cpu-workshop"})

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def head_name(self) -> str:
        return f"{self.name_prefix}-head"

    @property
    def node_names(self) -> list[str]:
        """Head first, then ``<prefix>-worker-1`` ... ``<prefix>-worker-<node_count-1>``."""
        return [self.head_name] + [f"{self.name_prefix}-worker-{i}" for i in range(1, self.node_count)]

    @property
    def node_ips(self) -> list[str]:
        """Static private IPs, in :attr:`node_names` order (Azure reserves the first 4 of a subnet)."""
        net = ipaddress.ip_network(self.subnet_prefix)
        return [str(net.network_address + 4 + i) for i in range(self.node_count)]

    @property
    def private_key(self) -> str:
        """The private key next to :attr:`ssh_public_key` (ssh's ``IdentityFile``)."""
        return self.ssh_public_key.removesuffix(".pub")

    def placeholders(self) -> list[str]:
        """Names of the fields that still hold a ``<PLACEHOLDER>``."""
        return [f.name for f in fields(self) if PLACEHOLDER.search(str(getattr(self, f.name)))]


def _matches(pattern: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and re.fullmatch(pattern, value) is not None


def _integer(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


# field: (is it valid?, the problem, the fix); checked in this order
_CHECKS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "node_count": (_integer(1, 1000), "must be an integer >= 1", "1 head node plus the workers you need"),
    "resource_group": (_matches(r"[-\w.()]{1,89}[-\w()]"), "not a resource group name", "use letters, digits, -_.()"),
    "location": (_matches(r"[a-z0-9]+"), "not an Azure region name", "e.g. eastus (az account list-locations)"),
    "vm_size": (_matches(r"Standard_\w+"), "not an Azure VM size", "e.g. Standard_D8_v5 or Standard_D8s_v6"),
    "name_prefix": (_matches(r"[a-z][a-z0-9-]{0,14}"), "must be 1-15 of a-z, 0-9, '-'", "e.g. sdw"),
    "admin_user": (lambda v: _matches(r"[a-z_][a-z0-9_-]{0,31}")(v) and v not in {"root", "admin"},
                   "not an allowed Linux user name on Azure", "e.g. azureuser"),
    "os_disk_gb": (_integer(30, 4095), "must be an integer from 30 to 4095", "64 fits the workshop"),
    "image": (_matches(r"\S+"), "not an image name or URN", "e.g. Debian:debian-12:12-gen2:latest"),
    "ssh_public_key": (_matches(r".+\.pub"), "not a public key file (*.pub)", "e.g. ~/.ssh/id_ed25519.pub"),
    "tags": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
             "must map names to strings", "e.g. {project: sd-cpu-workshop}"),
}  # fmt: skip


def _validate(spec: ClusterSpec) -> None:
    """Check every field; raise one :class:`AzureSpecError` naming the first bad one and its fix."""
    cidr = str(spec.ssh_source_cidr).strip()
    world = (
        f"ssh_source_cidr={cidr!r}: this opens SSH to the whole internet. Fix: use your public IP as a /32"
    )
    if cidr.lower() in OPEN_TO_EVERYONE:
        raise AzureSpecError(world)
    if not PLACEHOLDER.search(cidr):
        try:
            net = ipaddress.ip_network(cidr, strict=True)
        except ValueError as err:
            raise AzureSpecError(
                f"ssh_source_cidr={cidr!r}: not a CIDR ({err}). Fix: e.g. 203.0.113.7/32"
            ) from None
        if net.prefixlen == 0:
            raise AzureSpecError(world)
        if net.version == 4 and net.prefixlen < 16:
            warnings.warn(
                f"ssh_source_cidr={cidr} allows SSH from {net.num_addresses} addresses", stacklevel=4
            )
    for name, (valid, problem, fix) in _CHECKS.items():
        if not valid(value := getattr(spec, name)):
            raise AzureSpecError(f"{name}={value!r}: {problem}. Fix: {fix}")
    if azure_data.size_series(spec.vm_size) is None:
        warnings.warn(azure_data.bf16_advice(spec.vm_size), UnknownVmSizeWarning, stacklevel=4)
    try:
        vnet, subnet = ipaddress.ip_network(spec.vnet_prefix), ipaddress.ip_network(spec.subnet_prefix)
    except ValueError as err:
        raise AzureSpecError(
            f"vnet_prefix/subnet_prefix: {err}. Fix: e.g. 10.42.0.0/16 and 10.42.1.0/24"
        ) from None
    if not subnet.subnet_of(vnet):
        raise AzureSpecError(
            f"subnet_prefix={spec.subnet_prefix!r}: not inside {spec.vnet_prefix}. Fix: a sub-range"
        )
    if spec.node_count > subnet.num_addresses - 5:  # Azure reserves 5 addresses per subnet
        raise AzureSpecError(
            f"node_count={spec.node_count}: does not fit in {subnet}. Fix: a larger subnet_prefix"
        )


def load_spec(path: str | os.PathLike) -> ClusterSpec:
    """Read a :class:`ClusterSpec` from YAML (see ``notebooks/cluster.example.yaml``).

    Raises:
        AzureSpecError: no such file, unknown keys, no ``ssh_source_cidr`` or an invalid value.
    """
    if not Path(path).is_file():
        raise AzureSpecError(
            f"{path} does not exist. Fix: copy notebooks/cluster.example.yaml and fill it in"
        )
    data = yaml.safe_load(Path(path).read_text()) or {}
    known = [f.name for f in fields(ClusterSpec)]
    if not isinstance(data, dict) or set(data) - set(known):
        extra = sorted(set(data) - set(known)) if isinstance(data, dict) else data
        raise AzureSpecError(f"{path}: unknown keys {extra}. Fix: use only {known}")
    if "ssh_source_cidr" not in data:
        raise AzureSpecError(
            f"{path}: ssh_source_cidr is required (there is no open-to-the-world default). "
            "Fix: add `ssh_source_cidr: <your public IP>/32`; `curl -s https://ifconfig.me` shows your IP"
        )
    return ClusterSpec(**data)


@dataclass(frozen=True)
class AzCommand:
    """One step of a plan: ``az <argv>`` plus what a reader and :func:`apply` need to know.

    Attributes:
        argv: the arguments after ``az``.
        description: what the step does and why, for people.
        mutating: whether it creates or changes something (and may cost money).
        verify: an ``az ... show`` that exits 0 when the resource exists and 3 when it does not.
        skip_if_found: skip the step when ``verify`` finds the resource. False for upserts
            (NSG rules), so a changed rule, e.g. a new ``ssh_source_cidr``, is applied on re-run.
        writes: local files (path -> content) generated just before the step runs.
        needs: local files (path -> how to create it) that must exist before anything runs.
        saves_state: path of the state file this step's JSON result becomes.
    """

    argv: tuple[str, ...]
    description: str
    mutating: bool
    verify: tuple[str, ...] | None = None
    skip_if_found: bool = True
    writes: Mapping[str, str] = field(default_factory=dict)
    needs: Mapping[str, str] = field(default_factory=dict)
    saves_state: str | None = None

    def shell(self) -> str:
        """The command as one shell-quoted line."""
        return "az " + shlex.join(self.argv)


# PyTorch's own index of CPU-only wheels: on the nodes, `torch==2.13.0` from the Python package
# registry alone would be the multi-GB CUDA build; the CPU index offers 2.13.0+cpu, which pip prefers.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def cloud_init(spec: ClusterSpec) -> str:
    """The cloud-config every node boots with: system packages, the repo, ``make setup``."""
    home = f"/home/{spec.admin_user}"
    setup = (
        f"set -e; cd {home}; git clone --depth 1 --branch {shlex.quote(spec.repo_ref)} "
        f"{shlex.quote(spec.repo_url)} workshop; PIP_EXTRA_INDEX_URL={TORCH_CPU_INDEX} make -C workshop setup"
    )
    config = {
        "package_update": True,
        "packages": ["git", "make", "python3-venv", "python3-pip", "build-essential"],
        "runcmd": [["sudo", "-u", spec.admin_user, "-H", "bash", "-c", setup]],
        "final_message": "workshop environment ready after $UPTIME s",
    }
    return "#cloud-config\n" + yaml.safe_dump(config, sort_keys=False, width=1000)


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
    query = (
        "vm",
        "list",
        "--resource-group",
        rg,
        "--show-details",
        "--query",
        STATE_QUERY,
        "--output",
        "json",
    )
    state_file = str(Path(spec.output_dir) / "state.json")
    steps.append(AzCommand(query, "read names, IPs and power states of the nodes into the state file", False,
                           saves_state=state_file))  # fmt: skip
    return steps


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
        "# Generated by helpers.azure (dry run). Review it; it creates billable Azure resources.",
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
class AzResult:
    """What one in-process ``az`` call returned."""

    exit_code: int
    value: Any
    error: str


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_az(argv: Sequence[str]) -> AzResult:
    """Run ``az <argv>`` in this process with a fresh CLI object; never raises for az errors.

    The error text is what az logs at ERROR level (e.g. ``Please run 'az login' to setup
    account.``); az also prints it to stderr as usual. A usage error exits 2 instead of raising.
    """
    from azure.cli.core import get_default_cli

    cli, errors = get_default_cli(), _ErrorRecords()
    cli_logger = logging.getLogger("cli")  # knack's logger: az reports every error through it
    cli_logger.addHandler(errors)
    try:
        code = cli.invoke(list(argv), out_file=io.StringIO())  # the result is read from cli.result
    except SystemExit as exc:  # argparse usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        cli_logger.removeHandler(errors)
    value = getattr(getattr(cli, "result", None), "result", None)
    return AzResult(int(code or 0), value if code == 0 else None, "\n".join(errors.messages))


class AzCommandError(RuntimeError):
    """A planned command failed; nothing after it ran.

    Attributes:
        step: 1-based index of the failed step in the plan.
        command: the failed :class:`AzCommand`.
        argv: what exactly failed (the step itself or its ``verify`` check).
        exit_code: az's exit code (1 error, 2 usage error, 3 not found).
        error: az's error message.
        completed: steps that ran or were skipped before the failure.
    """

    def __init__(
        self, step: int, command: AzCommand, argv: Sequence[str], result: AzResult, completed: list[int]
    ):
        self.step, self.command, self.argv = step, command, tuple(argv)
        self.exit_code, self.error, self.completed = result.exit_code, result.error, completed
        super().__init__(
            f"step {step} ({command.description}) failed with exit code {result.exit_code}:\n"
            f"  az {shlex.join(argv)}\n  {result.error or '(no message)'}\n"
            f"Nothing after step {step} ran; steps {completed} were done or already there. "
            "Fix the cause and run apply again: finished steps are skipped."
        )


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
            found = run_az(cmd.verify)
            if found.exit_code == 0:
                logger.info("step %d/%d exists, skipped: %s", i, len(commands), cmd.description)
                done.append(i)
                continue
            if found.exit_code != NOT_FOUND_EXIT_CODE:
                raise AzCommandError(i, cmd, cmd.verify, found, done)
        for path, content in cmd.writes.items():
            write_text_atomic(Path(path), content)
        logger.info("step %d/%d: %s", i, len(commands), cmd.description)
        result = run_az(cmd.argv)
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
    result = run_az(cmd.argv)
    if result.exit_code == NOT_FOUND_EXIT_CODE:
        logger.info("resource group %s does not exist: nothing to delete", spec.resource_group)
    elif result.exit_code != 0:
        raise AzCommandError(1, cmd, cmd.argv, result, [])
    (Path(spec.output_dir) / "state.json").unlink(missing_ok=True)


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

    @property
    def workers(self) -> tuple[Node, ...]:
        return self.nodes[1:]

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
        f"# ssh config of the workshop cluster in resource group {state.resource_group} (helpers.azure).",
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


@dataclass(frozen=True)
class CostEstimate:
    """An ESTIMATE of what the cluster costs while it exists (not a quote)."""

    per_hour: float
    hours: float
    items: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return round(self.per_hour * self.hours, 2)

    def __str__(self) -> str:
        lines = [f"ESTIMATE, not a quote: ${self.per_hour:.3f}/hour, ${self.total:.2f} for {self.hours:g} h"]
        lines += [f"  {name}: ${price:.3f}/h" for name, price in self.items]
        lines += [
            f"  {azure_data.NOT_ESTIMATED}.",
            f"  Prices of {azure_data.PRICES_CHECKED_ON}: {azure_data.PRICES_SOURCE}",
        ]
        return "\n".join(lines)


def estimate_cost(
    spec: ClusterSpec, hours: float = 1.0, vm_price_per_hour: float | None = None
) -> CostEstimate:
    """Estimate the cost of the planned cluster: nodes x size price, NAT gateway, public IPs.

    Args:
        spec: the cluster.
        hours: how long it will exist (billing runs until teardown, not only while training).
        vm_price_per_hour: price of one VM, for sizes missing from the price table.

    Returns:
        The estimate; ``str()`` of it is a labelled, dated breakdown.

    Raises:
        AzureSpecError: the size has no price in the table and none was given.
    """
    row = azure_data.size_series(spec.vm_size)
    if vm_price_per_hour is None:
        cpus = azure_data.vcpus(spec.vm_size)
        if row is None or row.usd_per_vcpu_hour is None or cpus is None:
            raise AzureSpecError(
                f"vm_size={spec.vm_size!r}: no price in helpers.azure_data (checked {azure_data.PRICES_CHECKED_ON}). "
                "Fix: pass vm_price_per_hour= from https://azure.microsoft.com/pricing/calculator/"
            )
        vm_price_per_hour = round(row.usd_per_vcpu_hour * cpus, 4)
    items = (
        (f"{spec.node_count} x {spec.vm_size}", round(spec.node_count * vm_price_per_hour, 4)),
        ("NAT gateway", azure_data.NAT_GATEWAY_USD_PER_HOUR),
        ("2 public IPs (head, NAT)", 2 * azure_data.PUBLIC_IP_USD_PER_HOUR),
    )
    return CostEstimate(round(sum(price for _, price in items), 4), hours, items)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of ``python -m helpers.azure``."""
    parser = argparse.ArgumentParser(prog="python -m helpers.azure", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["plan", "apply", "teardown", "ssh-config"])
    parser.add_argument("--config", required=True, help="cluster YAML (see notebooks/cluster.example.yaml)")
    parser.add_argument(
        "--execute", action="store_true", help="really run (costs money); default: print only"
    )
    parser.add_argument("--confirm", help="teardown: the resource group name, to confirm the deletion")
    parser.add_argument("--hours", type=float, default=1.0, help="plan: hours for the cost estimate")
    parser.add_argument("--vm-price-per-hour", type=float, help="plan: USD per VM-hour if not in the table")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """Run one action; without ``--execute`` nothing in Azure changes."""
    spec = load_spec(args.config)
    if args.action == "plan":
        print(format_plan(plan(spec)), "", estimate_cost(spec, args.hours, args.vm_price_per_hour), sep="\n")
    elif args.action == "apply" and not args.execute:
        print(apply(plan(spec)), end="")
    elif args.action == "apply":
        result = apply(plan(spec), dry_run=False)
        print(
            f"ran steps {result.ran}, skipped {result.skipped}; state in {Path(spec.output_dir) / 'state.json'}"
        )
    elif args.action == "teardown" and not args.execute:
        print(to_script(teardown_plan(spec)), end="")
    elif args.action == "teardown":
        teardown(spec, confirm=args.confirm)
    else:
        state = ClusterState.load(Path(spec.output_dir) / "state.json")
        paths = write_cluster_files(spec, state)
        if args.execute:
            collect_host_keys(state, str(paths["ssh_config"]), str(paths["known_hosts"]))
        print("\n".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        raise SystemExit(main(parse_args()))
    except (AzureSpecError, ClusterStateError, AzCommandError) as err:  # a message, not a traceback
        raise SystemExit(f"error: {err}") from None

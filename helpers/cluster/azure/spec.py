"""The cluster's description: :class:`ClusterSpec` (the keys of ``cluster.yaml``), checked on creation.

Every field is validated with one :class:`AzureSpecError` naming the first bad value and its fix;
SSH is never opened to the whole internet.
"""

from __future__ import annotations

import ipaddress
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from helpers.cluster import prices as azure_data
from helpers.core.errors import InputError, read_yaml

PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>")
OPEN_TO_EVERYONE = {"*", "0.0.0.0", "0.0.0.0/0", "::/0", "internet", "any"}
MAX_NODES = 1000
"""Most nodes a spec may ask for (the subnet must hold them too)."""
WIDEST_SSH_PREFIX = {4: 16, 6: 48}
"""Widest SSH source range accepted without ``allow_wide_ssh_source: true``: a /16 (IPv4), a /48 (IPv6)."""


class AzureSpecError(InputError):
    """A cluster setting (or a file it names) is invalid; the message names it and the fix."""


class UnknownVmSizeWarning(UserWarning):
    """The VM size is not in the capability table, so native bf16 support is unknown."""


@dataclass
class ClusterSpec:
    """Everything that describes the cluster. Field names are the keys of ``cluster.yaml``.

    ``node_count`` counts every node: one head (with a public IP) and ``node_count - 1`` workers.
    Values such as ``<YOUR_PUBLIC_IP>/32`` are placeholders: fine for a plan, refused by
    :func:`apply` when it executes. ``ssh_source_cidr`` wider than a /16 (IPv4) or a /48 (IPv6)
    is refused unless ``allow_wide_ssh_source`` is ``true``; the whole internet never is.
    """

    ssh_source_cidr: str
    allow_wide_ssh_source: bool = False
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
    "node_count": (_integer(1, MAX_NODES), f"must be an integer from 1 to {MAX_NODES}",
                   "1 head node plus the workers you need"),
    "allow_wide_ssh_source": (lambda v: isinstance(v, bool), "must be true or false", "leave it false"),
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


IPV4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
"""IPv6's spelling of IPv4 addresses (``::ffff:a.b.c.d``): judged by the IPv4 range they stand for."""


def _check_location(location: str) -> None:
    if location not in azure_data.AZURE_REGIONS:
        raise AzureSpecError(
            f"location={location!r}: not an Azure region known here (nearest names: "
            f"{', '.join(azure_data.nearest_regions(location))}). Fix: one of the names `az account list-locations "
            f"--query [].name -o tsv` prints (a region newer than {azure_data.REGIONS_CHECKED_ON} goes into "
            f"helpers.cluster.prices.AZURE_REGIONS)"
        )


def _check_ssh_source(cidr: str, allow_wide: bool) -> str:
    """Refuse a source range that is too wide; return it as written, or an IPv4-mapped one as IPv4.

    ``::ffff:a.b.c.d/n`` (n >= 96) stands for the IPv4 range ``a.b.c.d/(n - 96)``, but an IPv4 client
    never matches the IPv6 spelling in a network security rule: the rule is written in IPv4.
    """
    world = (
        f"ssh_source_cidr={cidr!r}: this opens SSH to the whole internet. Fix: use your public IP as a /32"
    )
    if cidr.lower() in OPEN_TO_EVERYONE:
        raise AzureSpecError(world)
    if PLACEHOLDER.search(cidr):
        return cidr  # fine for a plan; apply refuses to execute it
    try:
        net = ipaddress.ip_network(cidr, strict=True)
    except ValueError as err:
        raise AzureSpecError(
            f"ssh_source_cidr={cidr!r}: not a CIDR ({err}). Fix: e.g. 203.0.113.7/32"
        ) from None
    shown = repr(cidr)
    if net.version == 6 and net.prefixlen >= WIDEST_SSH_PREFIX[6]:  # wider ones are refused below
        if net.supernet_of(IPV4_MAPPED):  # IPv4 addresses written as IPv6 ones: all of them
            raise AzureSpecError(world)
        if net.subnet_of(IPV4_MAPPED):  # judged as the IPv4 range it stands for
            mapped = net.network_address.ipv4_mapped
            net = ipaddress.ip_network(f"{mapped}/{net.prefixlen - IPV4_MAPPED.prefixlen}")
            shown = f"{cidr!r} (the IPv4 range {net})"
    if net.prefixlen == 0:
        raise AzureSpecError(world)
    widest = WIDEST_SSH_PREFIX[net.version]
    if net.prefixlen < widest and allow_wide is not True:
        raise AzureSpecError(
            f"ssh_source_cidr={shown} allows SSH from {net.num_addresses:,} addresses "
            f"(2^{net.max_prefixlen - net.prefixlen}), more than a /{widest}. Fix: use your public IP as a "
            f"/{net.max_prefixlen} (or your network's range, at most a /{widest}), or set "
            f"`allow_wide_ssh_source: true` if you mean it"
        )
    return str(net) if net.version == 4 and ":" in cidr else cidr  # an IPv4-mapped one, in IPv4


def _private_range(name: str, value: Any) -> ipaddress.IPv4Network:
    fix = "Fix: e.g. 10.42.0.0/16 and 10.42.1.0/24"
    try:
        net = ipaddress.ip_network(value) if isinstance(value, str) else None
    except ValueError as err:
        raise AzureSpecError(f"{name}={value!r}: {err}. {fix}") from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise AzureSpecError(f"{name}={value!r}: not an IPv4 range in CIDR notation. {fix}")
    return net


def _validate(spec: ClusterSpec) -> None:
    """Check every field; raise one :class:`AzureSpecError` naming the first bad one and its fix."""
    for name, (valid, problem, fix) in _CHECKS.items():
        if not valid(value := getattr(spec, name)):
            raise AzureSpecError(f"{name}={value!r}: {problem}. Fix: {fix}")
    _check_location(spec.location)
    spec.ssh_source_cidr = _check_ssh_source(str(spec.ssh_source_cidr).strip(), spec.allow_wide_ssh_source)
    if azure_data.size_series(spec.vm_size) is None:
        warnings.warn(azure_data.bf16_advice(spec.vm_size), UnknownVmSizeWarning, stacklevel=4)
    vnet = _private_range("vnet_prefix", spec.vnet_prefix)
    subnet = _private_range("subnet_prefix", spec.subnet_prefix)
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
        AzureSpecError: no such file, not readable, not YAML (file and line named), not a mapping,
            unknown keys, no ``ssh_source_cidr`` or an invalid value.
    """
    if not Path(path).exists():
        raise AzureSpecError(
            f"{path} does not exist. Fix: copy notebooks/cluster.example.yaml and fill it in"
        )
    data = read_yaml(path, "cluster file", AzureSpecError)
    data = {} if data is None else data
    known = [f.name for f in fields(ClusterSpec)]
    if not isinstance(data, dict):
        raise AzureSpecError(
            f"{path}: expected a mapping of key: value (as in notebooks/cluster.example.yaml), "
            f"found {type(data).__name__}. Fix: one `key: value` per line"
        )
    unknown = sorted(map(str, set(data) - set(known)))
    if unknown:
        raise AzureSpecError(f"{path}: unknown keys {unknown}. Fix: use only {known}")
    if "ssh_source_cidr" not in data:
        raise AzureSpecError(
            f"{path}: ssh_source_cidr is required (there is no open-to-the-world default). "
            "Fix: add `ssh_source_cidr: <your public IP>/32`; `curl -s https://ifconfig.me` shows your IP"
        )
    try:
        return ClusterSpec(**data)
    except AzureSpecError as err:
        raise AzureSpecError(f"{path}: {err}") from None

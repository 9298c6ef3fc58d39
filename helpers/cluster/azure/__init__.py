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

The parts: :mod:`~helpers.cluster.azure.spec` (the cluster description and its checks),
:mod:`~helpers.cluster.azure.provision` (plan, script, apply, teardown), :mod:`~helpers.cluster.azure.azcli`
(one ``az`` command run in-process), :mod:`~helpers.cluster.azure.access` (state, ssh config, hostfile,
host keys), :mod:`~helpers.cluster.azure.cost` (the estimate), :mod:`~helpers.cluster.azure.command` (the CLI).
What notebooks and scripts use is re-exported here: ``from helpers.cluster import azure; azure.plan(spec)``.
"""

from helpers.cluster.azure.access import (
    ClusterState,
    ClusterStateError,
    collect_host_keys,
    hostfile,
    known_hosts_commands,
    ssh_config,
    verify_nodes,
    write_cluster_files,
)
from helpers.cluster.azure.azcli import NOT_FOUND_EXIT_CODE, AzCommand, AzCommandError, AzResult, run_az
from helpers.cluster.azure.command import cli, main, parse_args
from helpers.cluster.azure.cost import estimate_cost
from helpers.cluster.azure.provision import (
    apply,
    cloud_init,
    format_plan,
    plan,
    teardown,
    teardown_plan,
    to_script,
)
from helpers.cluster.azure.spec import (
    PLACEHOLDER,
    AzureSpecError,
    ClusterSpec,
    UnknownVmSizeWarning,
    load_spec,
)

__all__ = [
    "NOT_FOUND_EXIT_CODE",
    "PLACEHOLDER",
    "AzCommand",
    "AzCommandError",
    "AzResult",
    "AzureSpecError",
    "ClusterSpec",
    "ClusterState",
    "ClusterStateError",
    "UnknownVmSizeWarning",
    "apply",
    "cli",
    "cloud_init",
    "collect_host_keys",
    "estimate_cost",
    "format_plan",
    "hostfile",
    "known_hosts_commands",
    "load_spec",
    "main",
    "parse_args",
    "plan",
    "run_az",
    "ssh_config",
    "teardown",
    "teardown_plan",
    "to_script",
    "verify_nodes",
    "write_cluster_files",
]

"""helpers.cluster.azure: the spec, the plan (checked by the real az parser, offline), apply's dry run and
failure handling through the in-process CLI, teardown's confirmation, ssh config, hostfile, cost.

No test can reach Azure: every az call runs with an empty AZURE_CONFIG_DIR (so never logged in,
even on a machine where someone ran `az login`), where a command the parser accepts ends with
"Please run 'az login'" (exit 1) and a malformed one with a usage error (exit 2).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import yaml

from helpers.cluster import azure
from helpers.cluster import prices as azure_data

CIDR = "203.0.113.7/32"  # RFC 5737 documentation address
LOGIN = "Please run 'az login' to setup account."
OPEN = {"*", "0.0.0.0/0", "::/0", "internet", "any"}
EXAMPLE = Path(__file__).resolve().parents[2] / "notebooks" / "cluster.example.yaml"
ROWS = [  # what `az vm list --show-details --query STATE_QUERY` returns for a 3-node cluster
    {
        "name": "sdw-worker-2",
        "role": "worker",
        "private_ip": "10.42.1.6",
        "public_ip": "",
        "power_state": "VM running",
        "admin_user": "azureuser",
        "resource_group": "sd-workshop-rg",
    },
    {
        "name": "sdw-head",
        "role": "head",
        "private_ip": "10.42.1.4",
        "public_ip": "198.51.100.20",
        "power_state": "VM running",
        "admin_user": "azureuser",
        "resource_group": "sd-workshop-rg",
    },
    {
        "name": "sdw-worker-1",
        "role": "worker",
        "private_ip": "10.42.1.5",
        "public_ip": "",
        "power_state": "VM running",
        "admin_user": "azureuser",
        "resource_group": "sd-workshop-rg",
    },
]


@pytest.fixture
def spec(tmp_path: Path) -> azure.ClusterSpec:
    key = tmp_path / "keys" / "id_ed25519.pub"
    key.parent.mkdir()
    key.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHRlc3Qta2V5LW5vdC1yZWFsLWF0LWFsbC0wMDAwMDA test\n")
    return azure.ClusterSpec(
        ssh_source_cidr=CIDR,
        node_count=3,
        ssh_public_key=str(key),
        repo_url="https://example.org/workshop.git",
        output_dir=str(tmp_path / "cluster"),
    )


def options(argv) -> dict[str, list[str]]:
    """``--flag v1 v2 --other`` -> {"--flag": ["v1", "v2"], "--other": []}."""
    opts: dict[str, list[str]] = {}
    key = None  # the command words before the first flag are not options
    for token in argv:
        if token.startswith("--"):
            key = token
            opts[key] = []
        elif key:
            opts[key].append(token)
    return opts


def run_isolated(code: str, tmp_path: Path) -> dict:
    """Run ``code`` in a fresh Python with an empty az config dir; it prints one JSON line last."""
    env = {
        **os.environ,
        "AZURE_CONFIG_DIR": str(tmp_path / "azure-config"),
        "AZURE_CORE_COLLECT_TELEMETRY": "false",
    }
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the plan against the real az parser -------------------------------------------------------


def test_every_planned_command_is_accepted_by_the_real_az_parser(spec, tmp_path):
    commands = [*azure.plan(spec), *azure.teardown_plan(spec)]
    argvs = [list(c.argv) for c in commands] + [list(c.verify) for c in commands if c.verify]
    result = run_isolated(
        f"""
        import json
        from helpers.cluster import azure
        argvs = {argvs!r}
        checks = [azure.run_az(a) for a in argvs]
        # negative control: the same commands with one bogus flag must be usage errors
        controls = [azure.run_az(a + ["--no-such-flag-xyz"]) for a in argvs]
        print(json.dumps([[r.exit_code, r.error] for r in checks + controls]))
    """,
        tmp_path,
    )
    checks, controls = result[: len(argvs)], result[len(argvs) :]
    for argv, (code, error) in zip(argvs, checks, strict=True):
        assert (code, error) == (1, LOGIN), f"az {argv} was not accepted by the parser: {code} {error}"
    for argv, (code, error) in zip(argvs, controls, strict=True):
        assert code == 2 and "unrecognized arguments: --no-such-flag-xyz" in error, argv
    assert len(argvs) == 15 + 14  # 3 nodes: 14 plan steps + teardown, 14 of them with a verify


def test_plan_steps_and_counts(spec):
    commands = azure.plan(spec)
    assert [c.argv[:3] for c in commands] == [
        ("group", "create", "--name"),
        ("network", "nsg", "create"),
        *[("network", "nsg", "rule")] * 3,
        ("network", "vnet", "create"),
        ("network", "public-ip", "create"),
        ("network", "nat", "gateway"),
        ("network", "vnet", "subnet"),
        ("sshkey", "create", "--resource-group"),
        *[("vm", "create", "--resource-group")] * 3,
        ("vm", "list", "--resource-group"),
    ]
    assert sum(c.mutating for c in commands) == 13
    assert all(c.verify for c in commands if c.mutating) and commands[-1].verify is None
    assert len(azure.plan(azure.ClusterSpec(ssh_source_cidr=CIDR, node_count=1))) == 12


def test_ssh_is_open_only_to_the_allowed_cidr_and_nodes_only_to_their_subnet(spec):
    rules = [options(c.argv) for c in azure.plan(spec) if c.argv[:4] == ("network", "nsg", "rule", "create")]
    allow = [r for r in rules if r["--access"] == ["Allow"]]
    assert all(r["--direction"] == ["Inbound"] for r in rules)
    for rule in allow:  # every rule that lets anything in names its sources; none is the internet
        assert (
            rule["--source-address-prefixes"]
            and not {s.lower() for s in rule["--source-address-prefixes"]} & OPEN
        )
    ssh = [r for r in allow if {"22", "*"} & set(r["--destination-port-ranges"])]
    assert [r["--source-address-prefixes"] for r in ssh] == [[CIDR], ["10.42.1.0/24"]]
    assert [r["--protocol"] for r in ssh] == [["Tcp"], ["*"]]
    deny = [r for r in rules if r["--access"] == ["Deny"]]
    assert [
        (r["--priority"], r["--source-address-prefixes"], r["--destination-port-ranges"]) for r in deny
    ] == [(["4096"], ["*"], ["*"])]
    assert max(int(r["--priority"][0]) for r in allow) < 4096


def test_no_public_ip_on_workers_and_no_per_vm_nsg(spec):
    vms = [options(c.argv) for c in azure.plan(spec) if c.argv[:2] == ("vm", "create")]
    assert [(v["--name"], v["--public-ip-address"]) for v in vms] == [
        (["sdw-head"], ["sdw-head-ip"]),
        (["sdw-worker-1"], [""]),
        (["sdw-worker-2"], [""]),
    ]
    assert ["--public-ip-sku" in v for v in vms] == [True, False, False]
    # az vm create would otherwise add a NIC-level NSG with SSH open to everyone
    assert all(v["--nsg"] == [""] for v in vms)
    assert [v["--private-ip-address"] for v in vms] == [["10.42.1.4"], ["10.42.1.5"], ["10.42.1.6"]]
    assert all(v["--accelerated-networking"] == ["true"] for v in vms)
    assert all(v["--custom-data"] == [str(Path(spec.output_dir) / "cloud-init.yaml")] for v in vms)


def test_unknown_size_gets_no_accelerated_networking_flag_and_a_bf16_warning():
    with pytest.warns(azure.UnknownVmSizeWarning, match="native bf16"):
        spec = azure.ClusterSpec(ssh_source_cidr=CIDR, vm_size="Standard_F8s_v2")
    assert all("--accelerated-networking" not in c.argv for c in azure.plan(spec))


def test_cloud_init_installs_the_workshop_on_every_node(spec):
    text = azure.cloud_init(spec)
    config = yaml.safe_load(text)
    assert text.startswith("#cloud-config\n")
    assert config["packages"] == ["git", "make", "python3-venv", "python3-pip", "build-essential"]
    assert config["runcmd"][:1] == [  # then Ray's service: tests/launching/test_ray.py
        [
            "sudo",
            "-u",
            "azureuser",
            "-H",
            "bash",
            "-c",
            "set -e; cd /home/azureuser; git clone --depth 1 --branch main https://example.org/workshop.git workshop; "
            "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make -C workshop setup; "
            "workshop/.venv/bin/python -m helpers.ranks.oneccl build",  # the ccl backend, or the setup fails
        ]
    ]
    writes = [c.writes for c in azure.plan(spec) if c.writes]
    assert writes == [{str(Path(spec.output_dir) / "cloud-init.yaml"): text}] * 3


# --- the spec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cidr", ["0.0.0.0/0", "*", "Internet", "any", "::/0", "203.0.113.7/24", "not-an-ip"])
def test_ssh_source_cidr_open_or_malformed_is_refused(cidr):
    with pytest.raises(azure.AzureSpecError, match=r"ssh_source_cidr=.*Fix:"):
        azure.ClusterSpec(ssh_source_cidr=cidr)
    with pytest.raises(
        azure.AzureSpecError, match=r"ssh_source_cidr=.*Fix:"
    ):  # the opt-in is for wide, not for these
        azure.ClusterSpec(ssh_source_cidr=cidr, allow_wide_ssh_source=True)


@pytest.mark.parametrize(
    ("cidr", "count", "power", "widest", "single"),
    [
        ("0.0.0.0/1", "2,147,483,648", 31, 16, 32),
        ("10.0.0.0/15", "131,072", 17, 16, 32),
        ("::/1", "170,141,183,460,469,231,731,687,303,715,884,105,728", 127, 48, 128),
        ("2001:db8::/47", "2,417,851,639,229,258,349,412,352", 81, 48, 128),
    ],
)
def test_ssh_source_wider_than_a_16_or_a_48_needs_the_explicit_opt_in(cidr, count, power, widest, single):
    with pytest.raises(azure.AzureSpecError) as err:
        azure.ClusterSpec(ssh_source_cidr=cidr)
    assert str(err.value) == (
        f"ssh_source_cidr={cidr!r} allows SSH from {count} addresses (2^{power}), more than a /{widest}. "
        f"Fix: use your public IP as a /{single} (or your network's range, at most a /{widest}), or set "
        "`allow_wide_ssh_source: true` if you mean it"
    )
    with pytest.raises(azure.AzureSpecError, match="allow_wide_ssh_source='yes': must be true or false"):
        azure.ClusterSpec(ssh_source_cidr=cidr, allow_wide_ssh_source="yes")  # only a real true opts in
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = azure.ClusterSpec(ssh_source_cidr=cidr, allow_wide_ssh_source=True)
    assert spec.ssh_source_cidr == cidr


@pytest.mark.parametrize("cidr", ["10.0.0.0/16", "2001:db8::/48", "2001:db8::7/128", "198.51.100.0/24"])
def test_ssh_source_up_to_a_16_or_a_48_is_accepted_silently(cidr):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert azure.ClusterSpec(ssh_source_cidr=cidr).ssh_source_cidr == cidr


@pytest.mark.parametrize(
    ("cidr", "ipv4"),
    [
        ("::ffff:203.0.113.7/128", "203.0.113.7/32"),
        ("::ffff:203.0.113.7", "203.0.113.7/32"),
        ("::ffff:198.51.100.0/120", "198.51.100.0/24"),
        ("::ffff:10.0.0.0/112", "10.0.0.0/16"),
        ("::FFFF:CB00:7107/128", "203.0.113.7/32"),
    ],
)
def test_an_ipv4_mapped_source_of_any_prefix_is_written_as_ipv4(cidr, ipv4):
    """Issue 48: an IPv4 client never matches an NSG rule written as ``::ffff:a.b.c.d``: the user
    would lock themselves out."""
    spec = azure.ClusterSpec(ssh_source_cidr=cidr)
    assert spec.ssh_source_cidr == ipv4
    rule = next(c for c in azure.plan(spec) if "--source-address-prefixes" in c.argv)
    assert rule.argv[rule.argv.index("--source-address-prefixes") + 1] == ipv4


@pytest.mark.parametrize(
    ("location", "nearest"),
    [("marsnorth", "uaenorth, germanynorth, italynorth"), ("westeuropa", "westeurope, westus, westus2"),
     ("eastus4", "eastus, eastus2, westus")],
)  # fmt: skip
def test_an_unknown_location_is_one_line_naming_the_nearest_known_regions(location, nearest):
    with pytest.raises(azure.AzureSpecError) as err:
        azure.ClusterSpec(ssh_source_cidr=CIDR, location=location)
    assert str(err.value) == (
        f"location={location!r}: not an Azure region known here (nearest names: {nearest}). Fix: one of the "
        f"names `az account list-locations --query [].name -o tsv` prints (a region newer than "
        f"{azure_data.REGIONS_CHECKED_ON} goes into helpers.cluster.prices.AZURE_REGIONS)"
    )
    for region in ("eastus", "westeurope", "swedencentral", "southeastasia"):
        assert azure.ClusterSpec(ssh_source_cidr=CIDR, location=region).location == region
    assert len(set(azure_data.AZURE_REGIONS)) == len(azure_data.AZURE_REGIONS) >= 50


def test_node_count_message_gives_the_real_range():
    for bad in (0, 1001, -3):
        with pytest.raises(azure.AzureSpecError) as err:
            azure.ClusterSpec(ssh_source_cidr=CIDR, node_count=bad)
        assert str(err.value) == (
            f"node_count={bad}: must be an integer from 1 to 1000. Fix: 1 head node plus the workers you need"
        )
    spec = azure.ClusterSpec(
        ssh_source_cidr=CIDR, node_count=1000, vnet_prefix="10.0.0.0/8", subnet_prefix="10.1.0.0/16"
    )
    assert len(spec.node_names) == 1000


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"node_count": 0}, "node_count"),
        ({"node_count": "2"}, "node_count"),
        ({"node_count": True}, "node_count"),
        ({"node_count": 300}, "node_count"),  # more nodes than the /24 subnet holds
        ({"subnet_prefix": "10.43.1.0/24"}, "subnet_prefix"),
        ({"resource_group": "bad name!"}, "resource_group"),
        ({"admin_user": "root"}, "admin_user"),
        ({"name_prefix": "Has_Caps"}, "name_prefix"),
        ({"location": "East US"}, "location"),
        ({"vm_size": "D8_v5"}, "vm_size"),
        ({"os_disk_gb": 10}, "os_disk_gb"),
        ({"ssh_public_key": "~/.ssh/id_ed25519"}, "ssh_public_key"),
        ({"allow_wide_ssh_source": "true"}, "allow_wide_ssh_source"),
        ({"vnet_prefix": 5}, "vnet_prefix"),
        ({"vnet_prefix": "fd00::/8"}, "vnet_prefix"),
        ({"subnet_prefix": "10.42.1.0/33"}, "subnet_prefix"),
        ({"tags": ["a"]}, "tags"),
    ],
)
def test_bad_spec_values_raise_one_clear_error(change, field):
    with pytest.raises(azure.AzureSpecError, match=rf"^{field}=.*Fix: "):
        azure.ClusterSpec(ssh_source_cidr=CIDR, **change)


def test_known_sizes_do_not_warn_and_the_table_says_what_the_cpu_can_do():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        azure.ClusterSpec(ssh_source_cidr=CIDR, vm_size="Standard_D8_v5")
        azure.ClusterSpec(ssh_source_cidr=CIDR, vm_size="Standard_D16s_v6")
    assert azure_data.size_series("Standard_D8_v5").native_bf16 is None  # Ice Lake or Sapphire Rapids host
    assert azure_data.size_series("Standard_D8s_v5").series == "Dv5/Dsv5"
    assert azure_data.size_series("Standard_D8s_v6").amx is True
    assert azure_data.size_series("Standard_E16ds_v6").native_bf16 is True
    assert azure_data.size_series("Standard_D8as_v5") is None
    assert [azure_data.vcpus(s) for s in ("Standard_D8_v5", "Standard_E96ds_v6", "Basic_A1")] == [8, 96, None]
    assert "NOT guaranteed" in azure_data.bf16_advice("Standard_D8_v5")


def test_load_spec_from_yaml(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(f"ssh_source_cidr: {CIDR}\nnode_count: 4\ntags: {{course: sd}}\n")
    spec = azure.load_spec(path)
    assert (spec.ssh_source_cidr, spec.node_count, spec.tags, spec.vm_size) == (
        CIDR,
        4,
        {"course": "sd"},
        "Standard_D8_v5",
    )
    path.write_text("node_count: 2\n")
    with pytest.raises(azure.AzureSpecError, match="ssh_source_cidr is required"):
        azure.load_spec(path)
    path.write_text(f"ssh_source_cidr: {CIDR}\nnodes: 2\n")
    with pytest.raises(azure.AzureSpecError, match=r"unknown keys \['nodes'\]"):
        azure.load_spec(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("ssh_source_cidr: [unclosed\n", "cluster file {path}, line 2, column 1: YAML syntax error: while parsing a flow sequence; "
         "expected ',' or ']', but got '<stream end>'. Fix: correct the YAML there"),
        ("ssh_source_cidr: 203.0.113.7/32\n\tnode_count: 2\n", "cluster file {path}, line 2, column 1: YAML syntax error: "
         "while scanning for the next token; found character '\\t' that cannot start any token. Fix: correct the YAML there"),
        ("- ssh_source_cidr: 203.0.113.7/32\n", "{path}: expected a mapping of key: value (as in "
         "notebooks/cluster.example.yaml), found list. Fix: one `key: value` per line"),
        ("just text\n", "{path}: expected a mapping of key: value (as in notebooks/cluster.example.yaml), found str. "
         "Fix: one `key: value` per line"),
        ("ssh_source_cidr: 203.0.113.7/32\nnode_count: 1001\n", "{path}: node_count=1001: must be an integer from 1 "
         "to 1000. Fix: 1 head node plus the workers you need"),
        ("ssh_source_cidr: 0.0.0.0/1\n", "{path}: ssh_source_cidr='0.0.0.0/1' allows SSH from 2,147,483,648 addresses"),
        ("ssh_source_cidr: ::/1\n", "{path}: ssh_source_cidr='::/1' allows SSH from 170,141,183,"),
        ("ssh_source_cidr: 203.0.113.7/32\n1: 2\n", "{path}: unknown keys ['1']. Fix: use only"),
    ],
)  # fmt: skip
def test_bad_cluster_yaml_is_one_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "cluster.yaml"
    path.write_text(content)
    with pytest.raises(azure.AzureSpecError) as err:
        azure.load_spec(path)
    assert str(err.value).startswith(message.format(path=path)) and "\n" not in str(err.value)


def test_annotated_example_config_loads_with_only_obvious_placeholders():
    spec = azure.load_spec(EXAMPLE)
    assert spec.placeholders() == ["ssh_source_cidr", "repo_url"]
    assert spec.ssh_source_cidr == "<YOUR_PUBLIC_IP>/32"
    assert len(azure.plan(spec)) == 13


# --- apply -------------------------------------------------------------------------------------


def test_dry_run_changes_nothing_and_returns_a_script_bash_accepts(spec, tmp_path):
    script = azure.apply(azure.plan(spec))
    assert script.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail\n" in script
    assert not Path(spec.output_dir).exists()
    path = tmp_path / "create.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


@pytest.fixture
def fake_az(tmp_path: Path) -> tuple[dict, Path]:
    """A fake `az` first on PATH that logs its arguments; `show` finds nothing, `vm list` prints ROWS."""
    log, bindir = tmp_path / "az.log", tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "az"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\nargs = sys.argv[1:]\n"
        f"open({str(log)!r}, 'a').write(json.dumps(args) + '\\n')\n"
        "if 'show' in args[:4]: sys.exit(3)\n"
        f"if args[:2] == ['vm', 'list']: print(json.dumps({ROWS!r}))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}, log


def test_dry_run_script_runs_exactly_the_planned_argv(spec, tmp_path, fake_az):
    """Run the script with a fake `az` that logs its arguments: quoting must round-trip exactly."""
    env, log = fake_az
    commands = azure.plan(spec)
    script = tmp_path / "create.sh"
    script.write_text(azure.apply(commands))
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    expected = []
    for cmd in commands:
        if cmd.mutating and cmd.verify and cmd.skip_if_found:
            expected.append(list(cmd.verify))
        expected.append(list(cmd.argv))
    assert [json.loads(line) for line in log.read_text().splitlines()] == expected
    assert (Path(spec.output_dir) / "cloud-init.yaml").read_text() == azure.cloud_init(spec)
    assert azure.ClusterState.load(Path(spec.output_dir) / "state.json") == azure.ClusterState.from_vm_list(
        ROWS
    )


def test_dry_run_script_writes_files_exactly_even_if_they_contain_the_end_marker(tmp_path, fake_az):
    content = "line 1\nAZ_PLAN_FILE_EOF\nAZ_PLAN_FILE_EOF_\n  $HOME `date` 'quoted'\n"
    path = tmp_path / "out" / "file.txt"
    script = tmp_path / "s.sh"
    script.write_text(azure.apply([azure.AzCommand(("version",), "v", False, writes={str(path): content})]))
    assert subprocess.run(["bash", str(script)], env=fake_az[0], capture_output=True).returncode == 0
    assert path.read_text() == content


def test_dry_run_script_refuses_to_run_with_placeholders(tmp_path):
    spec = azure.ClusterSpec(ssh_source_cidr="<YOUR_PUBLIC_IP>/32", output_dir=str(tmp_path / "cluster"))
    script = tmp_path / "create.sh"
    script.write_text(azure.apply(azure.plan(spec)))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 1 and "<YOUR_PUBLIC_IP> <YOUR_ORG> <YOUR_REPO>" in out.stderr
    assert not (tmp_path / "cluster").exists()


def test_execute_refuses_placeholders_and_missing_key_before_any_az_call(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(azure.azcli, "run_az", lambda argv: calls.append(argv))
    with pytest.raises(azure.AzureSpecError, match=r"placeholders \['<YOUR_PUBLIC_IP>'"):
        azure.apply(azure.plan(azure.ClusterSpec(ssh_source_cidr="<YOUR_PUBLIC_IP>/32")), dry_run=False)
    missing = tmp_path / "nokey.pub"
    spec = azure.ClusterSpec(
        ssh_source_cidr=CIDR, ssh_public_key=str(missing), repo_url="https://example.org/w.git"
    )
    fix = f"{missing} does not exist. Fix: create it with: ssh-keygen -t ed25519 -f {tmp_path / 'nokey'}"
    with pytest.raises(azure.AzureSpecError, match=f"^{re.escape(fix)}$"):
        azure.apply(azure.plan(spec), dry_run=False)
    assert calls == []


def test_apply_stops_at_the_first_failure_through_the_real_cli(tmp_path):
    """Step 1 really runs (a local `az config set`), step 2 is a usage error, step 3 must not run."""
    out = tmp_path / "out"
    result = run_isolated(
        f"""
        import json
        from helpers.cluster import azure
        A = azure.AzCommand
        out = {str(out)!r}
        steps = [
            A(("config", "set", "workshop.first=ran"), "first", True),
            A(("group", "create", "--name", "x", "--location", "eastus", "--no-such-flag"), "broken", True),
            A(("config", "set", "workshop.third=ran"), "third", True, writes={{out + "/file.txt": "x"}},
              saves_state=out + "/state.json"),
        ]
        try:
            azure.apply(steps, dry_run=False)
        except azure.AzCommandError as err:
            print(json.dumps([err.step, list(err.argv), err.exit_code, err.error, err.completed, str(err)]))
    """,
        tmp_path,
    )
    step, argv, code, error, completed, message = result
    assert (step, code, completed) == (2, 2, [1])
    assert argv == ["group", "create", "--name", "x", "--location", "eastus", "--no-such-flag"]
    assert error == "unrecognized arguments: --no-such-flag"
    assert "step 2 (broken) failed with exit code 2" in message and "Nothing after step 2 ran" in message
    config = configparser.ConfigParser()
    config.read(tmp_path / "azure-config" / "config")
    assert dict(config["workshop"]) == {"first": "ran"}  # step 1 ran, step 3 did not
    assert not out.exists()  # no state file, no generated file, no temporary leftovers


def test_apply_not_logged_in_stops_at_the_first_check_and_teardown_reports_it(spec, tmp_path):
    result = run_isolated(
        f"""
        import json
        from helpers.cluster import azure
        spec = azure.ClusterSpec(ssh_source_cidr={CIDR!r}, node_count=3, ssh_public_key={spec.ssh_public_key!r},
                                 repo_url={spec.repo_url!r}, output_dir={spec.output_dir!r})
        errors = []
        try:
            azure.apply(azure.plan(spec), dry_run=False)
        except azure.AzCommandError as err:
            errors.append([err.step, list(err.argv), err.exit_code, err.error, err.completed])
        try:
            azure.teardown(spec, confirm=spec.resource_group)
        except azure.AzCommandError as err:
            errors.append([err.step, list(err.argv), err.exit_code, err.error, err.completed])
        print(json.dumps(errors))
    """,
        tmp_path,
    )
    assert result == [
        [1, ["group", "show", "--name", "sd-workshop-rg", "--output", "none"], 1, LOGIN, []],
        [1, ["group", "delete", "--name", "sd-workshop-rg", "--yes"], 1, LOGIN, []],
    ]
    assert not Path(spec.output_dir).exists()


def test_apply_skips_what_exists_and_saves_the_state_atomically(spec, monkeypatch):
    """The control flow with a stand-in for az: found -> skipped, not found (3) -> created."""
    calls = []

    def fake_az(argv):
        calls.append(tuple(argv))
        if "show" in argv[:4]:
            return azure.AzResult(0 if argv[0] in ("group", "network") else 3, None, "")
        return azure.AzResult(0, ROWS if argv[:2] == ("vm", "list") else {}, "")

    monkeypatch.setattr(azure.azcli, "run_az", fake_az)
    commands = azure.plan(spec)
    result = azure.apply(commands, dry_run=False)
    assert result.skipped == [1, 2, 6, 7, 8, 9] and result.ran == [3, 4, 5, 10, 11, 12, 13, 14]
    assert calls.count(commands[2].argv) == 1  # NSG rules are upserts: always applied
    assert result.state == azure.ClusterState.from_vm_list(ROWS)
    state_file = Path(spec.output_dir) / "state.json"
    assert azure.ClusterState.load(state_file) == result.state
    assert sorted(p.name for p in state_file.parent.iterdir()) == ["cloud-init.yaml", "state.json"]


# --- teardown ----------------------------------------------------------------------------------


@pytest.mark.parametrize("confirm", [None, "", "yes", "other-rg"])
def test_teardown_without_the_right_confirmation_refuses(spec, monkeypatch, confirm):
    calls = []
    monkeypatch.setattr(azure.azcli, "run_az", lambda argv: calls.append(argv))
    with pytest.raises(azure.AzureSpecError, match="Fix: pass confirm='sd-workshop-rg'"):
        azure.teardown(spec, confirm=confirm)
    assert calls == []


def test_teardown_deletes_the_group_and_the_local_state(spec, monkeypatch):
    calls = []
    monkeypatch.setattr(
        azure.azcli, "run_az", lambda argv: calls.append(tuple(argv)) or azure.AzResult(0, None, "")
    )
    azure.ClusterState.from_vm_list(ROWS).save(Path(spec.output_dir) / "state.json")
    azure.teardown(spec, confirm="sd-workshop-rg")
    assert calls == [("group", "delete", "--name", "sd-workshop-rg", "--yes")]
    assert not (Path(spec.output_dir) / "state.json").exists()
    monkeypatch.setattr(azure.azcli, "run_az", lambda argv: azure.AzResult(3, None, "ResourceGroupNotFound"))
    azure.teardown(spec, confirm="sd-workshop-rg")  # already gone: nothing to do, no error
    script = azure.to_script(azure.teardown_plan(spec))
    assert script.endswith(
        "\n# 1/1: delete resource group sd-workshop-rg and everything in it\n"
        "az group delete --name sd-workshop-rg --yes\n"
    )


# --- state, ssh config, hostfile ---------------------------------------------------------------


def test_state_orders_head_first_then_workers_naturally(tmp_path):
    rows = ROWS + [dict(ROWS[0], name="sdw-worker-10", private_ip="10.42.1.14")]
    state = azure.ClusterState.from_vm_list(rows)
    assert [n.name for n in state.nodes] == ["sdw-head", "sdw-worker-1", "sdw-worker-2", "sdw-worker-10"]
    assert (state.head.public_ip, state.nodes[1].public_ip) == ("198.51.100.20", None)
    assert azure.ClusterState.load(state.save(tmp_path / "s.json")) == state
    (tmp_path / "rows.json").write_text(json.dumps(rows))  # what the dry-run script saves
    assert azure.ClusterState.load(tmp_path / "rows.json") == state
    with pytest.raises(azure.ClusterStateError, match="exactly one VM tagged role=head, found 0"):
        azure.ClusterState.from_vm_list(ROWS[:1])
    with pytest.raises(azure.ClusterStateError, match="does not exist. Fix: create the cluster first"):
        azure.ClusterState.load(tmp_path / "missing.json")


def test_ssh_config_exact_content():
    state = azure.ClusterState.from_vm_list(ROWS)
    config = azure.ssh_config(state, "~/.ssh/id_ed25519", "/work/my cluster/known_hosts")
    node = (
        "Host {name}\n    HostName {ip}\n{jump}    User azureuser\n    IdentityFile ~/.ssh/id_ed25519\n"
        '    IdentitiesOnly yes\n    UserKnownHostsFile "/work/my cluster/known_hosts"\n'
        "    StrictHostKeyChecking yes\n"
    )
    assert config == (
        "# ssh config of the workshop cluster in resource group sd-workshop-rg (helpers.cluster.azure).\n"
        "# Use: ssh -F <this file> <node name>. Host keys are checked against the project known_hosts.\n\n"
        + node.format(name="sdw-head", ip="198.51.100.20", jump="")
        + "\n"
        + node.format(name="sdw-worker-1", ip="10.42.1.5", jump="    ProxyJump sdw-head\n")
        + "\n"
        + node.format(name="sdw-worker-2", ip="10.42.1.6", jump="    ProxyJump sdw-head\n")
    )
    assert "StrictHostKeyChecking no" not in config


def test_hostfile_and_host_key_commands_exact():
    state = azure.ClusterState.from_vm_list(ROWS)
    assert azure.hostfile(state) == "10.42.1.4\n10.42.1.5\n10.42.1.6\n"
    assert azure.known_hosts_commands(state, "cluster/ssh_config") == [
        ["ssh-keyscan", "-t", "ed25519", "198.51.100.20"],
        [
            "ssh",
            "-F",
            "cluster/ssh_config",
            "sdw-head",
            "ssh-keyscan -t ed25519 10.42.1.4 10.42.1.5 10.42.1.6",
        ],
    ]


def test_write_cluster_files(spec):
    paths = azure.write_cluster_files(spec, azure.ClusterState.from_vm_list(ROWS))
    out = Path(spec.output_dir).resolve()
    assert paths == {
        "ssh_config": out / "ssh_config",
        "hostfile": out / "hostfile",
        "known_hosts": out / "known_hosts",
    }
    assert paths["hostfile"].read_text() == "10.42.1.4\n10.42.1.5\n10.42.1.6\n"
    assert (
        f"    IdentityFile {spec.private_key}\n    IdentitiesOnly yes\n    UserKnownHostsFile {out}/known_hosts\n"
        in (paths["ssh_config"].read_text())
    )


# --- cost, CLI ---------------------------------------------------------------------------------


def test_cost_estimate_is_labelled_and_exact():
    estimate = azure.estimate_cost(azure.ClusterSpec(ssh_source_cidr=CIDR), hours=4)
    assert estimate.items == (
        ("2 x Standard_D8_v5", 0.768),
        ("NAT gateway", 0.045),
        ("2 public IPs (head, NAT)", 0.01),
    )
    assert (estimate.per_hour, estimate.total) == (0.823, 3.29)
    assert str(estimate).startswith(
        "ESTIMATE, not a quote: $0.823/hour, $3.29 for 4 h, at East US (eastus) list prices\n"
    )
    assert "location" not in str(estimate)  # the cluster runs where the prices are from
    elsewhere = azure.estimate_cost(azure.ClusterSpec(ssh_source_cidr=CIDR, location="westeurope"), hours=4)
    assert (elsewhere.per_hour, elsewhere.location) == (0.823, "westeurope")
    assert str(elsewhere).splitlines()[1] == (
        "  The cluster's location is westeurope: its prices differ from East US (eastus)'s; check them in the "
        "calculator below."
    )
    assert azure_data.PRICES_CHECKED_ON in str(estimate) and "not included" in str(estimate)
    e8 = azure.estimate_cost(azure.ClusterSpec(ssh_source_cidr=CIDR, vm_size="Standard_E8s_v5", node_count=3))
    assert e8.per_hour == 1.567  # 3 x 0.504 + 0.045 + 0.01
    v6 = azure.ClusterSpec(ssh_source_cidr=CIDR, vm_size="Standard_D8s_v6")
    with pytest.raises(azure.AzureSpecError, match="no price .* Fix: pass vm_price_per_hour="):
        azure.estimate_cost(v6)
    assert azure.estimate_cost(v6, vm_price_per_hour=0.5).per_hour == 1.055


def test_cli_plan_apply_teardown_ssh_config(spec, tmp_path, capsys, monkeypatch):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"ssh_source_cidr": CIDR, "output_dir": spec.output_dir}))
    assert azure.main(azure.parse_args(["plan", "--config", str(config), "--hours", "2"])) == 0
    text = capsys.readouterr().out
    assert " 1. [creates/changes] resource group sd-workshop-rg" in text and "$1.65 for 2 h" in text
    config.write_text(yaml.safe_dump({"ssh_source_cidr": CIDR, "vm_size": "Standard_D8s_v6"}))
    azure.main(azure.parse_args(["plan", "--config", str(config), "--vm-price-per-hour", "0.5"]))
    assert "ESTIMATE, not a quote: $1.055/hour" in capsys.readouterr().out
    config.write_text(yaml.safe_dump({"ssh_source_cidr": CIDR, "output_dir": spec.output_dir}))
    azure.main(azure.parse_args(["apply", "--config", str(config)]))
    assert capsys.readouterr().out == azure.apply(azure.plan(azure.load_spec(config)))
    azure.main(azure.parse_args(["teardown", "--config", str(config)]))
    assert "az group delete --name sd-workshop-rg --yes" in capsys.readouterr().out
    monkeypatch.setattr(azure.azcli, "run_az", lambda argv: pytest.fail("must not call az"))
    with pytest.raises(azure.AzureSpecError, match="pass confirm="):
        azure.main(azure.parse_args(["teardown", "--config", str(config), "--execute"]))
    azure.ClusterState.from_vm_list(ROWS).save(Path(spec.output_dir) / "state.json")
    azure.main(azure.parse_args(["ssh-config", "--config", str(config)]))
    assert (Path(spec.output_dir) / "hostfile").read_text() == "10.42.1.4\n10.42.1.5\n10.42.1.6\n"
    with pytest.raises(SystemExit):
        azure.parse_args(["deploy", "--config", str(config)])


def test_cli_reports_bad_input_in_one_line_with_exit_2_and_az_failures_with_exit_1(
    spec, tmp_path, capsys, monkeypatch
):
    assert azure.cli(["plan", "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.yaml does not exist" in err and err.count("\n") == 1
    config = tmp_path / "cluster.yaml"
    config.write_text("ssh_source_cidr: [unclosed\n")
    assert azure.cli(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cluster file {config}, line 2, column 1: YAML syntax error: while parsing")
    assert err.count("\n") == 1
    assert azure.cli(["plan", "--config", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: cluster file {tmp_path} is a folder. Fix: pass the YAML file, not the folder\n"
    )
    config.write_text(yaml.safe_dump({"ssh_source_cidr": CIDR, "output_dir": spec.output_dir}))
    monkeypatch.setattr(azure.azcli, "run_az", lambda argv: azure.AzResult(1, None, "AuthorizationFailed"))
    assert azure.cli(["teardown", "--config", str(config), "--execute", "--confirm", "sd-workshop-rg"]) == 1
    assert "AuthorizationFailed" in capsys.readouterr().err
    assert azure.cli(["plan", "--config", str(config)]) == 0


def test_an_unknown_size_without_a_price_is_the_error_alone_and_with_one_its_warning_in_one_line(
    spec, tmp_path, capsys
):
    """Issue 48: a size not in the tables printed Python's two-line warning, then the error."""
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"ssh_source_cidr": CIDR, "vm_size": "Standard_Bogus_v9"}))
    with warnings.catch_warnings(record=True) as shown:  # Python's own warning lines: none
        warnings.simplefilter("always")
        assert azure.cli(["plan", "--config", str(config)]) == 2
    assert shown == []
    assert capsys.readouterr().err == (
        f"error: vm_size='Standard_Bogus_v9': no price in helpers.cluster.prices (checked "
        f"{azure_data.PRICES_CHECKED_ON}). Fix: pass vm_price_per_hour= from "
        "https://azure.microsoft.com/pricing/calculator/\n"
    )
    config.write_text(yaml.safe_dump({"ssh_source_cidr": CIDR, "vm_size": "Standard_Bogus_v9",
                                      "output_dir": spec.output_dir}))  # fmt: skip
    assert azure.cli(["plan", "--config", str(config), "--vm-price-per-hour", "0.4"]) == 0
    out = capsys.readouterr()
    assert out.err == f"warning: {azure_data.bf16_advice('Standard_Bogus_v9')}\n"
    assert "ESTIMATE, not a quote: $0.855/hour" in out.out


def test_python_dash_m_runs_the_package():
    out = subprocess.run(
        [sys.executable, "-m", "helpers.azure", "plan", "--config", "no-such.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: no-such.yaml does not exist")

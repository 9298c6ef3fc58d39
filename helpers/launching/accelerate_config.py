"""accelerate's config file for each node, written from the annotated template in ``helpers/assets``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from helpers.core.errors import DistributedError
from helpers.core.files import write_text_atomic
from helpers.launching.layout import ClusterLayout

MIXED_PRECISION = ("auto", "no", "bf16")


CONFIG_TEMPLATE = Path(__file__).parent.parent / "assets" / "accelerate_config_template.yaml"


@dataclass(frozen=True)
class ConfigAnswer:
    """One question of the interactive ``accelerate config``, our answer, the key it sets, and why."""

    question: str  # "" for keys the questionnaire implies without asking
    answer: str
    key: str
    value: str  # as written in the YAML
    why: str


def resolve_precision(mixed_precision: str) -> str:
    if mixed_precision not in MIXED_PRECISION:
        raise DistributedError(
            f"mixed_precision={mixed_precision!r}: must be one of {', '.join(MIXED_PRECISION)}"
        )
    if mixed_precision == "auto":
        # imported here: helpers.core.cpu imports torch (+1.9 s CPU on this module's 0.1 s import,
        # measured with time.process_time); only "auto" needs it
        from helpers.core import cpu

        return cpu.choose_precision("auto").mixed_precision
    return mixed_precision


def _yaml_value(value: object) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def render_accelerate_config(
    layout: ClusterLayout,
    machine_rank: int = 0,
    mixed_precision: str = "no",
    mpirun_hostfile: str | os.PathLike | None = None,
) -> str:
    """One node's accelerate config: :data:`CONFIG_TEMPLATE` with its placeholders filled.

    Args:
        layout: the cluster.
        machine_rank: this node's index in ``layout.hosts``.
        mixed_precision: ``"no"`` (fp32), ``"bf16"`` or ``"auto"`` (bf16 where this CPU has it natively and it is faster).
        mpirun_hostfile: if given, ``accelerate launch`` itself starts mpirun with this hostfile;
            leave None when :mod:`helpers.launch` runs mpirun.
    """
    if not 0 <= machine_rank < layout.num_machines:
        raise DistributedError(
            f"machine_rank={machine_rank}: must be 0..{layout.num_machines - 1} for this layout"
        )
    hostfile = os.path.abspath(mpirun_hostfile) if mpirun_hostfile else None
    values = {
        "NUM_MACHINES": layout.num_machines,
        "MACHINE_RANK": machine_rank,
        "HEAD_NODE_IP": layout.main_process_ip,
        "MAIN_PROCESS_PORT": layout.main_process_port,
        "MPIRUN_ANSWER": "yes" if hostfile else "no",
        "MPIRUN_HOSTFILE": hostfile or "(not asked)",
        "MPIRUN_CONFIG": {"mpirun_hostfile": hostfile} if hostfile else {},
        "NUM_PROCESSES": layout.world_size,
        "NPROC_PER_NODE": layout.nproc_per_node,
        "MIXED_PRECISION": resolve_precision(mixed_precision),
    }

    def fill(text: str, as_yaml: bool) -> str:
        for name, value in values.items():
            text = text.replace(f"<{name}>", _yaml_value(value) if as_yaml else str(value))
        return text

    lines = []
    for line in CONFIG_TEMPLATE.read_text().splitlines():
        value, sep, why = line.partition("  # ")
        lines.append(
            fill(line, False) if line.startswith("#") else fill(value, True) + sep + fill(why, False)
        )
    return "\n".join(lines) + "\n"


def config_answers(config_text: str) -> list[ConfigAnswer]:
    """The questions, answers, keys and reasons of a rendered config (for the notebook's table)."""
    answers, pending, question = [], [], None
    for line in config_text.splitlines():
        if line.startswith("# Q: "):
            question = line[5:]
        elif line.startswith("# A: ") and question is not None:
            pending.append((question, line[5:]))
            question = None
        elif line and not line.startswith("#"):
            key, rest = line.split(":", 1)
            value, _, why = rest.partition("  # ")
            for q, a in pending or [("", "")]:
                answers.append(ConfigAnswer(q, a, key, value.strip(), why.strip()))
            pending = []
    return answers


def write_accelerate_configs(
    layout: ClusterLayout,
    out_dir: str | os.PathLike,
    mixed_precision: str = "no",
    mpirun_hostfile: str | os.PathLike | None = None,
) -> list[Path]:
    """Write one accelerate config per node, ``accelerate_config_node{K}.yaml`` with ``machine_rank: K``.

    Args:
        layout: the cluster.
        out_dir: folder for the files (created).
        mixed_precision: ``"no"``, ``"bf16"`` or ``"auto"`` (resolved on this machine).
        mpirun_hostfile: see :func:`render_accelerate_config`.

    Returns:
        The paths, node 0 first. Copy file K to node K, or keep them on a folder every node sees.
    """
    out = Path(out_dir)
    return [
        write_text_atomic(
            out / f"accelerate_config_node{k}.yaml",
            render_accelerate_config(layout, k, mixed_precision, mpirun_hostfile),
        )
        for k in range(layout.num_machines)
    ]

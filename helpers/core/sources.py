"""Is a model or concept name a local path or a Hugging Face Hub id? Decided here, once.

Named sources such as ``"tiny"`` or ``"sample"`` are the caller's business and are checked first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

SourceKind = Literal["folder", "missing_path", "hub_id", "unknown"]

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``namespace/name``, as the Hub spells repository ids."""


def classify_source(name: str | os.PathLike) -> SourceKind:
    """Say what ``name`` refers to, without touching the network.

    Returns:
        ``"folder"``: it exists locally (a file or folder; ``~`` is expanded).
        ``"missing_path"``: it does not exist but is spelled as a path (starts with ``.``, ``/``
        or ``~``), so it must not be looked up on the Hub.
        ``"hub_id"``: it does not exist locally and is spelled ``namespace/name``.
        ``"unknown"``: none of these (e.g. a mistyped folder name without a slash).
    """
    text = os.fspath(name)
    if Path(text).expanduser().exists():
        return "folder"
    if text.startswith((".", "/", "~")):
        return "missing_path"
    return "hub_id" if HUB_ID.fullmatch(text) else "unknown"

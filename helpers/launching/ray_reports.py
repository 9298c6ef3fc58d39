"""The reports of a Ray job, from the workers to the driver.

Each worker sends ``ray.train.report`` (:class:`helpers.launching.ray_worker.StepReporter`); the
Train controller, on the driver's node, appends every report and worker failure to a JSON-lines
file (:func:`sink_reports`), which the driver reads as it grows (:class:`Reports`).
"""

from __future__ import annotations

import json
from pathlib import Path


def sink_reports(path: str):
    """A ``ray.train.UserCallback`` (it runs in the Train controller, on the driver's node) that
    appends every report and worker failure to ``path`` as JSON lines, for the driver to read."""
    from ray.train import UserCallback

    class ReportSink(UserCallback):
        def __init__(self, path: str):
            self.path = path

        def _append(self, record: dict) -> None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=repr) + "\n")

        def after_report(self, run_context, metrics, checkpoint) -> None:
            self._append({"reports": metrics})

        def after_exception(self, run_context, worker_exceptions) -> None:
            self._append({"failures": {str(r): first_line(e) for r, e in worker_exceptions.items()}})

    return ReportSink(path)


def first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class Reports:
    """Reads the report sink's new complete lines."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows, self.failures = path, 0, [], {}
        self.final: dict = {}

    def read(self) -> list[dict]:
        """New per-step rows of rank 0 since the last call."""
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        new = []
        for line in complete.splitlines():
            record = json.loads(line)
            self.failures.update(record.get("failures", {}))
            reports = record.get("reports") or []
            first = reports[0] if reports else {}
            if first.get("final"):
                self.final = first
            elif first:
                new.append(first)
        self.rows += new
        return new

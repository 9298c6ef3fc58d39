"""The Ray Train worker of ``helpers.launch --launcher ray``: one rank of the engine, unchanged.

:mod:`helpers.launching.ray_train` (the driver) hands :func:`train_worker` to ``TorchTrainer``;
every worker runs the same ``train(config)`` as ``helpers.train`` (or ``helpers.dreambooth``)
does under mpirun. Ray has set up the process group and the rank's variables before the function
runs; accelerate's ``Accelerator(cpu=True)`` uses that group instead of creating one.

The worker follows the run through the engine's events (:mod:`helpers.training.engine.events`):
after each optimisation step it may send ``ray.train.report`` with the step, the loss, the
seconds per step and images/s (:class:`StepReporter`), which the driver shows as its one progress
bar. The engine's own bar is off in the workers (``TQDM_DISABLE``); its outputs, ``history.json``
included, are written once by rank 0 as with the other launchers, and rank 0's last report
carries the exact history and summary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from helpers.dreambooth.config import DreamBoothConfig
from helpers.launching.rank_output import WORKER_TAG
from helpers.ranks import faults, status
from helpers.training.config import TrainConfig
from helpers.training.engine import events

REPORT_SECONDS = 2.0  # at most one report per this many seconds (see StepReporter)


@dataclass
class StepReporter:
    """An events listener: ``ray.train.report`` of step, loss, seconds per step and images/s.

    Ray's report is a barrier (every worker must call it equally often) and a worker may be only
    one report ahead of the Train controller, which takes reports once per health check (1 s):
    a report at every 0.1-s step of a small model would hold every step up to a second. So rank 0
    decides after each step whether a report is due (the first step of the run, its last, or
    :data:`REPORT_SECONDS` since the last report) and broadcasts the decision (4 bytes over the
    job's process group; every rank publishes each step at the same point), and every worker
    reports at that step. The loss is the step's, averaged over the ranks; seconds per step and
    images/s are those of the steps since the last report.
    """

    rank: int
    started_at: float = field(default_factory=time.time)
    _last_report: float | None = None
    _seconds: float = 0.0
    _images: float = 0.0
    _steps: int = 0

    def __call__(self, event: events.Event) -> None:
        if not isinstance(event, events.StepEnded):
            return
        import ray.train
        import torch
        import torch.distributed as dist

        now = time.perf_counter()
        self._seconds += event.seconds
        self._images += (event.images_per_second or 0.0) * event.seconds
        self._steps += 1
        first = self._last_report is None
        due = first or event.step >= event.max_steps or now - self._last_report >= REPORT_SECONDS
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(due)], dtype=torch.int32)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        if not due:
            return
        seconds = self._seconds / self._steps
        ray.train.report({
            "step": event.step, "loss": event.loss, "seconds_per_step": seconds, "rank": self.rank,
            "images_per_second": self._images / self._seconds if self._seconds else None,
            "started_at": self.started_at,
        })  # fmt: skip
        self._last_report, self._seconds, self._images, self._steps = now, 0.0, 0.0, 0


def train_worker(job: dict) -> None:
    """The function every Ray Train worker runs: the method's ``train(config)``, unchanged.

    Args:
        job: ``module`` (``helpers.train`` or ``helpers.dreambooth``), ``config`` (its settings'
            ``to_dict()``), ``env`` (variables to set first: the status folder, ``OMP_NUM_THREADS``,
            the backend's).
    """
    started_at = time.time()
    # imported here: ray.train costs 3.3 s CPU and the engine (diffusers, accelerate) 3.0 s on top of
    # helpers.launch (measured with time.process_time); only the Ray workers run this, not the launcher
    import ray.train

    from helpers.dreambooth import training as dreambooth
    from helpers.training import textual_inversion

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    os.environ.update(job["env"])
    node = ray.util.get_node_ip_address()
    print(
        f"{WORKER_TAG} rank {rank} of {world}, pid {os.getpid()}, node {node} ({socket.gethostname()})",
        flush=True,
    )  # noqa: T201 - the launcher maps this pid to the rank
    _quiet()
    status.start()
    with events.listening(StepReporter(rank, started_at)):
        if job.get("module") == "helpers.dreambooth":
            result = dreambooth.train(DreamBoothConfig.from_dict(job["config"]))
            print(f"LoRA weights: {result.lora_weights_path}", flush=True)  # noqa: T201
        else:
            result = textual_inversion.train(TrainConfig.from_dict(job["config"]))
            print(f"learned embeddings: {result.learned_embeds_path}", flush=True)  # noqa: T201
    faults.hang_after_training(rank)  # test-only
    status.finish()  # this rank has ended; the actor's process lives on until Ray stops it
    final = {"final": True, "rank": rank}
    if rank == 0:
        final.update(history=result.history, summary=result.summary)
    ray.train.report(final)


def _quiet() -> None:
    """A line per checkpoint file (accelerate) and per report (Ray Train) is noise here."""
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    with contextlib.suppress(ImportError):  # Ray Train names this module's logger by its file
        from ray.train.v2._internal.execution import context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)

"""What a run tells its listeners: a record per optimisation step, per save, and when its weights are loaded.

The run loop publishes; whatever wants to follow a run listens, instead of reading the progress
bar or patching the engine. The loop's own listeners are built per run (:func:`run_listeners`:
the progress bar, TensorBoard, the rank's status heartbeat); a caller adds its own for the calls
it makes (:func:`listening`), e.g. the Ray worker's ``ray.train.report`` or a benchmark resetting
its memory mark once the weights are in::

    with events.listening(print):
        train(config)

Every process of a job publishes the same records at the same points, so a listener may run a
collective (the Ray worker broadcasts rank 0's decision to report). A listener's exception
propagates to the loop: it fails the run, as any error of the step would.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from helpers.ranks import faults, status
from helpers.training.engine import tracking


@dataclass(frozen=True)
class StepEnded:
    """One optimisation step ended, its loss averaged over the processes.

    Attributes:
        step: its number (1 for the first).
        max_steps: the run's last step.
        loss: the mean loss of the step's micro-batches over every process.
        lr: the learning rate the step used.
        seconds: the step's wall time on this process.
        images_per_second: pictures of the step (every process) per second.
        losses: the method's parts of the loss, e.g. DreamBooth's ``instance_loss``, ``prior_loss``.
    """

    step: int
    max_steps: int
    loss: float
    lr: float
    seconds: float
    images_per_second: float | None = None
    losses: dict[str, float] = field(default_factory=dict)

    def history_record(self) -> dict:
        """The step's row of ``history.json``."""
        return {"step": self.step, "loss": self.loss, **self.losses, "lr": self.lr, "seconds": self.seconds}


@dataclass(frozen=True)
class Saved:
    """Something was saved at ``step``: ``what`` is ``checkpoint``, ``weights`` (every N steps),
    ``samples`` or ``outputs`` (the run's final files); ``path`` where (the main process's)."""

    step: int
    what: str
    path: Path


@dataclass(frozen=True)
class WeightsLoaded:
    """Every weight the run reads is in memory (before the latents are encoded and the steps run)."""


Event = StepEnded | Saved | WeightsLoaded
Listener = Callable[[Event], None]

_listeners: list[Listener] = []


def publish(event: Event, listeners: tuple[Listener, ...] | list[Listener] = ()) -> None:
    """Hand ``event`` to ``listeners`` (a run's own), then to every :func:`listening` one, in order."""
    for listener in (*listeners, *_listeners):
        listener(event)


@contextlib.contextmanager
def listening(*listeners: Listener) -> Iterator[None]:
    """Call ``listeners`` with every event this process publishes within the block."""
    _listeners.extend(listeners)
    try:
        yield
    finally:
        for listener in listeners:
            _listeners.remove(listener)


# --- the loop's own listeners --------------------------------------------------------------------


class ProgressBar:
    """The run's progress bar (local main process): one tick and the loss per step.

    Closed however the loop ends (:meth:`close`), so an error is printed on a line of its own.
    """

    def __init__(self, desc: str, total: int, initial: int, show: bool):
        # TQDM_DISABLE=1 hides it too (the Ray workers: the driver has the bar); read here, as tqdm
        # reads it once, when it is imported
        hidden = not show or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true")
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", disable=hidden)

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{event.loss:.4f}")

    def close(self) -> None:
        self.bar.close()


class TensorBoard:
    """``--report_to tensorboard``: each step's loss (and its parts) and learning rate."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            tracking.log_step(
                self.accelerator, event.step, {"loss": event.loss, **event.losses, "lr": event.lr}
            )


class Heartbeat:
    """The rank's status for ``helpers.launch``'s stall detection: ``training`` and the step, each step."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            status.beat("training", event.step)
            faults.stall_after_step(self.rank, event.step)  # test-only


def run_listeners(accelerator, desc: str, total: int, initial: int) -> tuple[ProgressBar, list[Listener]]:
    """The loop's listeners for one run: the progress bar (returned too, to be closed), TensorBoard, the heartbeat."""
    bar = ProgressBar(desc, total, initial, accelerator.is_local_main_process)
    return bar, [bar, TensorBoard(accelerator), Heartbeat(accelerator.process_index)]

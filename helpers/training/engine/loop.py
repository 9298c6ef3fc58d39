"""The run loop: a training run's life, once, for every method (Textual Inversion, DreamBooth-LoRA).

:func:`train` checks the inputs (the method's, then the folder and the checkpoint:
:func:`check_resume`), holds the folder's lock, sets up (:meth:`Method.setup`), waits for every
rank, resumes, prepares the folder, then steps (:func:`train_loop`: per step the method's
micro-batches, the losses averaged over the ranks, a :class:`~helpers.training.engine.events.StepEnded`
to the listeners, checkpoints and rotation, the method's periodic saves) and finishes
(:func:`finish`: the ranks agree, the weights, history and the method's outputs, then
``run_summary.json`` last). A method (:class:`Method`) supplies only what differs; the update
after a step's micro-batches is :func:`helpers.training.engine.step.apply_update` for both.
The picture: docs/architecture.md, "The run loop and its two methods".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from helpers.core import cpu
from helpers.core.outputs import HISTORY, HISTORY_PARTIAL, SUMMARY
from helpers.ranks import faults, status
from helpers.training.engine import TrainingInputError, events, prepack, tracking
from helpers.training.engine.checkpoints import (
    check_not_past_the_end,
    checkpoint_step,
    list_checkpoints,
    load_history,
    load_state,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from helpers.training.engine.folder import (
    FINISHED,
    OutputFolder,
    RunLayout,
    check_checkpoint_matches,
    checkpoint_settings,
    clear_leftovers,
    clear_run,
    hold_output_dir,
    inspect_output_dir,
)
from helpers.training.engine.saving import storage_errors, write_json
from helpers.training.engine.step import AllreduceCounter, EpochSampler

logger = get_logger(__name__)


@dataclass(kw_only=True)
class Run:
    """A run ready to train: what the loop needs of every method's run (each method adds its own).

    Attributes:
        config: the settings.
        accelerator: the processes, precision and prepared objects.
        precision: the precision chosen for this CPU (:func:`helpers.core.cpu.choose_precision`).
        model_dir: the local folder of the base model.
        output_dir: where the run writes.
        optimizer, lr_scheduler: prepared by accelerate, over what is trained only.
        sampler, loader: the data order and the prepared loader.
        steps_per_epoch, max_steps: the schedule.
        counter: the one gradient all-reduce and its byte count (all-reduces only with several processes).
        startup: what start-up did, recorded in ``run_summary.json``.
        prepacked: how many frozen layers compute on weights laid out once (:mod:`~helpers.training.engine.prepack`):
            the loop makes their copies before the first step (:func:`lay_out`).
    """

    config: Any
    accelerator: Accelerator
    precision: cpu.PrecisionChoice
    model_dir: Path
    output_dir: Path
    optimizer: Any
    lr_scheduler: Any
    sampler: EpochSampler
    loader: Any
    steps_per_epoch: int
    max_steps: int
    counter: AllreduceCounter = field(default_factory=AllreduceCounter)
    startup: dict = field(default_factory=dict)
    prepacked: int = 0

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.max_steps / self.steps_per_epoch)


class Method:
    """What a trainer supplies to the loop; the defaults do nothing.

    Attributes:
        name: the trackers' project name (``textual_inversion``).
        title: the progress bar's (``textual inversion``).
        layout: what it writes into ``output_dir``.
        weights_name: what its weights file is, in words (named when the disk is full).
        identical_key: the summary's key saying whether every rank ended with the same weights.
    """

    name: str
    title: str
    layout: RunLayout
    weights_name: str
    identical_key: str

    def check_inputs(self, config) -> Any:
        """Every cheap check, before any model loads (with :func:`check_resume`); what :meth:`setup`
        needs, with the checkpoint to resume as its ``checkpoint``."""
        raise NotImplementedError

    def setup(self, config, checked) -> Run:
        """Accelerator, models, what is trained, cached inputs, optimizer, loader, schedule."""
        raise NotImplementedError

    def step(self, run: Run, micro_batches: list[dict], epoch: int, step: int) -> torch.Tensor:
        """One optimisation step; this process's mean losses (the total first, then :meth:`loss_parts`)."""
        raise NotImplementedError

    def forward(self, run: Run, micro_batch: dict, epoch: int) -> Callable[[], Any]:
        """One micro-batch's inputs, and its forward from them to the loss :meth:`step` back-propagates,
        to be called (the loop calls it once on fake tensors before the first step, to lay out the
        frozen weights: :func:`lay_out`)."""
        raise NotImplementedError

    def images_per_step(self, run: Run) -> int:
        """Pictures one optimisation step trains on, over every process."""
        raise NotImplementedError

    def trained(self, run: Run) -> torch.Tensor:
        """Every trained value, flat (to check the ranks agree)."""
        raise NotImplementedError

    def write_weights(self, run: Run, folder: Path) -> None:
        """Write the weights file(s) into ``folder`` (a checkpoint's, or ``output_dir``)."""
        raise NotImplementedError

    def summary_extras(self, run: Run) -> dict:
        """Main process, once the outputs are written: the method's entries of ``run_summary.json``."""
        return {}

    def result(self, run: Run, history: list[dict], summary: dict) -> Any:
        """What ``train`` returns."""
        raise NotImplementedError

    def loss_parts(self, run: Run) -> tuple[str, ...]:
        """The names of the loss's parts :meth:`step` returns after the total (history keys)."""
        return ()

    def load_checkpoint(self, run: Run, ckpt: Path) -> None:
        """Load what accelerate's state does not hold of a checkpoint (before it is loaded)."""

    def running(self, run: Run) -> AbstractContextManager:
        """Around the steps and the outputs (e.g. a copy made while training, discarded at the end)."""
        return contextlib.nullcontext()

    def after_step(self, run: Run, step: int) -> None:
        """What the method saves after a step (every rank calls it; only the main process writes)."""

    def after_epoch(self, run: Run, epoch: int, step: int) -> None:
        """What the method does after an epoch that is not the run's last."""

    def write_outputs(self, run: Run, steps: int) -> None:
        """Main process: the final outputs besides the weights and the history (samples, pipeline)."""


# --- before any model loads -----------------------------------------------------------------------


def check_resume(config, folder: OutputFolder) -> Path | None:
    """The checkpoint to resume, if any: complete, of this run, not past its last step.

    Of this run: its :attr:`RunLayout.identity` settings and its learning rate equal (accelerate's
    state in the checkpoint holds the optimizer's learning rate, which a resume would keep
    whatever the flag said); not past the end: saved at or before ``max_train_steps``, and not
    going backwards from a finished run (:func:`check_not_backwards`).

    Args:
        config: the settings.
        folder: the output folder, as :func:`helpers.training.engine.folder.check_output_dir` found it.

    Raises:
        TrainingInputError: the checkpoint cannot be resumed; the message says the fix.
    """
    if not config.resume_from_checkpoint:
        return None
    ckpt = resolve_checkpoint(folder.path, config.resume_from_checkpoint)
    check_checkpoint_matches(ckpt, config, folder.layout)
    saved = checkpoint_settings(ckpt, folder.layout).get("learning_rate")
    if saved is not None and float(saved) != config.learning_rate:
        raise TrainingInputError(
            f"resume_from_checkpoint {ckpt} was trained with learning_rate {float(saved):g}, this run asks "
            f"for {config.learning_rate:g}; the checkpoint's optimizer would go on with {float(saved):g}. "
            f"Fix: resume with --learning_rate {float(saved):g}, or start a new run in another output_dir."
        )
    if config.max_train_steps is not None:
        check_not_past_the_end(ckpt, config.max_train_steps)
        check_not_backwards(folder, config.max_train_steps)
    return ckpt


def finished_steps(output_dir: Path) -> int | None:
    """The steps of the finished run in ``output_dir`` (its ``run_summary.json``), or None."""
    try:
        return int(json.loads((Path(output_dir) / SUMMARY).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_not_backwards(folder: OutputFolder, max_steps: int) -> None:
    """Refuse to resume a finished run to fewer steps than it took: its result would be replaced
    by an earlier step's.

    Raises:
        TrainingInputError: with the fixes.
    """
    done = finished_steps(folder.path) if folder.state == FINISHED else None
    if done is not None and max_steps < done:
        raise TrainingInputError(
            f"output_dir {folder.path} holds a run that finished at step {done}; resuming it with "
            f"max_train_steps={max_steps} would replace that result by an earlier step's. Fix: pass "
            f"--max_train_steps {done} or more to continue it, or choose another output_dir."
        )


# --- the run's life -------------------------------------------------------------------------------


def train(method: Method, config) -> Any:
    """Run ``method`` as configured; return what it produced (:meth:`Method.result`).

    Works the same in one process and under every launcher: every process calls it; only the
    main process writes outputs, holding ``output_dir``'s lock from before the models load.
    """
    called = time.perf_counter()
    checked = method.check_inputs(config)  # the folder, pictures and checkpoint, before any model work
    # One run per folder: a second is refused with our pid. The VAE's encoding in set-up and every
    # step allocate and free gigabytes: freed memory is kept for what comes next (cpu.keep_freed_memory).
    with hold_output_dir(config, method.layout), cpu.keep_freed_memory():
        run = method.setup(config, checked)
        # Every rank has read the output folder's state (check_inputs) before the main process
        # changes it (prepare_output_dir). Starting the process group usually waits for all ranks
        # anyway; under Ray Train the group exists before train() is called, so wait here.
        run.accelerator.wait_for_everyone()
        start = resume(method, run, checked.checkpoint)
        history = prepare_output_dir(run, method.layout, start)
        tracking.start(run.accelerator, method.name, dataclasses.asdict(config))
        with method.running(run):
            if start < run.max_steps:
                last = train_loop(method, run, start, history, called)
            else:  # a run never trains past max_steps: resumed at its last step, it only writes the outputs
                record_startup(run, called)
                last = start
            return finish(method, run, history, last)


def resume(method: Method, run: Run, ckpt: Path | None) -> int:
    """Load the checkpoint (if any) into the run; return the step training continues after (0: none).

    Raises:
        TrainingInputError: the checkpoint was saved past ``max_steps`` (which may come from
            ``num_train_epochs``), the resume would go backwards from a finished run, or a file
            in the checkpoint cannot be loaded.
    """
    if ckpt is None:
        return 0
    check_not_past_the_end(ckpt, run.max_steps)  # max_steps may come from num_train_epochs
    check_not_backwards(inspect_output_dir(run.output_dir, method.layout), run.max_steps)
    method.load_checkpoint(run, ckpt)
    load_state(run.accelerator, ckpt)
    step = checkpoint_step(ckpt)
    logger.info(f"resumed from {ckpt} at step {step}", main_process_only=True)
    return step


def prepare_output_dir(run: Run, layout: RunLayout, start: int) -> list[dict]:
    """Make ``output_dir`` ready; return the history so far (steps 1..``start``).

    The main process removes what the settings replace (``overwrite_output_dir``: every file of
    an earlier run; always: temporaries of killed writes, and the summary of a run resumed after
    it finished, which is not finished again until its outputs are), then writes the settings.
    """
    config, output_dir = run.config, run.output_dir
    if run.accelerator.is_main_process:
        if config.overwrite_output_dir and not config.resume_from_checkpoint:
            clear_run(output_dir, layout)
        else:
            clear_leftovers(output_dir, layout)
        (output_dir / SUMMARY).unlink(missing_ok=True)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / layout.config_file)
    run.accelerator.wait_for_everyone()
    return load_history(output_dir, start) if start else []


def record_startup(run: Run, called: float) -> None:
    """Note in ``run.startup`` how long start-up took, up to the first step (its own time is in the history)."""
    run.startup["seconds_to_first_step"] = time.perf_counter() - called
    # the whole process: interpreter start, imports, then train()
    run.startup["process_seconds_to_first_step"] = cpu.process_age()
    logger.info(f"start-up took {run.startup['seconds_to_first_step']:.1f} s", main_process_only=True)


# --- the steps ------------------------------------------------------------------------------------


def _step_groups(loader: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """The loader's micro-batches, ``size`` per optimisation step (fewer at the end of an epoch)."""
    group: list[dict] = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def schedule(run: Run, start: int) -> Iterator[tuple[int, list[dict], bool]]:
    """``(epoch, micro_batches, ends_epoch)`` of each optimisation step after step ``start``, in order."""
    accumulate = run.config.gradient_accumulation_steps
    first_epoch = start // run.steps_per_epoch
    skip = (start % run.steps_per_epoch) * accumulate  # micro-batches of this epoch already trained
    for epoch in range(first_epoch, run.num_epochs):
        run.sampler.epoch = epoch
        loader = run.loader
        if epoch == first_epoch and skip:
            loader = run.accelerator.skip_first_batches(run.loader, skip)
        groups = _step_groups(loader, accumulate)
        current = next(groups, None)
        for following in groups:
            yield epoch, current, False
            current = following
        if current is not None:
            yield epoch, current, True


def lay_out(method: Method, run: Run, micro_batch: dict, epoch: int) -> None:
    """Make the prepacked layers' copies now, for the first step's micro-batch, so that the first step
    runs at the pace of the others (:func:`helpers.training.engine.prepack.lay_out`; its time is
    start-up's, recorded as ``startup["laid_out"]``)."""
    if not run.prepacked:
        return
    status.beat("laying out weights")
    began = time.perf_counter()
    layers = prepack.lay_out(method.forward(run, micro_batch, epoch), run.prepacked)
    run.startup["laid_out"] = {"layers": layers, "seconds": round(time.perf_counter() - began, 3)}


def train_loop(method: Method, run: Run, start: int, history: list[dict], called: float) -> int:
    """Train from step ``start`` to ``run.max_steps``, appending to ``history``; return the last step.
    ``called``: when :func:`train` was called (start-up ends here, once the weights are laid out)."""
    accelerator, config, step = run.accelerator, run.config, start
    parts, images = method.loss_parts(run), method.images_per_step(run)
    steps = schedule(run, start)
    first = next(steps)
    lay_out(method, run, first[1][0], first[0])
    record_startup(run, called)
    bar, listeners = events.run_listeners(accelerator, method.title, run.max_steps, step)
    began = time.perf_counter()
    # The bar is closed however the loop ends, so an error is printed on a line of its own.
    with contextlib.closing(bar):
        for epoch, micro_batches, ends_epoch in itertools.chain([first], steps):
            local = method.step(run, micro_batches, epoch, step + 1)
            step += 1
            loss, *values = accelerator.reduce(local, reduction="mean").tolist()
            seconds = time.perf_counter() - began
            ended = events.StepEnded(step, run.max_steps, loss, run.lr_scheduler.get_last_lr()[0], seconds,
                                     images / seconds if seconds else None, dict(zip(parts, values, strict=True)))  # fmt: skip
            history.append(ended.history_record())
            events.publish(ended, listeners)
            if step % config.checkpointing_steps == 0:
                save_checkpoint_now(method, run, step, history)
            method.after_step(run, step)
            if step >= run.max_steps:
                break
            if ends_epoch:
                method.after_epoch(run, epoch, step)
            began = time.perf_counter()
    return step


def save_checkpoint_now(method: Method, run: Run, step: int, history: list[dict]) -> Path:
    """Save ``checkpoints/checkpoint-N`` (:func:`helpers.training.engine.checkpoints.save_checkpoint`)."""
    status.beat("saving" if run.accelerator.is_main_process else status.WAITING, step)
    saved = save_checkpoint(run.accelerator, run.config, run.output_dir, step, history,
                            lambda folder: method.write_weights(run, folder), method.layout.config_file)  # fmt: skip
    events.publish(events.Saved(step, "checkpoint", saved))
    return saved


# --- the end --------------------------------------------------------------------------------------


def summary(run: Run, history: list[dict], steps: int, images_per_step: int) -> dict:
    """The entries of ``run_summary.json`` every method has."""
    accelerator = run.accelerator
    timed = [h["seconds"] for h in history[1:]] or [h["seconds"] for h in history]  # step 1 includes warm-up
    seconds_per_step = sum(timed) / max(len(timed), 1)
    return {
        "world_size": accelerator.num_processes,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "steps": steps,
        "final_loss": history[-1]["loss"] if history else None,
        "seconds_per_step": seconds_per_step,
        "steps_per_second": 1.0 / seconds_per_step if seconds_per_step else None,
        "images_per_second": images_per_step / seconds_per_step if seconds_per_step else None,
        "training_seconds": sum(h["seconds"] for h in history),
        "precision": run.precision.mixed_precision,
        "precision_reason": run.precision.reason,
        "allreduce_bytes_per_step": run.counter.bytes // max(run.counter.calls, 1),
        "allreduce_calls": run.counter.calls,  # one per optimizer step, none per accumulated micro-batch
        "threads_per_process": torch.get_num_threads(),
        "startup": run.startup,  # seconds to the first step, what the latent cache and prepacking did
    }


def finish(method: Method, run: Run, history: list[dict], steps: int) -> Any:
    """Check the ranks agree, then (main process) the weights, history, the method's outputs and,
    last, ``run_summary.json``; then the teardown. Returns :meth:`Method.result` (the summary is
    empty on the other processes)."""
    accelerator, output_dir = run.accelerator, run.output_dir
    gathered = accelerator.gather(method.trained(run).detach()[None])
    identical = bool(all(torch.equal(gathered[0], g) for g in gathered))
    del gathered  # a collective's output: gloo's thread must not be the one to free it at teardown
    found: dict = {}
    status.beat("saving" if accelerator.is_main_process else status.WAITING, steps)
    if accelerator.is_main_process:
        with storage_errors(output_dir / method.layout.weights_file, method.weights_name):
            method.write_weights(run, output_dir)
            write_json(output_dir / HISTORY, history)
        (output_dir / HISTORY_PARTIAL).unlink(missing_ok=True)  # history.json holds it all now
        kept = list_checkpoints(output_dir)
        if kept:  # a run resumed at its end saved none, yet the limit holds when it finishes
            prune_checkpoints(output_dir, keep=kept[-1], limit=run.config.checkpoints_total_limit)
        method.write_outputs(run, steps)
        found = summary(run, history, steps, method.images_per_step(run))
        found.update(method.summary_extras(run), **{method.identical_key: identical})
        write_json(output_dir / SUMMARY, found)  # written last: marks a finished run
    events.publish(events.Saved(steps, "outputs", output_dir))
    # Teardown in a safe order: every collective's output dropped (above), every rank past the
    # barrier (no collective in flight), then the process group destroyed. Measured with torch
    # 2.13: once torch._dynamo is imported (any optimizer step does) gloo's threads outlive
    # destroy_process_group until the interpreter exits, so nothing may be left for them to free.
    accelerator.wait_for_everyone()
    faults.delay_in_collective_thread(accelerator.process_index)  # test-only: issue 11's exit race
    accelerator.end_training()  # destroys the process group (MPICH aborts a rank that skips it)
    return method.result(run, history, found)

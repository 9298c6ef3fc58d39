"""Test-only fault injection: environment variables that make a rank misbehave on purpose.

Never set in normal runs; the tests and ``bench/exit_deadlock.py`` set them to reproduce failures
that otherwise depend on timing or on a broken machine:

* ``WORKSHOP_TEST_EXIT_DELAY=S``: at teardown, after the last barrier, one all-reduce runs whose
  completion callback sleeps S seconds in gloo's worker thread and then needs the GIL back, as
  gloo's worker does when it frees a Python-owned tensor. The process group's threads are joined
  while the callback sleeps: where that join holds the GIL (a DDP reducer freed with the last
  reference to the group, issue 11), the process hangs for good; where it releases the GIL (the
  process group destroyed by ``destroy_process_group``), the run ends S seconds later.
* ``WORKSHOP_TEST_HANG_RANK=R``: rank R sleeps for an hour after training, outputs written.
* ``WORKSHOP_TEST_STALL=R:S``: rank R sleeps for an hour after its step S (alive, no progress).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

EXIT_DELAY = "WORKSHOP_TEST_EXIT_DELAY"
HANG_RANK = "WORKSHOP_TEST_HANG_RANK"
STALL = "WORKSHOP_TEST_STALL"
_FOREVER = 3600.0


def delay_in_collective_thread(rank: int) -> None:
    """With ``WORKSHOP_TEST_EXIT_DELAY`` set, keep gloo's worker thread busy at teardown (see above)."""
    seconds = float(os.environ.get(EXIT_DELAY) or 0)
    if seconds <= 0 or not dist.is_initialized():
        return
    if rank != 0:
        time.sleep(0.5)  # rank 0 attaches its callback before the all-reduce can complete
    future = dist.all_reduce(torch.zeros(1), async_op=True).get_future()
    if rank == 0:
        future.then(lambda f: time.sleep(seconds))  # runs in gloo's worker thread
    future.wait()  # the all-reduce's own future is marked done before its callbacks run


def hang_after_training(rank: int) -> None:
    """With ``WORKSHOP_TEST_HANG_RANK`` equal to ``rank``, never return (until killed)."""
    if os.environ.get(HANG_RANK, "") == str(rank):
        time.sleep(_FOREVER)


def stall_after_step(rank: int, step: int) -> None:
    """With ``WORKSHOP_TEST_STALL`` equal to ``rank:step``, stop making progress after that step."""
    if os.environ.get(STALL, "") == f"{rank}:{step}":
        time.sleep(_FOREVER)

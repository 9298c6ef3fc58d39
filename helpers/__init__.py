"""helpers: the small, tested package behind the Stable Diffusion on CPU clusters workshop.

Grouped by what it does: ``core`` (errors, files, the CPU), ``training`` (the textual-inversion
engine), ``dreambooth``, ``launching`` (the launcher's side of a multi-process job), ``ranks`` (a
rank's side), ``cluster`` (Azure, prices, the scaling model), ``inference``, ``toyworld`` and
``workshop`` (notebooks, handouts, plots, forms). Every module is listed once, in
``docs/architecture.md``. Import the module you need, e.g. ``from helpers.training import models``.
"""

import os

from helpers.core.quiet import install_log_filters

__version__ = "0.1.0"

install_log_filters()  # known third-party noise, listed with reasons in helpers/core/quiet.py

# Same inputs, same numbers. Without MKL's conditional numerical reproducibility, on an Intel Xeon
# two identical 2-thread runs differed in the gradients' last digits (MKL picks its kernels per call,
# e.g. by memory alignment), so a resumed run no longer equalled the uninterrupted one. AUTO keeps
# the CPU's fastest code path; STRICT makes it reproducible for a given thread count. Set before MKL
# does any work; children (every rank) inherit it; a value already set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

"""The benchmarks (``python -m bench.<name>``): results in ``bench/results``, tables by ``bench.report``."""

# helpers first: its log filters and MKL settings must be in place before diffusers and torch load
import helpers  # noqa: F401

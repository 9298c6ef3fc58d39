"""The known-noise filters: what they drop, and that the rest of a library's output still shows."""

from __future__ import annotations

import logging

import pytest

from helpers.core import quiet


def test_cache_position_deprecation_is_dropped_and_other_warnings_kept(caplog):
    quiet.install_log_filters()
    logger = logging.getLogger("transformers.masking_utils")
    with caplog.at_level(logging.WARNING):
        logger.warning("`cache_position` is deprecated as an arg, and will be removed in Transformers v5.6.")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == ["something else"]


def test_nncf_progress_bars_draw_nowhere(capsys):
    pytest.importorskip("nncf")
    import rich
    from nncf.common.logging.track_progress import track

    try:
        quiet.quiet_weight_compression()
        assert list(track(range(5), description="Statistics collection")) == [0, 1, 2, 3, 4]
        rich.print("also nowhere")
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", "")
    finally:
        rich.reconfigure()  # the default console again, for the rest of this process

"""blockfold's progress bars: tqdm's, hidden on every process but the first and while a command runs
quietly (``-q``), together with the bars of transformers and huggingface_hub."""

from __future__ import annotations

import contextlib

from tqdm.auto import tqdm

_quiet = False


def bar(iterable=None, *, show: bool = True, **options) -> tqdm:
    """A tqdm bar over ``iterable`` (or of ``total=``), hidden where ``show`` is False or quietly."""
    return tqdm(iterable, disable=not show or _quiet, **options)


@contextlib.contextmanager
def quietly():
    """No progress bar while the block runs, blockfold's or the libraries'; each switch put back after."""
    global _quiet
    from huggingface_hub import utils as hub
    from transformers.utils import logging as transformers_logging

    before = _quiet, hub.are_progress_bars_disabled(), transformers_logging.is_progress_bar_enabled()
    _quiet = True
    hub.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        _quiet = before[0]
        if not before[1]:
            hub.enable_progress_bars()
        if before[2]:
            transformers_logging.enable_progress_bar()

"""Named methods, each a short composition of statistics, selection, estimation and surgery.

A method is a function of a ``Job`` (model, its own typed settings from ``settings.py``, calibration
data, a runner for passes) returning its manifest entries. The registry is ``settings.SETTINGS``:
each settings class names its function (``runner``), so the recipe validates without importing
this package, and ``METHODS`` here is derived from it.
"""

from __future__ import annotations

import importlib
from typing import Callable

from blockfold.methods.base import Job, PassCache
from blockfold.settings import SETTINGS


def _runner(path: str) -> Callable[[Job], dict]:
    module, function = path.split(":")
    return getattr(importlib.import_module(module), function)


#: method name → function(job) -> manifest entries
METHODS: dict[str, Callable[[Job], dict]] = {name: _runner(cls.runner) for name, cls in SETTINGS.items()}

__all__ = ["METHODS", "Job", "PassCache"]

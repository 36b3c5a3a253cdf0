"""Named methods, each a short composition of statistics, selection, estimation and surgery.

A method is a function of a ``Job`` (model, its own typed settings from ``settings.py``, calibration
data, a runner for passes) returning its manifest entries. The registry is ``settings.SETTINGS``:
each settings class names its function (``runner``), so the recipe validates without importing
this package, and ``METHODS`` here is derived from it. ``run_stages`` chains the stages a recipe asks for:
the method, then the downstream refit where its settings ask for one and the method does not run it
within its own surgery.
"""

from __future__ import annotations

import importlib
from typing import Callable

from blockfold.methods.base import Job, PassCache
from blockfold.settings import SETTINGS, RefitStage


def function_at(path: str) -> Callable:
    """The function ``module:function`` names (a method's runner, its planner), its module imported now."""
    module, function = path.split(":")
    return getattr(importlib.import_module(module), function)


class _Functions(dict):
    """Method name → function(job) -> manifest entries; a method registered after this import is
    looked up in the registry when first asked for."""

    def __missing__(self, name: str) -> Callable[[Job], dict]:
        function = self[name] = function_at(SETTINGS[name].runner)
        return function


METHODS: dict[str, Callable[[Job], dict]] = _Functions({name: function_at(cls.runner) for name, cls in SETTINGS.items()})



def run_stages(job: Job) -> dict:
    """The job's method and the stages after it; returns the manifest entries."""
    method = METHODS[job.settings.method]
    settings = job.settings
    try:
        if isinstance(settings, RefitStage) and settings.refit != "none" and not settings.refits_within:
            from blockfold.methods.refit import refit_after

            return refit_after(job, method)
        return method(job)
    finally:
        if job.streams is not None:  # a recorded stream no stage read (its folder, if on disk, goes too)
            job.streams.close()
            job.streams = None


__all__ = ["METHODS", "Job", "PassCache", "function_at", "run_stages"]

"""What every method is handed: the model, its own settings, the calibration data, a runner for
passes (whose pipeline it never asks about) and, optionally, a cache of passes already measured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from blockfold.adapters import DecoderAdapter
from blockfold.data import CalibrationSet
from blockfold.models.handle import ModelHandle
from blockfold.pipelines import Runner, StreamRecorder
from blockfold.settings import MethodSettings
from blockfold.stats.activations import Observer


class PassCache:
    """Results of passes already run, for compressions of the same weights on the same calibration
    set (a sweep over budgets): an entry is served to any later request it covers, and only to
    weights with the same fingerprint."""

    def __init__(self) -> None:
        self._entries: list[tuple[str, str, int, dict, object]] = []

    def find(self, kind: str, fingerprint: str, calibration: CalibrationSet, covers: Callable[[dict], bool]):
        """An entry of ``kind`` (which pass: "spans", "linearity") that ``covers`` accepts."""
        for entry_kind, entry_fingerprint, calibration_id, what, value in self._entries:
            if (entry_kind, entry_fingerprint, calibration_id) == (kind, fingerprint, id(calibration)) and covers(what):
                return value
        return None

    def add(self, kind: str, fingerprint: str, calibration: CalibrationSet, what: dict, value) -> None:
        self._entries.append((kind, fingerprint, id(calibration), what, value))


@dataclass
class Job:
    handle: ModelHandle
    settings: MethodSettings
    calibration: CalibrationSet
    runner: Runner
    cache: PassCache | None = None
    seed: int = 0  # for token subsamples (the calibration config's seed)
    #: what the method decided about memory (screening, budgets), for the manifest
    notes: dict = field(default_factory=dict)
    #: the unedited model's stream from the method's first pass, for the downstream refit (which then
    #: needs no pass of its own to read it); closed by whoever reads it, or when the job ends
    streams: StreamRecorder | None = None

    @property
    def adapter(self) -> DecoderAdapter:
        return self.handle.adapter

    @property
    def model(self) -> nn.Module:
        return self.handle.model

    @property
    def num_layers(self) -> int:
        return self.handle.num_layers()

    @property
    def hidden_size(self) -> int:
        return self.adapter.hidden_size(self.model)

    def run(self, observers: list[Observer], description: str = "calibration pass",
            recorders: list[StreamRecorder] = ()) -> None:
        self.runner.run(self.calibration, observers, description, recorders)

"""Calibration sources → token batches with attention masks."""

from blockfold.data.calibration import Batch, CalibrationSet, batch_sequences, build_calibration

__all__ = ["Batch", "CalibrationSet", "batch_sequences", "build_calibration"]

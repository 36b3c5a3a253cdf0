"""Small, self-explanatory PNG figures (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(figure, path: Path, dpi: int = 110) -> Path:
    """Write the figure as PNG and release it."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def span_heatmap(distances: np.ndarray, best_starts: dict[int, int], path: Path, title: str) -> Path:
    """``distances[start, length]`` (NaN where a span does not fit) as a start × length heatmap,
    with ``best_starts`` (length → start) marked."""
    figure, axis = plt.subplots(figsize=(7, 4.5))
    distances = distances.copy()
    distances[0] = np.nan  # the first block is never removed
    shown = np.ma.masked_invalid(distances[:, 1:].T)
    image = axis.imshow(shown, origin="lower", aspect="auto", cmap="viridis",
                        extent=(-0.5, distances.shape[0] - 0.5, 0.5, distances.shape[1] - 0.5))
    for length, start in best_starts.items():
        axis.plot(start, length, "w.", markersize=5)
    axis.set_xlabel("first removed block (span start)")
    axis.set_ylabel("blocks removed (span length)")
    axis.set_title(title)
    figure.colorbar(image, ax=axis, label="angular distance")
    return save(figure, path)


def similarity_matrix(matrix: np.ndarray, path: Path, title: str, label: str) -> Path:
    figure, axis = plt.subplots(figsize=(5.2, 4.5))
    image = axis.imshow(matrix, origin="lower", cmap="magma", vmin=float(np.nanmin(matrix)), vmax=1.0)
    axis.set_xlabel("layer boundary j (0 = embeddings)")
    axis.set_ylabel("layer boundary i")
    axis.set_title(title)
    figure.colorbar(image, ax=axis, label=label)
    return save(figure, path)


def per_layer_lines(series: dict[str, list[float]], path: Path, title: str, ylabel: str, log: bool = False) -> Path:
    figure, axis = plt.subplots(figsize=(7, 3.6))
    for name, values in series.items():
        axis.plot(range(len(values)), values, marker="o", markersize=3, label=name)
    if log:
        axis.set_yscale("log")
    axis.set_xlabel("layer")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return save(figure, path)

"""Second moments of what each linear projection of a block reads, for width methods (SVD-LLM's whitening):
``Σ x xᵀ`` over calibration tokens, float64, per layer and per distinct input. Projections that read
one tensor (q, k and v; gate and up) share one sum, kept under their names joined by "+"."""

from __future__ import annotations

import torch

from blockfold.stats.activations import LayerActivations
from blockfold.stats.sums import add_sum


class InputCovariance:
    """Observer: ``Σ x xᵀ`` and the token count of every projection input of ``layers`` (default: all)."""

    SUMS = ("tokens", "_gram")
    ROWS = ()
    needs_projection_inputs = True

    def __init__(self, num_layers: int, layers: list[int] | None = None, input_widths: list[int] = ()):
        self.num_layers = num_layers
        self.layers = sorted(layers) if layers is not None else list(range(num_layers))
        self.last_layer = max(self.layers)
        #: widths of one layer's distinct projection inputs (for the memory plan only)
        self.input_widths = list(input_widths)
        self.tokens = [0] * num_layers
        self._gram: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]

    # -- memory ---------------------------------------------------------------------------
    @staticmethod
    def sums_bytes_for(num_layers: int, input_widths: list[int]) -> int:
        return num_layers * sum(width * width for width in input_widths) * 8

    def sums_bytes(self, hidden_size: int) -> int:
        return self.sums_bytes_for(len(self.layers), self.input_widths)

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        """The captured inputs of one layer (per batch and joined) and the float64 copy of the widest."""
        return 2 * sum(self.input_widths) * element + 8 * max(self.input_widths, default=0)

    # -- streaming ------------------------------------------------------------------------
    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index not in self.layers:
            return
        index, inputs = acts.index, acts.projection_inputs
        groups: list[tuple[torch.Tensor, list[str]]] = []  # each distinct input and the projections reading it
        for name, rows in inputs.items():
            group = next((names for tensor, names in groups if tensor is rows), None)
            if group is None:
                groups.append((rows, [name]))
            else:
                group.append(name)
        for rows, names in groups:
            x = rows.double()
            add_sum(self._gram[index], "+".join(names), x.T @ x)
        self.tokens[index] += next(iter(inputs.values())).shape[0]

    def end_batch(self) -> None:
        """Nothing is carried from one layer to the next."""

    # -- combining and reading ------------------------------------------------------------
    def merge(self, other: "InputCovariance") -> "InputCovariance":
        for index in range(self.num_layers):
            self.tokens[index] += other.tokens[index]
            for name, gram in other._gram[index].items():
                add_sum(self._gram[index], name, gram)
        return self

    def covariance(self, index: int, name: str) -> torch.Tensor:
        """``Σ x xᵀ`` of what projection ``name`` of layer ``index`` reads (float64, not divided by the count)."""
        return next(gram for key, gram in self._gram[index].items() if name in key.split("+"))


class StreamCovariance:
    """Observer: ``Σ u uᵀ`` of the residual stream every block's two sublayers read (each block's input and
    the stream after its attention half), pooled over the blocks, each token's row scaled to unit length
    ``u = h / ‖h‖`` as the sublayers' norms see it: SliceGPT's principal directions. Unscaled, the few
    tokens with massive activations (the first token's, a thousand times the others' norm) would decide
    the directions alone."""

    SUMS = ("tokens", "_gram")
    ROWS = ()

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.last_layer = num_layers - 1
        self.tokens = 0
        self._gram: dict[str, torch.Tensor] = {}

    @staticmethod
    def sums_bytes_for(hidden_size: int) -> int:
        return hidden_size * hidden_size * 8

    def sums_bytes(self, hidden_size: int) -> int:
        return self.sums_bytes_for(hidden_size)

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        return 2 * hidden_size * 8  # the float64 copies of one layer's two streams

    def on_layer(self, acts: LayerActivations) -> None:
        streams = torch.cat([acts.block_in.double(), acts.attn_residual.double()])
        streams = streams / streams.norm(dim=-1, keepdim=True).clamp(min=1e-30)
        add_sum(self._gram, "stream", streams.T @ streams)
        self.tokens += acts.block_in.shape[0]

    def end_batch(self) -> None:
        """Nothing is carried from one layer to the next."""

    def merge(self, other: "StreamCovariance") -> "StreamCovariance":
        self.tokens += other.tokens
        for name, gram in other._gram.items():
            add_sum(self._gram, name, gram)
        return self

    def covariance(self) -> torch.Tensor:
        """``Σ u uᵀ`` of every block's two streams' unit rows (float64, not divided by the count)."""
        return self._gram["stream"]

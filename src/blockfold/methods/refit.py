"""Refit the down-projections from the block before a removed span onward, so that the compressed
model's residual stream follows the original's where the error of the removal travels (issue #16).

ReplaceMe repairs the stream at one point: the map folded into the block before the span is fitted
on the original activations, and what it misses passes through every later block unchecked. Here,
layer by layer in closed form (the per-layer least squares that GPTQ and SparseGPT solve), the
down-projection of each block from the one before the span is refitted so that, on the compressed
model's own inputs, the block's output matches the original model's residual stream at that depth:

    min_W ‖ a W − (h_original − h_compressed + a W₀) ‖² + λ ‖W − W₀‖²

with ``a`` the projection's inputs, ``W₀`` its current weight (the fold included) and ``λ`` the
``refit_ridge`` times the mean of ``diag(aᵀa)`` (toward the current weight, not toward zero: a
direction the calibration tokens never excite keeps its weight). The block before the span is
fitted on the stream after the span, so its refit is ReplaceMe's map on the ``intermediate``-sized
activations instead of the ``hidden``-sized output: a superset of the fold, with the same weights.
No parameter is added, so the output is the same standard checkpoint as ReplaceMe's.

The refit is a stage: it follows ReplaceMe (and UIDL, which is ReplaceMe's surgery with the identity)
inside their own surgery, and any other method that removes blocks (drop-block, SLEB, Prune&Comp,
LaCo) through ``refit_after``, which takes an unedited twin of the model before the method runs and
records the original streams on it. Where the method compensated the removal (Prune&Comp divides every
later block's writes by its scale), the targets after each span are divided by the same factors.

The original streams the refit starts from (the input of the first refitted block and the stream
after each span) come from the method's first pass where it recorded them (ReplaceMe and UIDL record
every depth a span they may choose needs, ``pipelines.recording``), else from a pass of their own to
the end of the deepest span, before the surgery; after it, one
layer-by-layer pass runs the original stream and the compressed one side by side through the kept
blocks, refitting as it goes. Each fit runs a block only as far as it reads (a norm's output, the
attention half), and a refitted block's output is its output less the old down-projection's plus the
new one's on the inputs already captured (it is linear in that weight), so the block is not run again. Every process runs its share of the calibration sequences, and the
sums of each layer are reduced across processes before it is solved, so all end with the same weights.

With ``refit="attn+down"`` each refitted block's attention output projection is refitted first, by
the same least squares, so that the stream after the attention half (its input plus what attention
adds) matches the original model's at that point; the down-projection is then refitted with the new
attention weights in place (not in the block before the first span, which reads the original
stream). Still no parameter added.

With ``refit="all"`` (recipe version 10's default) each refitted block after the first also corrects
what it reads: before its attention output, one map ``M`` from the compressed stream's normed input
to the original's (``min ‖n_c M − n_o‖² + λ‖M − I‖²``) is folded into every projection that reads it
(q, k, v: ``W ← W Mᵀ``), and likewise before its down-projection for the MLP's (gate, up). Since those
projections share their input, this one solve is each one's ridge fit toward its weight. Where both
sublayers read one norm (phi's and cohere's parallel blocks) one map serves q, k, v and the MLP's input
projection together (``shared_inputs`` in the manifest). Still no parameter added.

With ``stream_scale`` (recipe version 9's default) the refit of the block before each span also
fits one scalar ``s`` on the rest of that block's output (its input plus its attention output), jointly
with the weight and in closed form: the span's magnitude gap, which a map on the MLP output cannot
close. The block writes ``W/s`` and every later block's writes are scaled by ``1/s``; every later block
and the final norm read the stream through a scale-invariant norm, so this is the stream ``s`` times
as large, with no parameter added and a tied embedding left alone. Later targets are divided by ``s``.

A block whose MLP output passes a norm before the residual add (Gemma's sandwich blocks) or is a
mixture of experts is run but its output projections are not refitted (the least squares above needs
the projection's output added to the stream as it is); the manifest lists such blocks. For the same
reason an attention output that passes a norm (or an attention already replaced by a map) is left as
it is. The input maps of ``all`` need no such add, so with ``sandwich_inputs`` (``refit_sandwich``, recipe version 11's default) a
sandwich block after the span still has the projections that read its normed inputs corrected; the
block before the span, which reads the original stream, then has nothing refitted.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from blockfold import distributed
from blockfold.errors import BlockfoldError
from blockfold.estimate.lstsq import solve_normal_equations
from blockfold.methods.base import Job
from blockfold.models.handle import ModelHandle
from blockfold.pipelines import LayerProgram, StreamRecorder
from blockfold.pipelines.buffers import ActivationStore
from blockfold.progress import bar
from blockfold.stats.reconstruction import ProjectionEquations
from blockfold.surgery import scale_block_output

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemovedSpan:
    start: int  # original index of the span's first block
    length: int


class DownstreamRefit:
    """Use as a context around the surgery: entering records the original streams, ``apply()`` (after
    the spans are removed) refits, leaving frees the stored activations.

    ``blocks``: how many blocks to refit at each span, from the one before it.
    """

    def __init__(self, job: Job, spans: list[RemovedSpan], blocks: int, ridge: float, weighting: str = "none",
                 projections: str = "down", stream_scale: bool = False, sandwich_inputs: bool = False,
                 original: ModelHandle | None = None, compensation: list[float] | None = None,
                 recorded_only: bool = False):
        """``original``: an unedited twin to record the original streams on, for a refit entered after the
        removal (default: ``job.handle``, entered before it). ``compensation``: per span, the factor the
        removal already divided the stream after it by (Prune&Comp's scales, cumulative; default 1).
        ``recorded_only``: entered after the removal with the original streams recorded by the method's
        first pass and no twin, so a pass of its own would read the edited model (an error instead)."""
        self.recorded_only = recorded_only
        self.job, self.blocks, self.ridge, self.weighting = job, blocks, ridge, weighting
        self.original = original if original is not None else job.handle
        self.projections, self.stream_scale, self.sandwich_inputs = projections, stream_scale, sandwich_inputs
        #: refit the attention output projection (attn+down, all) / the projections reading the normed inputs (all)
        self.attention, self.inputs = projections in ("attn+down", "all"), projections == "all"
        order = sorted(range(len(spans)), key=lambda number: spans[number].start)
        self.spans = [spans[number] for number in order]
        self.compensation = [compensation[number] for number in order] if compensation else [1.0] * len(spans)
        #: a span at block 0 has no block before it: the refit starts at the first kept block
        self.from_start = self.spans[0].start == 0
        self.batches, _ = distributed.shard(list(job.calibration), distributed.current())
        self.store: ActivationStore | None = None
        self.recorded = False  # the original streams came from the first pass (no pass of the refit's own)
        reasons = {self._not_refittable(layer) for layer in job.handle.layers()}
        inputs_anywhere = any(self._inputs_only(layer) for layer in job.handle.layers())
        #: why no block of this model can be refitted (then no pass is spent on the streams), else None
        self.inapplicable = None if None in reasons or inputs_anywhere else ", ".join(sorted(reasons))
        #: a down-projection's inputs: what the refit keeps of each block beside the streams, and fits on
        self.intermediate = _intermediate_size(job.model.config, job.hidden_size)
        tokens = sum(int(batch.attention_mask.sum()) for batch in job.calibration)
        if self.inapplicable is None and tokens < self.intermediate:
            logger.warning("the refit fits down-projections of %d inputs on %d calibration tokens, fewer than it has "
                           "inputs: it will fit those tokens rather than the model; calibrate on more (--num-seqs, "
                           "--seq-len), or use --refit none", self.intermediate, tokens)

    @classmethod
    def of(cls, job: Job, spans: list[RemovedSpan], **extra) -> "DownstreamRefit":
        """The refit ``job.settings`` (a ``settings.RefitStage``) asks for, around ``spans``."""
        settings = job.settings
        return cls(job, spans, settings.refit_blocks, settings.refit_ridge, settings.refit_weighting,
                   projections=settings.refit, stream_scale=settings.refit_scale,
                   sandwich_inputs=settings.refit_sandwich, **extra)

    def __enter__(self) -> "DownstreamRefit":
        handle = self.job.handle
        if self.inapplicable is not None:
            logger.warning("no down-projection of this model can be refitted (%s): the refit is skipped", self.inapplicable)
            return self
        # per batch: the input, each span's end, the original stream, two sublayer inputs, the compressed
        # stream after the attention, and the refitted block's output less its down-projection's with that
        # projection's inputs (intermediate-sized)
        kept = 6 + len(self.spans) + math.ceil(self.intermediate / self.job.hidden_size)
        self.store = ActivationStore(self.job.runner.store_kind(self.batches, kept), handle.device,
                                     self.job.runner.execution.offload_dir)
        try:
            if not self._read_recorded():
                if self.recorded_only:
                    raise BlockfoldError("the refit stage found the original streams the method's first pass "
                                         "recorded incomplete, and the model has lost its blocks since: rerun "
                                         "without --stats-cache and --resume, or report this as a bug")
                self._record_original()
        except BaseException:
            self.store.close()
            raise
        finally:
            self.original = None  # a twin is needed only for the recording: its memory goes now
        return self

    def __exit__(self, *exc) -> None:
        if self.store is not None:
            self.store.close()

    def _read_recorded(self) -> bool:
        """The original streams from the job's first pass, where it recorded them for these batches (then
        no pass is run for them); the recording is released either way once a refit has looked at it."""
        recorded = self.job.streams
        if recorded is None or self.original is not self.job.handle:
            return False
        first = max(self.spans[0].start - 1, 0)
        ends = {span.start + span.length: number for number, span in enumerate(self.spans)}
        self.recorded = recorded.covers(self.batches, {first, *ends})
        if self.recorded:
            for number, hidden in enumerate(recorded.stream(first, self.batches)):
                self.store.put(f"input:{number}", hidden)
            for depth, span_number in ends.items():
                for number, hidden in enumerate(recorded.stream(depth, self.batches)):
                    self.store.put(f"after{span_number}:{number}", hidden)
        recorded.close()
        self.job.streams = None
        return self.recorded

    def _record_original(self) -> None:
        """The original model up to the deepest span's end: the input of the block before the first
        span (``input:n``) and the stream after each span (``after{k}:n``), per batch ``n``."""
        ends = {span.start + span.length - 1: number for number, span in enumerate(self.spans)}
        first = max(self.spans[0].start - 1, 0)  # from the start, the input of block 0 is the embeddings' output
        program = LayerProgram(self.original, self.batches, self.store, max(ends))
        show = distributed.current().is_main
        for index in bar(range(max(ends) + 1), desc="refit: the original streams", unit="layer", show=show):
            if index == first:
                for number in range(len(self.batches)):
                    self.store.put(f"input:{number}", program.hidden(number))
            with program.layer(index) as (_, run):
                for number in range(len(self.batches)):
                    program.set_hidden(number, run(program.hidden(number), number))
            if index in ends:
                for number in range(len(self.batches)):
                    self.store.put(f"after{ends[index]}:{number}", program.hidden(number))
        self.job.runner.sweep()

    def apply(self) -> dict:
        """Refit on the compressed model (the spans removed); returns what was done, per block."""
        job, store = self.job, self.store
        projection = {"down": "down_proj", "attn+down": "attention output + down_proj",
                      "all": "every projection"}[self.projections]
        if self.inapplicable is not None:
            return {"projection": projection, "skipped": self.inapplicable, "blocks": []}
        removed_before, gap_blocks = 0, {}
        for number, span in enumerate(self.spans):  # compressed index of the block before each span
            if span.start > 0:
                gap_blocks[span.start - 1 - removed_before] = number
            removed_before += span.length
        # counted from the block before each span; from the start, the missing block -1 counts too
        starts = {gap: gap + self.blocks for gap in gap_blocks} | ({0: max(1, self.blocks - 1)} if self.from_start else {})
        first = min(starts)
        refitted_layers = {index for gap, end in starts.items() for index in range(gap, min(job.num_layers, end))}
        last = max(refitted_layers)
        program = LayerProgram(job.handle, self.batches, store, last)
        for number in range(len(self.batches)):
            program.set_hidden(number, store.get(f"input:{number}"))
            # from the start the compressed block 0 reads the embeddings, and the original the stream after the span
            store.put(f"original:{number}", store.get(f"after0:{number}") / self.compensation[0] if self.from_start
                      else store.get(f"input:{number}"))
        report = []
        scale = 1.0  # the product of the stream scales folded so far: the compressed stream is the original's / scale
        show = distributed.current().is_main
        for index in bar(range(first, last + 1), desc="refit: output projections", unit="layer", show=show):
            with program.layer(index) as (block, run):
                reason = self._not_refittable(block) if index in refitted_layers else None
                advanced = False
                # the block before the first span reads the original stream: its attention has nothing to correct
                reads_original = index == first and not self.from_start
                inputs_only = reason is not None and self._inputs_only(block) and not reads_original
                corrected = index in refitted_layers and (reason is None or inputs_only) and not reads_original
                attention = self._attention_projection(block) if corrected and self.attention and reason is None else None
                norms = self._input_norms(block) if corrected and self.inputs else {}
                for number in range(len(self.batches)):  # the original stream through this block as it was
                    source = store.get(f"original:{number}")
                    if isinstance(attention, nn.Linear) or norms or index not in gap_blocks:
                        with contextlib.ExitStack() as hooks:  # the stream after its attention half, its normed inputs
                            captured = hooks.enter_context(_captured(attention)) if isinstance(attention, nn.Linear) else None
                            normed = {name: hooks.enter_context(_captured(norm)) for name, (norm, _) in norms.items()}
                            output = run(source, number)
                        if captured is not None:
                            store.put(f"middle:{number}", source + captured["output"])
                        for name, inputs in normed.items():
                            store.put(f"{name}-input:{number}", inputs["output"])
                    store.put(f"original:{number}",
                              store.get(f"after{gap_blocks[index]}:{number}") / (scale * self.compensation[gap_blocks[index]])
                              if index in gap_blocks else output)
                if reason is not None and not inputs_only:
                    report.append({"block": index, "skipped": reason})
                elif index in refitted_layers:
                    entry = {"block": index}
                    for name in ("attention", "shared"):  # before the attention output's refit, which reads them
                        if name in norms:
                            entry[f"{name}_inputs"] = self._refit_inputs(program, name, *norms[name], run,
                                                                         program.hidden)
                    if isinstance(attention, nn.Linear):
                        entry["attention"] = self._refit_projection(program, attention, run, "middle", True)
                    elif attention is not None:
                        entry["attention"] = {"skipped": attention}
                    if "mlp" in norms:
                        attended = (lambda number: store.get(f"attended:{number}")) if isinstance(attention, nn.Linear) \
                            else None  # the stream after the refitted attention, where it was refitted
                        entry["mlp_inputs"] = self._refit_inputs(program, "mlp", *norms["mlp"], run, attended)
                    if inputs_only:  # what it writes passes a norm and is kept
                        entry["outputs"] = {"skipped": reason}
                    else:
                        scaled = self.stream_scale and index in gap_blocks
                        entry |= self._refit_projection(program, job.adapter.down_proj(block), run, "original", False,
                                                        scaled)
                        advanced = True  # the refit left each batch's output with the new weight in the program
                        if scaled:
                            self._fold_stream_scale(index, entry["stream_scale"])
                            scale *= entry["stream_scale"]
                    report.append(entry)
                if not advanced:
                    for number in range(len(self.batches)):
                        program.set_hidden(number, run(program.hidden(number), number))
        job.runner.sweep()
        refitted = [entry for entry in report if "relative_error_before" in entry]
        if refitted:
            logger.info("refitted the down-projections of %d blocks: relative error of their contribution %.4g -> %.4g "
                        "(mean over blocks)", len(refitted), sum(e["relative_error_before"] for e in refitted) / len(refitted),
                        sum(e["relative_error_after"] for e in refitted) / len(refitted))
        return {"projection": projection, "ridge": self.ridge, "weighting": self.weighting, "blocks": report,
                "stream_scale": self.stream_scale,
                "passes": 1 if self.recorded else 2,  # the original streams unless recorded, then the refit
                "original_streams": "recorded in the first pass" if self.recorded else "a pass of their own",
                "note": "block indices are the compressed model's"}

    def _fold_stream_scale(self, gap: int, factor: float) -> None:
        """The refit of block ``gap`` asked for the stream after it ``factor`` times as large: every later
        block's writes are scaled by ``1/factor`` instead (each block and the final norm read the stream
        through a scale-invariant norm, so this is the same function), and the original streams the later
        blocks are fitted to are divided by it."""
        for later in self.job.handle.layers()[gap + 1:]:
            scale_block_output(self.job.handle, later, 1.0 / factor)
        for number in range(len(self.batches)):
            self.store.put(f"original:{number}", self.store.get(f"original:{number}") / factor)

    def _not_refittable(self, block: nn.Module) -> str | None:
        adapter = self.job.adapter
        if adapter.is_sparse(block):
            return "mixture of experts"
        if adapter.mlp_norm(block) is not None:
            return "a norm after the MLP output"
        return None

    def _inputs_only(self, block: nn.Module) -> bool:
        """With ``all`` and ``sandwich_inputs``, a block whose MLP output passes a norm (sandwich blocks)
        still has its input projections corrected: their fit needs only the normed inputs, not a linear
        residual add."""
        adapter = self.job.adapter
        return self.inputs and self.sandwich_inputs and not adapter.is_sparse(block) and adapter.mlp_norm(block) is not None

    def _attention_projection(self, block: nn.Module) -> nn.Linear | str:
        """The attention output projection to refit, or why there is none."""
        adapter = self.job.adapter
        if adapter.post_attention_norm:
            return "a norm after the attention output"
        try:
            return adapter.attention_output_projection(block).module
        except BlockfoldError:
            return "no attention output projection (a linearized attention)"

    def _input_norms(self, block: nn.Module) -> dict[str, tuple[nn.Module, list[nn.Linear]]]:
        """Each sublayer whose input projections can be refitted: its input norm and the projections
        that read that norm's output. Where both sublayers read one norm (phi's and cohere's parallel
        blocks) that is one group, ``shared``: the same inputs and targets, so one solve serves both."""
        adapter = self.job.adapter
        attention_norm, mlp_norm = adapter.input_norm(block), adapter.pre_mlp_norm(block)
        groups = {"attention": (attention_norm, adapter.input_projections(block, "attention")),
                  "mlp": (mlp_norm, adapter.input_projections(block, "mlp"))}
        if attention_norm is mlp_norm:
            groups = {"shared": (attention_norm, groups["attention"][1] + groups["mlp"][1])}
        return {name: (norm, linears) for name, (norm, linears) in groups.items() if linears}

    def _refit_inputs(self, program: LayerProgram, name: str, norm: nn.Module, linears: list[nn.Linear], run,
                      reads=None) -> dict:
        """Fit one map ``M`` from the compressed stream's normed input of a sublayer to the original's
        (``min ‖n_c M − n_o‖² + λ‖M − I‖²``) and fold it into every projection that reads it (``W ← W Mᵀ``):
        each projection's output then matches, on the compressed model's inputs, what the original
        block computed on its own (one solve gives every projection's ridge fit toward its weight,
        since they share the inputs). Projections that do not read the norm's output as it is (a cast
        or another input in between) leave the sublayer as it was. ``reads(number)``: the stream the
        norm should read in batch ``number``; where the first batch's run shows it does, the norm is
        applied to it directly in the other batches instead of running the block."""
        equations, elsewhere, direct = ProjectionEquations(), False, reads is not None
        for number, mask in enumerate(program.masks):
            if number > 0 and direct:
                normed = {"output": norm(reads(number))}
            else:
                with contextlib.ExitStack() as hooks:
                    normed = hooks.enter_context(_captured(norm))
                    read = [hooks.enter_context(_captured(linear)) for linear in linears] if number == 0 else []
                    _run_until(run, program.hidden(number), number, [norm, *(linears if number == 0 else [])])
                if number == 0 and direct:
                    direct = torch.equal(normed["inputs"], reads(0))
                elsewhere |= any(not torch.equal(captured["inputs"], normed["output"]) for captured in read)
            equations.add(normed["output"][mask], self.store.get(f"{name}-input:{number}")[mask])
        distributed.reduce_observers([equations], distributed.current())  # every process, before any returns
        if elsewhere:
            return {"skipped": "its projections do not read the norm's output as it is"}
        sums = equations.finalize()
        identity = torch.eye(sums.xtx.shape[0], dtype=torch.float64, device=sums.xtx.device)
        ridge = self.ridge * float(sums.xtx.diagonal().mean())
        correction, _ = solve_normal_equations(sums.xtx, sums.xty + ridge * identity, ridge)
        for linear in linears:
            self.job.handle.transform(linear, "weight", lambda weight: weight @ correction.T.to(weight.device))
        return {"projections": len(linears), "relative_error_before": sums.relative_residual(identity),
                "relative_error_after": sums.relative_residual(correction), "tokens": sums.tokens}

    def _refit_projection(self, program: LayerProgram, linear: nn.Linear, run, target: str, middle: bool,
                          scaled: bool = False) -> dict:
        """Refit ``linear`` so that the stream it writes to reaches the stored original ``target``: the
        block's output, or with ``middle`` the stream right after the projection's add (the block's input
        plus its output). Sums over this process's batches, reduced across processes; the ridge solve is
        toward the current weight and the new weight is written as an edit. With ``scaled`` a scalar on
        the rest of the block's output is fitted with the weight; the weight written is divided by it
        (the caller folds the scalar into the later blocks) and the entry gives it as ``stream_scale``."""
        job, store = self.job, self.store
        equations = ProjectionEquations()
        for number, mask in enumerate(program.masks):
            hidden = program.hidden(number)
            with _captured(linear) as captured:
                output = _run_until(run, hidden, number, [linear]) if middle else run(hidden, number)
            reached = hidden + captured["output"] if middle else output
            if not middle:  # the block's output less this projection's: with the new weight's, the next input
                store.put(f"rest:{number}", output - captured["output"])
            store.put(f"read:{number}", captured["inputs"])
            contribution = captured["output"][mask].double()
            if linear.bias is not None:
                contribution = contribution - linear.bias.double()
            stream = store.get(f"{target}:{number}")[mask].double()
            wanted = stream - reached[mask].double() + contribution
            weights = None
            if self.weighting == "stream":  # each token's error relative to the stream it is added to
                weights = 1.0 / stream.pow(2).mean(-1).clamp_min(torch.finfo(torch.float64).tiny)
            kept = reached[mask].double() - contribution if scaled else None
            equations.add(captured["inputs"][mask], wanted, weights, kept)
        distributed.reduce_observers([equations], distributed.current())
        sums = equations.finalize()
        current = linear.weight.detach().double().T  # (in, out)
        ridge = self.ridge * float(sums.xtx.diagonal().mean())
        result = {"relative_error_before": sums.relative_residual(current), "tokens": sums.tokens}
        if scaled:
            refitted, factor, result["relative_error_after"] = equations.stream_scale(ridge, current)
            result["stream_scale"] = factor
            refitted = refitted / factor
        else:
            refitted, _ = solve_normal_equations(sums.xtx, sums.xty + ridge * current, ridge)
            result["relative_error_after"] = sums.relative_residual(refitted)
        new_weight = refitted.T.to("cpu", job.handle.dtype).contiguous()
        job.handle.transform(linear, "weight", lambda weight: new_weight.to(weight.device, weight.dtype))
        # the stream after this projection's add with the new weight, without running the block again (it is
        # linear in the weight): the block's output (the next block's input), or the stream after the attention
        for number in range(len(program.masks)):
            written = linear(store.get(f"read:{number}"))
            if middle:
                store.put(f"attended:{number}", program.hidden(number) + written)
            else:
                program.set_hidden(number, store.get(f"rest:{number}") + written)
        return result


def removed_spans(blocks: list[int]) -> list[RemovedSpan]:
    """The runs of consecutive block indices in ``blocks``, as spans."""
    spans: list[RemovedSpan] = []
    for block in sorted(blocks):
        if spans and spans[-1].start + spans[-1].length == block:
            spans[-1] = RemovedSpan(spans[-1].start, spans[-1].length + 1)
        else:
            spans.append(RemovedSpan(block, 1))
    return spans


#: where a first pass keeps the stream the refit reads, by ``--offload`` (auto: beside the sums)
RECORDING_PLACE = {"auto": "device", "none": "device", "cpu": "cpu", "disk": "disk"}


def recording_bytes(depths: int, tokens: int, hidden_size: int, element: int) -> int:
    """Bytes of the stream at ``depths`` depths for ``tokens`` real tokens."""
    return depths * tokens * hidden_size * element


def original_stream_recorder(job: Job, depths: set[int], room: int) -> StreamRecorder | None:
    """A recorder of the original stream at ``depths`` for a method's first pass to carry, so the refit
    after it reads the stream without a pass of its own: kept where ``--offload`` says (auto: on the
    device), made where it takes at most ``room`` bytes, else None (the manifest says why)."""
    shard, _ = distributed.shard(list(job.calibration), distributed.current())
    needed = recording_bytes(len(depths), sum(int(batch.attention_mask.sum()) for batch in shard), job.hidden_size,
                             job.handle.dtype.itemsize)
    runner = job.runner
    where = RECORDING_PLACE[runner.execution.offload]
    job.notes["original_streams"] = {"depths": len(depths), "bytes": needed, "room": max(room, 0)}
    if needed > room:
        job.notes["original_streams"]["not_recorded"] = "more than the statistics budget leaves (--stats-memory)"
        return None
    try:
        store = ActivationStore(where, job.handle.device, runner.execution.offload_dir, needed)
    except BlockfoldError as error:  # a spill folder without room: the refit's own pass needs none of it
        job.notes["original_streams"]["not_recorded"] = str(error)
        return None
    runner.offloaded.add(where)
    job.notes["original_streams"]["kept"] = where
    return StreamRecorder(depths, store)


def first_pass_runs_in_full(execution) -> bool:
    """Whether a method's first pass surely runs the model over every batch: a pass served by the
    statistics cache or resumed from a checkpoint leaves a recording made in it short."""
    return execution.stats_cache is None and execution.resume_dir is None


def _first_pass_may_record(job: Job) -> bool:
    """Whether the method's first pass records the refit stage's streams: where it runs in full, over the
    unedited model (a short recording is fatal here: by then the model has lost its blocks)."""
    return (getattr(job.settings, "first_pass_records", False) and job.cache is None
            and first_pass_runs_in_full(job.runner.execution))


def refit_after(job: Job, method) -> dict:
    """Run ``method`` (a function of the job that removes blocks and names them, in the original indices,
    as ``removed_blocks``), then the downstream refit. The original streams come from the method's first
    pass where it records them (``first_pass_records``: every depth, where they fit the statistics budget)
    or else from an unedited twin of the model taken before the method runs, so the method needs to know
    nothing of the refit: a streamed model's twin reads the same checkpoint, a resident model's is a copy
    (memory for a second model, released once the streams are recorded)."""
    job.streams = (original_stream_recorder(job, set(range(job.num_layers + 1)), job.runner.stats_budget())
                   if _first_pass_may_record(job) else None)
    twin = None
    if job.streams is None:
        twin = job.handle.fresh_copy()
        if not twin.resident:  # a new skeleton: the adapter's rewrite applies to it too
            twin.adapter.prepare(twin)
    details = method(job)
    if "original_streams" in job.notes:  # the recording, where one was weighed: its size, or why it was not made
        details.setdefault("selection", {}).setdefault("statistics", {})["original_streams"] = \
            job.notes["original_streams"]
    spans = removed_spans(details["removed_blocks"])
    if not spans:  # an unread recording is released by run_stages, as after every method
        return details
    scales = (details.get("compensation") or {}).get("by_block", {})
    compensation = [math.prod(factor for block, factor in scales.items() if block < span.start + span.length)
                    for span in spans]
    with DownstreamRefit.of(job, spans, original=twin, compensation=compensation, recorded_only=twin is None) as refit:
        del twin
        details["refit"] = refit.apply()
    return details


def plan_refit_sums(context, plan) -> None:
    """Add the refit's memory to a method's plan (``plan.MethodPlan``): its sums per projection and the
    streams it keeps for every calibration token."""
    from blockfold.plan import gib

    settings, d = context.settings, context.hidden_size
    intermediate = _intermediate_size(context.model.config, d)
    # AᵀA and AᵀR; with the stream scale also AᵀH (the rest of the block's output)
    refit_sums = intermediate * (intermediate + (2 if settings.refit_scale else 1) * d) * 8
    plan.sums = max(plan.sums, refit_sums)
    # the streams, the compressed stream after the attention, the block's output less its down-projection's,
    # and that projection's inputs; "all" also keeps the original's two normed inputs
    copies = (5 if settings.refit == "all" else 3) + 2 + math.ceil(intermediate / d)
    plan.notes.append(f"refit: {gib(refit_sums)} of sums per down-projection, and the original and compressed "
                      f"streams kept for all calibration tokens ({gib(copies * context.tokens * d * context.element)})")


def plan_refit_after(context, plan) -> None:
    """The refit stage after a method that does not run it itself (``refit_after``): its pass, its sums and
    streams, and the original streams: recorded in the method's first pass where it can (the pass runs in
    full: no statistics cache, no resume) and they fit, else on a twin in a pass of their own."""
    from blockfold.plan import gib

    plan.passes += 1
    plan_refit_sums(context, plan)
    if getattr(context.settings, "first_pass_records", False) and first_pass_runs_in_full(context.execution):
        needed = recording_bytes(context.num_layers + 1, context.tokens, context.hidden_size, context.element)
        room = context.budget  # as the run decides: the whole statistics budget, before the method's pass
        if needed <= room:
            plan.recorded = needed
            plan.notes.append(f"refit stage: the original stream at every depth ({gib(needed)}) recorded in the "
                              "method's pass, so no copy of the weights and no pass of its own")
            return
        plan.notes.append(f"refit stage: the original stream at every depth ({gib(needed)}) exceeds the "
                          f"{gib(max(room, 0))} the budget leaves: recorded on a twin in a pass of its own")
    plan.passes += 1
    if context.pipeline == "whole":
        plan.weight_copies += 1
        plan.notes.append("refit stage: an unedited copy of the weights until the original streams are recorded")
    else:
        plan.notes.append("refit stage: the original streams recorded from the checkpoint (no copy of the weights)")


def _intermediate_size(config, hidden_size: int) -> int:
    """The width of a down-projection's inputs (a config without one: the usual four times the hidden size)."""
    return getattr(config, "intermediate_size", None) or 4 * hidden_size


class _Enough(Exception):
    """Raised from a hook once a block has run as far as a fit needs."""


def _run_until(run, hidden: torch.Tensor, number: int, modules: list[nn.Module]) -> torch.Tensor | None:
    """``run(hidden, number)``, stopped as soon as every one of ``modules`` has run (their other hooks,
    registered earlier, have then fired): a fit that reads a norm's output or the attention half need
    not pay for the rest of the block. The block's output where it ran to the end, else None."""
    waiting = set(range(len(modules)))

    def reached(position):
        def hook(module, args, output):
            waiting.discard(position)
            if not waiting:
                raise _Enough
        return hook

    hooks = [module.register_forward_hook(reached(position)) for position, module in enumerate(modules)]
    try:
        return run(hidden, number)
    except _Enough:
        return None
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _captured(linear: nn.Linear):
    """The inputs and output of ``linear`` in the forward run inside the block."""
    captured: dict[str, torch.Tensor] = {}

    def capture(module, args, output):
        captured["inputs"], captured["output"] = args[0], output

    hook = linear.register_forward_hook(capture)
    try:
        yield captured
    finally:
        hook.remove()


__all__ = ["DownstreamRefit", "RemovedSpan", "first_pass_runs_in_full", "plan_refit_after",
           "plan_refit_sums", "refit_after", "removed_spans"]

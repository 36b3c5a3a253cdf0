"""The model card (README.md) every saved checkpoint carries: what it is, what was done to it, what
was measured, how to load it, and the license it inherits from its source.

Written from the manifest alone, so a card never claims what the run did not record.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import yaml

from blockfold.models.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS

log = logging.getLogger(__name__)

CARD_NAME = "README.md"


def source_license(path: str | Path | None) -> str | None:
    """The source model's license: its model card's ``license:`` field, or (a model converted from
    GGUF) the GGUF's ``general.license``; None where neither says."""
    if not path:
        return None
    folder = Path(path).expanduser()
    card = folder / CARD_NAME
    if card.is_file():
        match = re.match(r"---\n(.*?)\n---", card.read_text(errors="replace"), re.S)
        if match:
            try:
                front = yaml.safe_load(match.group(1)) or {}
            except yaml.YAMLError:
                front = {}
            if isinstance(front, dict) and front.get("license"):
                return str(front["license"])
    source = folder / "blockfold_source.json"
    gguf_path = json.loads(source.read_text()).get("gguf") if source.is_file() else None
    if gguf_path is None and folder.suffix == ".gguf":
        gguf_path = folder
    if gguf_path and Path(gguf_path).is_file():
        try:
            from gguf import GGUFReader

            field = GGUFReader(str(gguf_path)).fields.get("general.license")
            return str(field.contents()) if field is not None else None
        except (OSError, ValueError, KeyError) as error:
            log.warning("could not read the license of %s: %s", gguf_path, error)
    return None


def _what_was_done(manifest: dict) -> str:
    before, after = manifest.get("original_num_layers"), manifest.get("num_layers")
    replaced = manifest.get("replaced") or {}
    removed = manifest.get("removed_blocks") or []
    calibration = manifest.get("calibration") or {}
    data = (f"{calibration.get('sequences')} x {calibration.get('sequence_length')} tokens of "
            f"`{calibration.get('source')}`") if calibration else "calibration text"
    low_rank, sliced, pruned = manifest.get("low_rank"), manifest.get("sliced"), manifest.get("pruned")
    if pruned:
        return (f"Blocks {pruned['layers'][0]}-{pruned['layers'][-1]} of {before} lost attention head groups (a "
                "key-value head with its query heads) and MLP channels (LLM-Pruner), those whose weights mattered "
                f"least to the next-token loss on {data} (first-order Taylor importance, |w · dL/dw|); each block "
                "keeps its own number of heads and channels, recorded in the config.")
    if sliced:
        width, kept = sliced["hidden_size"]
        return (f"The residual stream was rotated into its principal directions on {data} and sliced from {width} "
                f"to {kept} dimensions (SliceGPT): every weight that reads or writes the stream lost rows or "
                "columns, and the norms' gains were folded into the weights that read them"
                + ("; the tied embeddings are the LM head, so the final norm's gain became a square map after it"
                   if sliced["tied_head_map"] else "")
                + ("; the LayerNorms became RMSNorms of the rotated stream, which has no mean left to subtract, and "
                   "their biases moved into the weights that read them" if sliced.get("layer_norms_converted") else "")
                + ".")
    if low_rank:
        before_count, after_count = low_rank["projection_parameters"]
        how = (f"truncated where its output on {data} loses least (the SVD of the weight whitened by its inputs' "
               "second moment)") if low_rank["whitening"] else "truncated by the plain SVD of the weight"
        return (f"Every linear projection of the {before} blocks was stored as two low-rank factors (SVD-LLM), "
                f"{how}: {before_count:,} -> {after_count:,} projection parameters, ranks "
                + ", ".join(f"{name} {rank}" for name, rank in low_rank["ranks"].items()) + ".")
    if replaced.get("layers"):
        what = "attention sublayers" if replaced.get("target") == "attention" else "blocks"
        how = ("replaced by linear maps `W x + b` fitted on " + data + " (LMMSE); replaced attention layers keep no "
               "KV cache") if replaced.get("replacement") == "linear" else "removed (their contribution is zero)"
        return f"The {what} of layers {', '.join(map(str, replaced['layers']))} (of {before}) were {how}."
    text = f"Blocks {', '.join(map(str, removed))} of {before} were removed ({before} -> {after} blocks)"
    spans = [span for span in manifest.get("spans") or [] if span.get("transform")]
    if spans:
        folds = "; ".join(f"blocks {span['blocks'][0]}-{span['blocks'][-1]} replaced by a "
                          f"{span['transform'].get('estimator')} map folded into block {span['folded_into_block']}'s "
                          "down-projection" for span in spans)
        text += f", each removed span replaced by a linear map fitted on {data} ({folds})."
        entries = (manifest.get("refit") or {}).get("blocks", [])
        written = [entry["block"] for entry in entries if "relative_error_before" in entry]  # down-projection refitted
        read = {entry["block"] for entry in entries  # input projections refitted
                if any(part in entry and "skipped" not in entry[part] for part in ("attention_inputs", "mlp_inputs", "shared_inputs"))}
        read_and_written, read_only = sorted(read & set(written)), sorted(read - set(written))
        if written:
            text += (f" Then the down-projections of blocks {', '.join(map(str, written))} of the result were refitted, "
                     "layer by layer in closed form, so that each block's output on the compressed model's inputs "
                     "matches the original model's residual stream at that depth.")
            if read_and_written:
                text += (f" In blocks {', '.join(map(str, read_and_written))} the projections that read each "
                         "sublayer's normed input were refitted first, so that on the compressed stream they compute what "
                         "the original block computed, and the attention output projection too.")
        if read_only:
            text += (f" In blocks {', '.join(map(str, read_only))} of the result, whose sublayer outputs "
                     "pass a norm, only the projections that read each sublayer's normed input were refitted, layer by "
                     "layer in closed form, so that on the compressed stream they compute what the original block computed.")
        scales = [entry for entry in entries if "stream_scale" in entry]
        if scales:
            text += (" The refit of " + ", ".join(f"block {entry['block']}" for entry in scales) + " also fitted the "
                     "stream's scale after it (" + ", ".join(f"{entry['stream_scale']:.4g}" for entry in scales)
                     + "), folded as its inverse into every later block's output projections.")
        text += " No parameters were added."
    elif manifest.get("collapsed"):
        merges = "; ".join(f"blocks {', '.join(map(str, merge['blocks']))} into block {merge['into']}"
                           for merge in manifest["collapsed"])
        text += (f", collapsed (LaCo) into the block before them: its attention and MLP weights plus each collapsed "
                 f"block's difference from them ({merges}). No parameters were added.")
    elif manifest.get("patch"):
        patch = manifest["patch"]
        form = ("the Hadamard-rotated channel scaling H D H^T (LinearPatch)" if patch.get("form") == "hadamard"
                else "a least-squares map on the residual stream")
        text += (f"; block {patch['block']} of the result is a linear patch on the residual stream, h -> h P, P "
                 f"{form} fitted on {data}. It adds d x d parameters and keeps no KV cache.")
    elif manifest.get("replacement"):
        replacement = manifest["replacement"]
        blocks = replacement["replaces"]
        text += (f": blocks {blocks[0]}-{blocks[-1]} became one block (LLM-Streamline), block {blocks[0]} trained for "
                 f"{replacement['train_steps']} steps to output what the span did on {data} (MSE). No parameters were "
                 "added.")
    elif manifest.get("compensation"):
        scales = ", ".join(f"{s:.3f}" for s in manifest["compensation"]["scales"])
        text += (f"; after each removal the residual stream's missing magnitude was compensated (Prune&Comp) by "
                 f"scaling what the later blocks add by 1/s, s = {scales}, measured on {data}. No parameters were added.")
    else:
        text += " with no map in their place."
    return text


def _measured(manifest: dict) -> list[str]:
    lines = []
    ppl = manifest.get("perplexity")
    if ppl:
        lines.append(f"- Perplexity on `{ppl.get('text')}`: {ppl['original']['perplexity']:.2f} (original) -> "
                     f"{ppl['compressed']['perplexity']:.2f} (this checkpoint)")
    healing = manifest.get("healing") or {}
    if healing.get("perplexity"):
        lines.append(f"- After healing ({healing.get('mode')}, {healing.get('steps')} steps): perplexity "
                     f"{healing['perplexity']['before']['perplexity']:.2f} -> "
                     f"{healing['perplexity']['after']['perplexity']:.2f}")
    parameters = (manifest.get("original_parameters"), manifest.get("parameters"))
    if all(parameters):
        lines.append(f"- Parameters: {parameters[0]:,} -> {parameters[1]:,} ({parameters[1] / parameters[0]:.3f}x)")
    return lines


def model_card(manifest: dict, folder: Path, name: str, license_name: str | None) -> str:
    """The README.md of the checkpoint written in ``folder`` (its config and files are read), to be
    published as ``name``."""
    config = json.loads((folder / "config.json").read_text())
    remote_code = (folder / "modeling_blockfold.py").is_file()
    architecture = (config.get("architectures") or ["?"])[0]
    source = (manifest.get("source_model") or {}).get("spec") or "a model built in memory"
    method = manifest.get("method", "?")
    multimodal = (manifest.get("architecture") or {}).get("multimodal")
    vision = (manifest.get("architecture") or {}).get("vision", False)
    front = {"license": license_name or "other", "library_name": "transformers",
             "tags": ["blockfold", method, "low-rank" if manifest.get("low_rank") else "sliced" if manifest.get("sliced")
                      else "structured-pruning" if manifest.get("pruned") else
                      "depth-pruning" if not manifest.get("replaced") else "linearized-layers"]}
    load_args = f'"{name}"' + (", trust_remote_code=True" if remote_code else "")
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {name}", "",
             f"`{source}` compressed without training by blockfold with the `{method}` method "
             f"(recipe version {manifest.get('recipe', {}).get('recipe_version')}).", "",
             "## What was done", "", _what_was_done(manifest), "",
             "## Measured", "", *(_measured(manifest) or ["- Nothing measured at compression time."]),
             "", "Measure it against its source with `blockfold eval " + name + " --ppl FILE --tasks ...`.", "",
             "## Load", "", "```python", *_load_lines(name, load_args, multimodal, vision), "```", ""]
    if vision:
        lines += [f"A standard `{architecture}` image encoder with fewer layers and no new parameters: plain "
                  "transformers loads it as it is, with its image processor.", ""]
    elif multimodal:
        lines += [f"A standard `{architecture}` checkpoint: its language model has fewer layers and no new parameters, "
                  "its vision encoder and projector are the source's, byte for byte. Plain transformers and vLLM load it "
                  "as they load the source:", "", "```bash", f"vllm serve {name}", "```", ""]
    elif remote_code and (manifest.get("low_rank") or manifest.get("sliced") or manifest.get("pruned")):
        sliced = manifest.get("sliced") or {}
        what = ("factored projections" if manifest.get("low_rank") else "map after the final norm"
                if sliced.get("tied_head_map") else "RMSNorms in place of LayerNorms" if sliced
                else "blocks of different widths")
        lines += [f"The {what} need the modeling code shipped in this folder (`modeling_blockfold.py`, classes "
                  f"registered as `{architecture}`): load with `trust_remote_code=True`; blockfold itself is not "
                  f"needed. Neither vLLM (blockfold's plugin serves linearized layers only) nor llama.cpp (no "
                  f"architecture of it has {what}) can load it: serve it with transformers.", ""]
    elif remote_code:
        lines += [f"The replaced layers need the modeling code shipped in this folder (`modeling_blockfold.py`, "
                  f"classes registered as `{architecture}`): load with `trust_remote_code=True`; blockfold itself is "
                  "not needed.", "",
                  "vLLM serves it with blockfold's plugin installed in vLLM's environment (`pip install --no-deps "
                  "plugins/vllm` from the blockfold repository; the replaced layers keep no KV cache there either):",
                  "", "```bash", f"vllm serve {name} --trust-remote-code", "```", "",
                  "No stock llama.cpp architecture has a layer whose attention is a linear map, so there is no GGUF "
                  "export of it.", ""]
    else:
        lines += [f"A standard `{architecture}` checkpoint with fewer layers and no new parameters: plain transformers "
                  "and vLLM load it as it is; for llama.cpp, export it to GGUF with blockfold (`--quant source` keeps "
                  "a GGUF source's types and copies every tensor compression left unchanged):", "",
                  "```bash", f"vllm serve {name}", f"blockfold export --model {name} --out {name.rstrip('/').split('/')[-1]}.gguf "
                  "--quant q8_0", "```", "",
                  "`scripts/serve-check.sh` in the blockfold repository checks an engine's greedy tokens against "
                  "transformers'.", ""]
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") == "bitsandbytes":
        kind = quantization.get("bnb_4bit_quant_type", "4-bit")
        lines += ["## Quantization", "",
                  f"Quantized as its source was (bitsandbytes {kind}): loading needs `bitsandbytes`. Every 4-bit weight "
                  "compression left alone is its source's, byte for byte; the layers it changed are stored unquantized "
                  f"and listed in `llm_int8_skip_modules` ({', '.join(quantization.get('llm_int8_skip_modules') or [])}). "
                  "GGUF export reads float checkpoints: compress the float model (or its GGUF file) for llama.cpp.", ""]
    elif quantization.get("quant_method") == COMPRESSED_TENSORS:
        floats = ", ".join(f"`{name}`" for name in quantization.get("ignore") or []) or "none"
        lines += ["## Quantization", "",
                  "Quantized as its source was (compressed-tensors, as llm-compressor writes it): transformers loads it "
                  "with the `compressed-tensors` package and vLLM serves it as it is. Every quantized layer "
                  "compression left alone is its source's, byte for byte; the layers it changed are quantized again "
                  "in the source's scheme (round to nearest); layers in no scheme are stored in float and named in "
                  f"the config's `ignore` list ({floats}). GGUF export reads float checkpoints: compress the float "
                  "model (or its GGUF file) for llama.cpp.", ""]
    lines += ["## License", "",
              (f"Derived from `{source}`, released under `{license_name}`; that license's terms apply to this "
               "checkpoint." if license_name else
               f"blockfold found no license in `{source}`'s files: check the source model's terms before "
               "distributing this checkpoint."), "",
              "## Provenance", "",
              f"`blockfold_manifest.json` records every decision (candidates and their scores, fit errors, calibration "
              f"hash, versions); `blockfold_recipe.yaml` replays the run. Made with blockfold "
              f"{(manifest.get('environment') or {}).get('blockfold', '?')}, torch "
              f"{(manifest.get('environment') or {}).get('torch', '?')}.", ""]
    return "\n".join(lines)


def _load_lines(name: str, load_args: str, multimodal: dict | None, vision: bool) -> list[str]:
    if vision:
        return ["from transformers import AutoImageProcessor, AutoModel",
                f"model = AutoModel.from_pretrained({load_args})",
                f'processor = AutoImageProcessor.from_pretrained("{name}")']
    if multimodal:
        return ["from transformers import AutoModelForImageTextToText, AutoProcessor",
                f"model = AutoModelForImageTextToText.from_pretrained({load_args})",
                f'processor = AutoProcessor.from_pretrained("{name}")']
    return ["from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"model = AutoModelForCausalLM.from_pretrained({load_args})",
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")']


__all__ = ["CARD_NAME", "model_card", "source_license"]

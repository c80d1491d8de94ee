"""The finetuning readers (RACE, MNLI, QQP) on small hand-made files in the official formats,
Megatron's sample building, and the bad-input errors (file and line named)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from megatron.tokenizer.bert import BertWordPieceTokenizer
from tasks.data_utils import build_tokens_types_paddings_from_ids, clean_text
from tasks.glue.data import dataset_name_from_path, glue_dataset, read_mnli, read_qqp
from tasks.race import data as race
from tasks.finetune_sample_data import write_vocab

CLS, SEP, PAD = 101, 102, 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return BertWordPieceTokenizer(write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt"))


def test_clean_text_as_megatron():
    assert clean_text("a\nb   c . d . . e") == "a b c. d.. e"


def test_rows_cut_and_padded_as_megatron():
    # [CLS] a [SEP] b [SEP], types 0 for the first part, 1 for b, pad id on padding.
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6], [7], 8, CLS, SEP, PAD)
    assert ids == [CLS, 5, 6, SEP, 7, SEP, PAD, PAD]
    assert types == [0, 0, 0, 0, 1, 1, PAD, PAD]
    assert pads == [1, 1, 1, 1, 1, 1, 0, 0]
    # Too long: cut to max - 1, then the final [SEP].
    ids, types, pads = build_tokens_types_paddings_from_ids([5, 6], [7, 8, 9, 10], 6, CLS, SEP,
                                                            PAD)
    assert ids == [CLS, 5, 6, SEP, 7, SEP] and types == [0, 0, 0, 0, 1, 1]
    # Single text, not cut: no final [SEP]; cut: a final [SEP] of type 0.
    assert build_tokens_types_paddings_from_ids([5], None, 4, CLS, SEP, PAD)[0] == \
        [CLS, 5, SEP, PAD]
    assert build_tokens_types_paddings_from_ids([5, 6, 7], None, 4, CLS, SEP, PAD)[:2] == \
        ([CLS, 5, 6, SEP], [0, 0, 0, 0])


MNLI_HEAD = ("index\tpromptID\tpairID\tgenre\ts1bp\ts2bp\ts1p\ts2p\tsentence1\tsentence2"
             "\tlabel1\tgold_label")


def _mnli_row(uid, a, b, label):
    return f"{uid}\tp\tq\tfiction\tx\ty\tX\tY\t{a}\t{b}\t{label}\t{label}"


def test_mnli_train_dev_and_test_files(tmp_path, tokenizer):
    dev = tmp_path / "MNLI" / "dev_matched.tsv"
    dev.parent.mkdir()
    dev.write_text("\n".join([MNLI_HEAD, _mnli_row(7, "the cat   went . to", "never a dog",
                                                    "neutral"),
                              _mnli_row(8, "a dog", "surely the cat", "entailment")]) + "\n")
    samples = read_mnli(str(dev))
    assert [(s["uid"], s["label"]) for s in samples] == [(7, 2), (8, 1)]
    assert samples[0]["text_a"] == "the cat went. to"
    test = tmp_path / "test_matched.tsv"
    test.write_text("\t".join(MNLI_HEAD.split("\t")[:10]) + "\n"
                    + "\t".join(_mnli_row(3, "a dog", "the cat", "x").split("\t")[:10]) + "\n")
    assert read_mnli(str(test)) == [{"text_a": "a dog", "text_b": "the cat", "label": 0,
                                     "uid": 3}]  # contradiction: Megatron's test label
    ds = glue_dataset("MNLI", "dev", [str(dev)], tokenizer, 12)
    item = ds[1]
    cls, sep, pad = tokenizer.cls, tokenizer.sep, tokenizer.pad
    expected = [cls, *tokenizer.tokenize("a dog"), sep, *tokenizer.tokenize("surely the cat"),
                sep]
    assert item["text"].tolist() == expected + [pad] * (12 - len(expected))
    assert item["label"] == 1 and item["uid"] == 8
    assert dataset_name_from_path("MNLI", str(dev)) == "dev-matched"


@pytest.mark.parametrize("row,message", [
    ("1\tp\tq\tfiction\tonly five", "dev.tsv:3: malformed MNLI row: 5 tab-separated columns"),
    (_mnli_row(1, "a", "b", "maybe"), "dev.tsv:3: unknown MNLI label 'maybe'"),
    (_mnli_row("x", "a", "b", "neutral"), "dev.tsv:3: the id column holds 'x'"),
    (_mnli_row(1, "  ", "b", "neutral"), "dev.tsv:3: empty sentence1"),
])
def test_mnli_bad_rows_name_file_and_line(tmp_path, row, message):
    dev = tmp_path / "dev.tsv"
    dev.write_text("\n".join([MNLI_HEAD, _mnli_row(0, "a", "b", "neutral"), row]) + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        read_mnli(str(dev))


def test_qqp_short_rows_skipped_counted_and_reported(tmp_path, caplog):
    path = tmp_path / "train.tsv"
    path.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                    "1\t2\t3\twhy ?\twhy not ?\t1\n"
                    "2\t4\t5\tcut short row\n"
                    "3\t6\t7\t \thow ?\t0\n"
                    "4\t8\t9\twhere ?\there .\t0\n")
    with caplog.at_level(logging.WARNING):
        samples = read_qqp(str(path))
    assert [(s["uid"], s["label"]) for s in samples] == [(1, 1), (4, 0)]
    assert "skipped 2 QQP rows" in caplog.text
    assert "line 3 (4 columns)" in caplog.text and "line 4 (empty question)" in caplog.text


def test_qqp_test_file_and_errors(tmp_path):
    test = tmp_path / "test.tsv"
    test.write_text("id\tquestion1\tquestion2\n5\twhy ?\twhy not ?\n")
    assert read_qqp(str(test)) == [{"text_a": "why ?", "text_b": "why not ?", "label": 0,
                                    "uid": 5}]
    test.write_text("id\tquestion1\tquestion2\n5\twhy ?\n")
    with pytest.raises(ValueError, match="test.tsv:2: malformed QQP test row: 2"):
        read_qqp(str(test))
    bad = tmp_path / "dev.tsv"
    bad.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t2\t3\ta\tb\tyes\n")
    with pytest.raises(ValueError, match="dev.tsv:2: is_duplicate is 'yes', expected 0 or 1"):
        read_qqp(str(bad))
    bad.write_text("id\tquestion\n")
    with pytest.raises(ValueError, match="dev.tsv:1: a QQP header has 6 columns"):
        read_qqp(str(bad))


def _race_doc(**overrides):
    doc = {"article": "the cat went to the river .\nthe dog stayed .",
           "questions": ["the cat went to _ .", "where did the dog stay ?"],
           "options": [["the river", "a garden", "the house", "the hill"],
                       ["the house", "the river", "a garden", "the hill"]],
           "answers": ["A", "C"], "id": "1.txt"}
    doc.update(overrides)
    return doc


def test_race_samples_as_megatron(tmp_path, tokenizer):
    split = tmp_path / "RACE" / "dev" / "middle"
    split.mkdir(parents=True)
    (split / "2.txt").write_text(json.dumps(_race_doc()) + "\n")
    (split / "1.txt").write_text(json.dumps(_race_doc(answers=["D", "B"])) + "\n")
    ds = race.RaceDataset("dev", [str(split)], tokenizer, 32)
    assert len(ds) == 4
    assert [s["label"] for s in ds.samples] == [3, 1, 0, 2]  # files sorted: 1.txt first
    assert [s["uid"] for s in ds.samples] == [0, 1, 2, 3]
    first = ds[0]
    assert first["text"].shape == (4, 32) and first["types"].shape == (4, 32)
    # "_" replaced by the option; otherwise "question option"; article cleaned.
    qa = tokenizer.tokenize("the cat went to a garden .")
    article = tokenizer.tokenize("the cat went to the river. the dog stayed .")
    row = [tokenizer.cls, *qa, tokenizer.sep, *article, tokenizer.sep]
    assert first["text"][1].tolist() == row + [tokenizer.pad] * (32 - len(row))
    assert first["types"][1].tolist()[:len(row)] == [0] * (len(qa) + 2) + [1] * (len(article) + 1)
    assert race.qa_text("where did the dog stay ?", "the house") == \
        "where did the dog stay ? the house"
    assert race.dataset_name_from_path(str(split)) == "dev-middle"


def test_race_qa_cut_to_128_tokens(tmp_path, tokenizer):
    split = tmp_path / "long"
    split.mkdir()
    long_question = " ".join(["cat"] * 200) + " _"
    (split / "a.txt").write_text(json.dumps(_race_doc(questions=[long_question, "q ?"])) + "\n")
    sample = race.RaceDataset("x", [str(split)], tokenizer, 160).samples[0]
    # [CLS] + 128 qa tokens + [SEP], then the article (type 1).
    assert sample["types"][0].tolist().index(1) == 130
    assert np.all(sample["text"][0][1:129] == tokenizer.tokenize("cat")[0])


@pytest.mark.parametrize("line,message", [
    ("{not json", "1.txt:1: not a JSON document"),
    (json.dumps({"article": "a", "questions": []}), "1.txt:1: a RACE document needs the keys "
                                                    "article, questions, options, answers; "
                                                    "missing options, answers"),
    (json.dumps(_race_doc(answers=["A"])), "1.txt:1: 2 questions, 2 option lists and 1 answers"),
    (json.dumps(_race_doc(answers=["A", "E"])), "1.txt:1: question 1: answer 'E' is not one of"),
    (json.dumps(_race_doc(options=[["a", "b", "c"], ["a", "b", "c", "d"]])),
     "1.txt:1: question 0 has 3 options, expected 4"),
])
def test_race_bad_documents_name_file_and_line(tmp_path, tokenizer, line, message):
    (tmp_path / "1.txt").write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        race.read_race_directory(str(tmp_path), tokenizer, 128, 64)


def test_race_directory_without_files(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="no \\*.txt files"):
        race.read_race_directory(str(tmp_path), tokenizer, 128, 64)

"""tasks.squad.reader: words and offsets as run_squad.py, answers checked against the context,
clear errors (file, JSON path, qid) on malformed files, run_squad.py's counted skip."""

from __future__ import annotations

import copy

import pytest

from tasks.squad.reader import read_squad_examples, split_paragraph
from tests.tasks.squad.squad_files import ARNOLD, TESLA, squad_dict, write


def test_paragraph_words_and_character_offsets():
    para = split_paragraph("  Hi  there,\tyou\u202fall\u00a0folks ")
    # U+202F separates words (run_squad.py); U+00A0 does not.
    assert para.doc_tokens == ("Hi", "there,", "you", "all\u00a0folks")
    assert para.char_to_word_offset == (-1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                        3, 3, 3, 3, 3, 3, 3, 3, 3, 3)


def test_training_examples_carry_word_spans(tmp_path):
    read = read_squad_examples(write(tmp_path / "t.json", squad_dict()), "2.0", True)
    by_id = {e.qas_id: e for e in read.examples}
    assert len(by_id) == 8 and read.skipped == []
    born = by_id["born"]
    assert born.doc_tokens[born.start_position:born.end_position + 1] == ("(1856-1943)",)
    company = by_id["company"]
    assert company.doc_tokens[company.start_position:company.end_position + 1] == \
        ("Edison's", "company")
    assert (company.orig_answer_text, company.answers) == ("Edison's company",
                                                           ("Edison's company",))
    king = by_id["king"]
    assert (king.is_impossible, king.start_position, king.end_position, king.answers) == \
        (True, -1, -1, ())
    assert by_id["actor"].paragraph.context == ARNOLD and born.paragraph.context == TESLA
    # The questions of one paragraph share its words.
    assert born.paragraph is company.paragraph


def test_evaluation_examples_keep_every_gold_answer(tmp_path):
    content = squad_dict()
    qas = content["data"][0]["paragraphs"][0]["qas"]
    qas[0]["answers"].append({"text": "1856-1943", "answer_start": TESLA.index("1856")})
    read = read_squad_examples(write(tmp_path / "d.json", content), "2.0", False)
    born = read.examples[0]
    assert born.answers == ("1856", "1856-1943") and born.start_position is None
    assert read.dataset == content["data"]


def _missing(content, *keys):
    node = content
    for key in keys[:-1]:
        node = node[key]
    del node[keys[-1]]
    return content


@pytest.mark.parametrize("keys,message", [
    (("data",), "missing key 'data'"),
    (("data", 0, "paragraphs"), "missing key 'data[0].paragraphs'"),
    (("data", 1, "paragraphs", 0, "context"), "missing key 'data[1].paragraphs[0].context'"),
    (("data", 0, "paragraphs", 0, "qas", 1, "question"),
     "missing key 'data[0].paragraphs[0].qas[1].question' (question id 'company')"),
    (("data", 0, "paragraphs", 0, "qas", 2, "answers", 0, "answer_start"),
     "missing key 'data[0].paragraphs[0].qas[2].answers[0].answer_start' "
     "(question id 'nation')"),
    (("data", 0, "paragraphs", 0, "qas", 0, "id"),
     "missing key 'data[0].paragraphs[0].qas[0].id'"),
])
def test_missing_keys_name_the_file_the_json_path_and_the_qid(tmp_path, keys, message):
    path = write(tmp_path / "bad.json", _missing(squad_dict(), *keys))
    with pytest.raises(ValueError, match=f"^{path}: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        read_squad_examples(path, "2.0", True)


def test_answer_start_mismatch_names_file_and_qid(tmp_path):
    content = squad_dict()
    content["data"][1]["paragraphs"][0]["qas"][1]["answers"][0]["answer_start"] += 1
    path = write(tmp_path / "off.json", content)
    for training in (True, False):
        with pytest.raises(ValueError) as err:
            read_squad_examples(path, "2.0", training)
        assert str(err.value).startswith(
            f"{path}: data[1].paragraphs[0].qas[1].answers[0] (question id 'decade'): answer "
            "'1980s' does not match the context at answer_start 51 (the context holds '980s.' "
            "there); fix the offset")


def test_other_bad_input(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"{bad} is not a SQuAD JSON file"):
        read_squad_examples(bad, "1.1", True)
    with pytest.raises(ValueError, match="cannot read SQuAD file"):
        read_squad_examples(tmp_path / "absent.json", "1.1", True)
    path = write(tmp_path / "v2.json", squad_dict())
    with pytest.raises(ValueError, match="question id 'king' is_impossible: that is a SQuAD 2.0 "
                                         "file; pass --squad-version 2.0"):
        read_squad_examples(path, "1.1", False)
    content = squad_dict()
    content["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = "12"
    with pytest.raises(ValueError, match=r"answers\[0\].answer_start \(question id 'born'\) "
                                         "should be a int, found str"):
        read_squad_examples(write(tmp_path / "s.json", content), "2.0", True)
    content = squad_dict()
    content["data"][1]["paragraphs"][0]["context"] = " \n"
    with pytest.raises(ValueError, match=r"data\[1\].paragraphs\[0\].context is empty"):
        read_squad_examples(write(tmp_path / "e.json", content), "2.0", False)
    content = squad_dict(impossible=False)
    content["data"][0]["paragraphs"][0]["qas"][0]["answers"] = []
    with pytest.raises(ValueError, match="question id 'born'.* has no answer: a training "
                                         "question needs one"):
        read_squad_examples(write(tmp_path / "n.json", content), "1.1", True)
    assert len(read_squad_examples(tmp_path / "n.json", "1.1", False).examples) == 7


def test_training_answer_not_in_the_words_is_skipped_and_counted(tmp_path, caplog):
    # A no-break space inside the answer: run_squad.py's words keep it, the cleaned answer
    # (Python's split) does not, so the recipe cannot find it and skips the question.
    context = "It is 10\u00a0km long."
    content = {"data": [{"paragraphs": [{"context": context, "qas": [
        {"id": "nbsp", "question": "How long?",
         "answers": [{"text": "10\u00a0km", "answer_start": 6}]},
        {"id": "ok", "question": "What is it?", "answers": [{"text": "It", "answer_start": 0}]},
    ]}]}]}
    path = write(tmp_path / "nbsp.json", copy.deepcopy(content))
    read = read_squad_examples(path, "1.1", True)
    assert [e.qas_id for e in read.examples] == ["ok"] and read.skipped == ["nbsp"]
    assert "skipped 1 training question(s)" in caplog.text and "nbsp" in caplog.text
    # Evaluation keeps it: its gold text is all the metric needs.
    assert len(read_squad_examples(path, "1.1", False).examples) == 2

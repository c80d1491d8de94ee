"""BERT WordPiece ids equal the pure-Python reference (Google's algorithm) on real text."""

from __future__ import annotations

import unicodedata

import pytest

from megatron.tokenizer.bert import BertWordPieceTokenizer
from tests.tokenizer.reference_bert import ReferenceBert


@pytest.fixture(scope="module", params=[True, False], ids=["lower", "cased"])
def pair(request, shared_data):
    lower = request.param
    name = "bert-base-uncased-vocab.txt" if lower else "bert-base-cased-vocab.txt"
    path = str(shared_data / "tokenizers" / name)
    return BertWordPieceTokenizer(path, lower_case=lower), ReferenceBert(path, lower)


def test_ids_equal_reference_on_corpus(pair, corpus_texts):
    fast, reference = pair
    for text in corpus_texts:
        assert fast.tokenize(text) == reference.tokenize(text), text[:80]
    assert fast.tokenize_batch(corpus_texts[:3]) == [fast.tokenize(t) for t in corpus_texts[:3]]


# Each case below differed from Google's tokenization.py under HF's BertNormalizer +
# BertPreTokenizer + WordPiece(max 100).
MEGATRON_CASES = [
    "a" * 150,  # 101..200 characters: Megatron splits it, HF's default made it [UNK]
    "z" * 200 + " " + "z" * 201,  # the limit is 200 characters
    "x\ue000y",  # private use is not a control character: kept, so the word is [UNK]
    "unassigned\u0378 and \U000E0080x",  # Cn is kept too
    "soft\u00adhyphen zero\u200bwidth bom\ufeffhere rtl\u202emark",  # Cf is dropped
    "bell\x07 nul\x00 del\x7f esc\x1b \x1c\x1d sep \x85nel \ufffdrepl",  # Cc, NUL, U+FFFD
    "\U0002B820\U0002B8FF\U0002B91F ext-E ideographs",  # missing from HF's CJK table
    "中文字符 mixed中text 日本語のテキスト 한국어 \uf900\U0002F800",  # CJK vs not (kana, hangul)
    "café naïve Ångström ΟΔΟΣ ὈΔΥΣΣΕΎΣ. İstanbul ﬁne Straße e\u0301 \u0301lone",  # accents, sigma
    "a\u2e43b\u2e5dc\u061dd\U00011c70e",  # punctuation newer than HF's Unicode tables
    "mixed!?punct...\"q\"(x)[y]{z}<w>~t^c$d`b\\s|p@a#n%m&k*l+e=q;c:o,d.e/f-g_h",
    "“curly” ‘quotes’ — em–dash … ellipsis «guillemets» ¿¡ ·middle·dot ¶§",
    "\u037e\u0387\u1fef\u1fed",  # NFD turns these into ASCII punctuation
    "line\u2028sep\u2029para\u3000ideo\u00a0nbsp",
]


@pytest.mark.parametrize("text", MEGATRON_CASES)
def test_hard_cases_equal_reference(pair, text):
    fast, reference = pair
    assert fast.tokenize(text) == reference.tokenize(text)
    assert fast.tokenize_batch([text, text]) == [reference.tokenize(text)] * 2


def test_megatron_examples(shared_data):
    """The two examples of the audit, with the ids Megatron-LM's bert_tokenization.py gives."""
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")
    assert len(tok.tokenize("a" * 150)) == 75  # "aa" + 74 x "##aa"; not [UNK]
    assert tok.tokenize("x\ue000y") == [100]  # [UNK]; not "x" "##y"
    assert tok.tokenize("a" * 201) == [100]


def test_lone_surrogate_is_unknown_word(pair):
    fast, reference = pair
    text = "ok a\ud800b fine"
    assert fast.tokenize(text) == reference.tokenize(text)
    assert fast.tokenize_batch([text]) == [reference.tokenize(text)]


def test_code_point_sweep_equals_reference(pair):
    """Every 61st code point (and every one of the blocks where HF's tables differ from
    Python's), inside words, next to sigma and alone."""
    fast, reference = pair
    points = sorted(set(range(0, 0x110000, 61)) | set(range(0x2B800, 0x2B930))
                    | set(range(0x2E40, 0x2E60)) | set(range(0x0600, 0x0700)))
    points = [cp for cp in points if not 0xD800 <= cp <= 0xDFFF]
    texts = [f"a{chr(cp)}b X{chr(cp)} ΑΣ{chr(cp)} {chr(cp)}" for cp in points]
    got = fast.tokenize_batch(texts)
    bad = [hex(cp) for cp, text, ids in zip(points, texts, got) if ids != reference.tokenize(text)]
    assert not bad, f"{len(bad)} code points differ, e.g. {bad[:10]} ({unicodedata.unidata_version})"


def test_megatron_special_ids(shared_data):
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")
    # docs/FORMATS.md 2c: [BOS] and [EOS] are appended; eod is [EOS].
    assert tok.vocab_size == 30524
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.eod) == (101, 102, 103, 0, 30523)
    assert tok.bos_token_id == 30522 and tok.inv_vocab[30523] == "[EOS]"


def test_extra_ids(shared_data):
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt",
                                 vocab_extra_ids=3)
    assert tok.vocab_size == 30527
    assert tok.additional_special_tokens_ids == [30524, 30525, 30526]


def test_detokenize_glues_word_pieces(shared_data):
    tok = BertWordPieceTokenizer(shared_data / "tokenizers" / "bert-base-uncased-vocab.txt")
    assert tok.detokenize(tok.tokenize("Unaffable tokenization, sir!")) == "unaffable tokenization , sir !"


def test_missing_special_is_an_error(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\nhello\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"\[CLS\]"):
        BertWordPieceTokenizer(path)

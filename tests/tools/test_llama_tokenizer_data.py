"""The tokenizers Llama users name, from text to training: ``tools/preprocess_data.py
--append-eod`` with ``--tokenizer-type Llama2Tokenizer`` (a SentencePiece model) writes documents
that are Megatron-LM's ``_Llama2Tokenizer`` ids, ``<s>`` + the pieces + the eod ``</s>``; with
``HuggingFaceTokenizer`` (a local directory with a ``tokenizer.json``) the tokenizer's
post-processor's ids (its ``<s>``) + ``eos_token``, as ``AutoTokenizer(text).input_ids`` and
``eos_token_id``. The expected ids come from the ``sentencepiece`` / ``tokenizers`` libraries
directly; the bytes from docs/FORMATS.md (``megatron_dataset_bytes``). Then ``pretrain_gpt.py``,
run as a user runs it, trains a Llama-shaped model a few iterations on each with the same
tokenizer flags. Tiny tokenizers are trained here (nothing downloaded)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.test_preprocess_data import megatron_dataset_bytes, read, run, write_jsonl

REPO = Path(__file__).resolve().parents[2]
VOCAB = 300
UNK, BOS, EOS = 0, 1, 2
UINT16 = 8  # the .idx dtype code of a vocabulary below 65500


@pytest.fixture(scope="module")
def documents(shared_data) -> list[str]:
    """About 40 KB of tinyshakespeare in documents of a few paragraphs, one of them empty."""
    text = (shared_data / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:40_000]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    docs = ["\n\n".join(paragraphs[i:i + 4]) for i in range(0, len(paragraphs), 4)]
    return docs[:5] + [""] + docs[5:]


@pytest.fixture(scope="module")
def tokenizer_files(documents, tmp_path_factory) -> dict[str, Path]:
    """A SentencePiece BPE model with Llama's unk/bos/eos ids, and a ``tokenizer.json``
    directory whose post-processor puts ``<s>`` first (as Llama's does)."""
    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = tmp_path_factory.mktemp("llama_tokenizers")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(documents), model_writer=model, vocab_size=VOCAB,
        model_type="bpe", unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=-1, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(documents, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    (out / "hf").mkdir()
    hf.save(str(out / "hf" / "tokenizer.json"))
    (out / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return {"model": out / "tokenizer.model", "hf": out / "hf"}


def _flags(kind: str, files: dict[str, Path]) -> list[str]:
    model = files["model"] if kind == "Llama2Tokenizer" else files["hf"]
    return ["--tokenizer-type", kind, "--tokenizer-model", str(model)]


def _expected_ids(kind: str, files: dict[str, Path], text: str) -> list[int]:
    """The document's ids, eod included, from the tokenizer libraries themselves."""
    if kind == "Llama2Tokenizer":
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_file=str(files["model"]))
        assert (sp.bos_id(), sp.eos_id()) == (BOS, EOS)
        return [sp.bos_id()] + sp.encode_as_ids(text) + [sp.eos_id()]
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(files["hf"] / "tokenizer.json"))
    return hf.encode(text).ids + [hf.token_to_id("</s>")]


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "HuggingFaceTokenizer"])
def test_documents_are_bos_pieces_eod(tmp_path, documents, tokenizer_files, kind):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in documents])
    assert run(["--input", src, "--output-prefix", tmp_path / "out", *_flags(kind, tokenizer_files),
                "--append-eod", "--workers", 2]) == 0
    # One sequence per document (no sentence splitting), the empty text included: its ids are
    # the bos alone, which Megatron keeps (a non-empty sentence) and ends with the eod.
    docs = [[_expected_ids(kind, tokenizer_files, d)] for d in documents]
    assert docs[5] == [[BOS, EOS]]
    assert all(doc[0][0] == BOS and doc[0][-1] == EOS and BOS not in doc[0][1:-1]
               and EOS not in doc[0][1:-1] for doc in docs)
    assert read(tmp_path / "out_text_document") == megatron_dataset_bytes(docs, UINT16, "uint16")


def test_huggingface_eos_from_special_tokens_map(tmp_path, tokenizer_files):
    """Older tokenizer directories name eos/bos in ``special_tokens_map.json`` only, which
    ``AutoTokenizer`` reads too."""
    from megatron.tokenizer.huggingface import HuggingFaceTokenizer

    directory = tmp_path / "old"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((tokenizer_files["hf"] / "tokenizer.json")
                                               .read_bytes())
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "<unk>"}))  # not a candidate name
    tok = HuggingFaceTokenizer(directory)
    assert (tok.eod, tok.bos) == (UNK, BOS)


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "HuggingFaceTokenizer"])
def test_pretrain_gpt_trains_on_it(tmp_path, documents, tokenizer_files, kind):
    """``python pretrain_gpt.py`` with the same tokenizer flags: a RoPE / RMSNorm / SwiGLU / GQA
    model trains 3 iterations (one process, gloo) on the preprocessed documents."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in documents])
    flags = _flags(kind, tokenizer_files)
    assert run(["--input", src, "--output-prefix", tmp_path / "data", *flags, "--append-eod",
                "--workers", 1]) == 0
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--data-path", str(tmp_path / "data_text_document"), "--split", "90,10,0",
            "--data-cache-path", str(tmp_path / "cache"), *flags,
            "--make-vocab-size-divisible-by", "16", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--distributed-backend", "gloo", "--eod-mask-loss"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"> building {kind} tokenizer" in out, out[:2000]
    assert f"padded vocab (size: {VOCAB}) with 4 dummy tokens (new size: 304)" in out, out[:3000]
    losses = [float(line.split("lm loss:")[1].split("|")[0])
              for line in out.splitlines() if line.startswith(" iteration ")]
    assert len(losses) == 3 and all(0.0 < loss < 10.0 for loss in losses), out[-3000:]

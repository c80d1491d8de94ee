"""Train a tokenizer on a JSON-lines corpus, for users who have none yet.

    python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 32000 \\
        --output-dir tok/
    # -> tok/vocab.json + tok/merges.txt: --tokenizer-type GPT2BPETokenizer
    python tools/train_tokenizer.py --input corpus.jsonl --type sentencepiece --vocab-size 32000 \\
        --output-dir tok/
    # -> tok/tokenizer.model: --tokenizer-type SentencePieceTokenizer --tokenizer-model ...

``bpe`` is GPT-2's byte-level BPE (GPT-2 regex pre-split, no prefix space), trained with HF
``tokenizers``. Its ``vocab.json`` is written in GPT-2's id order (the 256 bytes in
``bytes_to_unicode`` order, then one id per merge, ``<|endoftext|>`` last), so ids follow merge
priority exactly as in OpenAI's files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.tokenizer.gpt2 import EOD_TOKEN, bytes_to_unicode  # noqa: E402


def iter_texts(paths: list[str], keys: list[str]) -> Iterator[str]:
    """The strings under ``keys`` of every JSON line (lists of strings are joined with newlines).

    Raises:
        ValueError: a non-JSON line or a missing key, naming the file and line.
    """
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
                for key in keys:
                    if not isinstance(doc, dict) or key not in doc:
                        raise ValueError(f"{path}:{lineno}: missing key {key!r} (see --json-keys)")
                    value = doc[key]
                    yield "\n".join(value) if isinstance(value, list) else str(value)


def train_bpe(texts: Iterator[str], vocab_size: int, output_dir: str) -> tuple[str, str]:
    """Byte-level BPE; returns the paths of ``vocab.json`` and ``merges.txt``.

    Raises:
        ValueError: ``vocab_size`` leaves no room for merges.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size <= 257:
        raise ValueError(f"--vocab-size {vocab_size} must exceed 257 (256 bytes + {EOD_TOKEN})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    merges = [m.split(" ") if isinstance(m, str) else m
              for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))  # a repeated result keeps its first id
    vocab[EOD_TOKEN] = len(vocab)
    vocab_path, merges_path = os.path.join(output_dir, "vocab.json"), os.path.join(output_dir, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab_path, merges_path


def train_sentencepiece(texts: Iterator[str], vocab_size: int, output_dir: str,
                        model_type: str) -> str:
    """A SentencePiece model; returns the path of ``tokenizer.model``."""
    import sentencepiece

    prefix = os.path.join(output_dir, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=texts, model_prefix=prefix, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, byte_fallback=model_type == "bpe",
        # Documents can be long; sentencepiece skips "sentences" above this many bytes.
        max_sentence_length=1 << 20, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        minloglevel=2)
    return prefix + ".model"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--input", required=True, nargs="+", help="JSON-lines file(s), .gz allowed")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose text to train on (default: text)")
    parser.add_argument("--vocab-size", type=int, required=True, help="size of the vocabulary")
    parser.add_argument("--type", choices=["bpe", "sentencepiece"], default="bpe",
                        help="bpe: GPT-2 byte-level BPE files; sentencepiece: a .model file")
    parser.add_argument("--sentencepiece-model-type", choices=["unigram", "bpe"], default="unigram",
                        help="algorithm of --type sentencepiece (default: unigram)")
    parser.add_argument("--output-dir", required=True, help="directory for the tokenizer files")
    args = parser.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input {path} does not exist")
    os.makedirs(args.output_dir, exist_ok=True)
    texts = iter_texts(args.input, args.json_keys)
    try:
        if args.type == "bpe":
            written = train_bpe(texts, args.vocab_size, args.output_dir)
        else:
            written = (train_sentencepiece(texts, args.vocab_size, args.output_dir,
                                           args.sentencepiece_model_type),)
    except (ValueError, RuntimeError) as err:
        print(f"train_tokenizer.py: error: {err}", file=sys.stderr)
        return 1
    print("Wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())

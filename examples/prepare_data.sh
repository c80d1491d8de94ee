#!/usr/bin/env bash
# Build a real text corpus from what this machine already has (no download), train a GPT-2-style
# byte-level BPE tokenizer on it, and preprocess it into Megatron's .bin/.idx format.
#
#   bash examples/prepare_data.sh [OUT_DIR]        (default: quickstart_out)
#
# Produces $OUT/tokenizer/{vocab.json,merges.txt} and $OUT/data/corpus_text_document.{bin,idx}.
# Steps whose output exists are skipped.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/quickstart_out}
PY=${PYTHON:-$ROOT/.venv/bin/python}
TEXT_DIR=${TEXT_DIR:-$ROOT/../shared/data/corpus}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
mkdir -p "$OUT/data" "$OUT/tokenizer"

if [ ! -s "$OUT/corpus.jsonl" ]; then
  echo "== 1/3 corpus: text already on this machine -> $OUT/corpus.jsonl"
  "$PY" "$ROOT/tools/make_local_corpus.py" --output "$OUT/corpus.jsonl" \
      --text-dir "$TEXT_DIR" --max-mb "${CORPUS_MB:-12}"
fi
if [ ! -s "$OUT/tokenizer/vocab.json" ]; then
  echo "== 2/3 tokenizer: byte-level BPE, vocabulary $VOCAB_SIZE -> $OUT/tokenizer"
  "$PY" "$ROOT/tools/train_tokenizer.py" --input "$OUT/corpus.jsonl" --type bpe \
      --vocab-size "$VOCAB_SIZE" --output-dir "$OUT/tokenizer"
fi
if [ ! -s "$OUT/data/corpus_text_document.idx" ]; then
  echo "== 3/3 preprocess: $OUT/corpus.jsonl -> $OUT/data/corpus_text_document.{bin,idx}"
  "$PY" "$ROOT/tools/preprocess_data.py" --input "$OUT/corpus.jsonl" \
      --output-prefix "$OUT/data/corpus" --tokenizer-type GPT2BPETokenizer \
      --vocab-file "$OUT/tokenizer/vocab.json" --merge-file "$OUT/tokenizer/merges.txt" \
      --append-eod --workers 2 --log-interval 5000
fi

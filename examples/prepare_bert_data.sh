#!/usr/bin/env bash
# Build a sentence-split BERT dataset from text already on this machine (no download): the
# local corpus (as examples/prepare_data.sh makes it), tokenized with the WordPiece vocabulary
# in ../shared/data/tokenizers and split into sentences (preprocess_data.py --split-sentences),
# so each sentence is one sequence and each document a doc_idx boundary.
#
#   bash examples/prepare_bert_data.sh [OUT_DIR]        (default: quickstart_out)
#
# Produces $OUT/bert_data/corpus_text_sentence.{bin,idx}. Steps whose output exists are skipped.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/quickstart_out}
PY=${PYTHON:-$ROOT/.venv/bin/python}
TEXT_DIR=${TEXT_DIR:-$ROOT/../shared/data/corpus}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/../shared/data/tokenizers/bert-base-uncased-vocab.txt}
mkdir -p "$OUT/bert_data"

if [ ! -s "$OUT/corpus.jsonl" ]; then
  echo "== 1/2 corpus: text already on this machine -> $OUT/corpus.jsonl"
  "$PY" "$ROOT/tools/make_local_corpus.py" --output "$OUT/corpus.jsonl" \
      --text-dir "$TEXT_DIR" --max-mb "${CORPUS_MB:-12}"
fi
if [ ! -s "$OUT/bert_data/corpus_text_sentence.idx" ]; then
  echo "== 2/2 preprocess: $OUT/corpus.jsonl -> $OUT/bert_data/corpus_text_sentence.{bin,idx}"
  "$PY" "$ROOT/tools/preprocess_data.py" --input "$OUT/corpus.jsonl" \
      --output-prefix "$OUT/bert_data/corpus" --tokenizer-type BertWordPieceLowerCase \
      --vocab-file "$VOCAB_FILE" --split-sentences --workers 2 --log-interval 5000
fi

#!/bin/bash
# Megatron-LM style single-process GPT pretraining script; runs as written on a CPU machine
# (it prepares the quickstart corpus and tokenizer first when DATA_PATH is not given).
# For the paper's "345M" model on GPUs use:
#   --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
#   --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --fp16
#   --train-iters 500000 --lr-decay-iters 320000 --lr 0.00015 --min-lr 1.0e-5
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/quickstart_out/checkpoints_pretrain_gpt}
if [ -z "${DATA_PATH:-}" ]; then
  bash "$ROOT/examples/prepare_data.sh" "$ROOT/quickstart_out"
  DATA_PATH=$ROOT/quickstart_out/data/corpus_text_document
  VOCAB_FILE=$ROOT/quickstart_out/tokenizer/vocab.json
  MERGE_FILE=$ROOT/quickstart_out/tokenizer/merges.txt
fi
VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to a GPT-2 vocab.json}
MERGE_FILE=${MERGE_FILE:?set MERGE_FILE to a GPT-2 merges.txt}

GPT_ARGS="
    --num-layers ${NUM_LAYERS:-4}
    --hidden-size ${HIDDEN_SIZE:-256}
    --num-attention-heads ${NUM_HEADS:-8}
    --seq-length 128
    --max-position-embeddings 128
    --micro-batch-size 8
    --global-batch-size 16
    --lr 0.0015
    --train-iters ${TRAIN_ITERS:-100}
    --lr-decay-iters ${TRAIN_ITERS:-100}
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --weight-decay 1e-2
    --lr-warmup-fraction .1
    --clip-grad 1.0
"
DATA_ARGS="
    --data-path $DATA_PATH
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
"
OUTPUT_ARGS="
    --log-interval 10
    --save-interval 50
    --eval-interval 50
    --eval-iters 5
"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" "$ROOT/pretrain_gpt.py" $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS \
    --distributed-backend gloo --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"

#!/bin/bash
# Megatron-LM style single-process BERT pretraining script; runs as written on a CPU machine
# (it prepares the sentence-split quickstart corpus first when DATA_PATH is not given).
# For the paper's 336M BERT on GPUs use:
#   --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
#   --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 1024 --fp16
#   --train-iters 2000000 --lr-decay-iters 990000 --lr 0.0001 --min-lr 1.0e-5
#   --lr-warmup-fraction .01
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/quickstart_out/checkpoints_pretrain_bert}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/../shared/data/tokenizers/bert-base-uncased-vocab.txt}
if [ -z "${DATA_PATH:-}" ]; then
  bash "$ROOT/examples/prepare_bert_data.sh" "$ROOT/quickstart_out"
  DATA_PATH=$ROOT/quickstart_out/bert_data/corpus_text_sentence
fi

BERT_ARGS="
    --num-layers ${NUM_LAYERS:-4}
    --hidden-size ${HIDDEN_SIZE:-256}
    --num-attention-heads ${NUM_HEADS:-8}
    --seq-length 128
    --max-position-embeddings 512
    --micro-batch-size 8
    --global-batch-size 16
    --lr 0.0005
    --train-iters ${TRAIN_ITERS:-100}
    --lr-decay-iters ${TRAIN_ITERS:-100}
    --lr-decay-style linear
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
"
DATA_ARGS="
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --split 949,50,1
"
OUTPUT_ARGS="
    --log-interval 10
    --save-interval 50
    --eval-interval 50
    --eval-iters 5
"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" "$ROOT/pretrain_bert.py" $BERT_ARGS $DATA_ARGS \
    $OUTPUT_ARGS --distributed-backend gloo --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"

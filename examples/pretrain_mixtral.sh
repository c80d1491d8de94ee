#!/bin/bash
# A tiny Mixtral-shaped mixture-of-experts GPT (8 experts, top-2 softmax routing, SwiGLU
# experts, RoPE, RMSNorm, grouped-query attention, no biases, untied output layer, the
# load-balancing aux loss and the router z-loss), written as Megatron-LM's MoE examples are;
# runs as written on a CPU machine on the quickstart's corpus and GPT-2 BPE tokenizer
# (prepared first when DATA_PATH is not given). Mixtral 8x7B on GPUs (its own tokenizer):
#   --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
#   --num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768
#   --rotary-base 1000000 --bf16 --moe-router-dtype fp32 --moe-grouped-gemm
#   --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4
#   --use-distributed-optimizer
# (expert parallelism, --expert-model-parallel-size > 1, with data parallelism only so far:
# docs/guide/moe.md).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/quickstart_out/checkpoints_pretrain_mixtral}
if [ -z "${DATA_PATH:-}" ]; then
  bash "$ROOT/examples/prepare_data.sh" "$ROOT/quickstart_out"
  DATA_PATH=$ROOT/quickstart_out/data/corpus_text_document
  VOCAB_FILE=$ROOT/quickstart_out/tokenizer/vocab.json
  MERGE_FILE=$ROOT/quickstart_out/tokenizer/merges.txt
fi
VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to a GPT-2 vocab.json}
MERGE_FILE=${MERGE_FILE:?set MERGE_FILE to a GPT-2 merges.txt}

MODEL_ARGS="
    --num-layers ${NUM_LAYERS:-2}
    --hidden-size ${HIDDEN_SIZE:-128}
    --ffn-hidden-size ${FFN_HIDDEN_SIZE:-256}
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --seq-length 128
    --max-position-embeddings 128
"
MOE_ARGS="
    --num-experts ${NUM_EXPERTS:-8}
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-z-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall
    --moe-router-dtype fp32
    --moe-grouped-gemm
"
TRAINING_ARGS="
    --micro-batch-size 4
    --global-batch-size 8
    --lr 1e-3
    --train-iters ${TRAIN_ITERS:-40}
    --lr-decay-iters ${TRAIN_ITERS:-40}
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --weight-decay 0.1
    --lr-warmup-fraction .1
    --clip-grad 1.0
    --init-method-std 0.02
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
    --save-interval ${TRAIN_ITERS:-40}
    --eval-interval ${TRAIN_ITERS:-40}
    --eval-iters 2
"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" "$ROOT/pretrain_gpt.py" $MODEL_ARGS $MOE_ARGS \
    $TRAINING_ARGS $DATA_ARGS $OUTPUT_ARGS --distributed-backend gloo \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"

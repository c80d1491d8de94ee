#!/bin/bash
# A small Llama-style GPT (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied
# output layer), written as Megatron-LM's Llama examples are; runs as written on a CPU machine
# on the quickstart's corpus and GPT-2 BPE tokenizer (prepared first when DATA_PATH is not
# given). A Llama 2 7B on GPUs (its own tokenizer: --tokenizer-type Llama2Tokenizer
# --tokenizer-model tokenizer.model, or HuggingFaceTokenizer --tokenizer-model DIR):
#   --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
#   --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --bf16
#   --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
#   --use-distributed-optimizer
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/quickstart_out/checkpoints_pretrain_llama}
if [ -z "${DATA_PATH:-}" ]; then
  bash "$ROOT/examples/prepare_data.sh" "$ROOT/quickstart_out"
  DATA_PATH=$ROOT/quickstart_out/data/corpus_text_document
  VOCAB_FILE=$ROOT/quickstart_out/tokenizer/vocab.json
  MERGE_FILE=$ROOT/quickstart_out/tokenizer/merges.txt
fi
VOCAB_FILE=${VOCAB_FILE:?set VOCAB_FILE to a GPT-2 vocab.json}
MERGE_FILE=${MERGE_FILE:?set MERGE_FILE to a GPT-2 merges.txt}

LLAMA_ARGS="
    --num-layers ${NUM_LAYERS:-4}
    --hidden-size ${HIDDEN_SIZE:-256}
    --ffn-hidden-size ${FFN_HIDDEN_SIZE:-688}
    --num-attention-heads ${NUM_HEADS:-8}
    --group-query-attention
    --num-query-groups ${NUM_QUERY_GROUPS:-2}
    --position-embedding-type rope
    --rotary-base 10000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --seq-length 128
    --max-position-embeddings 128
    --micro-batch-size 8
    --global-batch-size 16
    --lr 0.0015
    --train-iters ${TRAIN_ITERS:-100}
    --lr-decay-iters ${TRAIN_ITERS:-100}
    --lr-decay-style cosine
    --min-lr 1.0e-4
    --weight-decay 1e-1
    --adam-beta2 0.95
    --init-method-std 0.02
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
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" "$ROOT/pretrain_gpt.py" $LLAMA_ARGS $DATA_ARGS \
    $OUTPUT_ARGS --distributed-backend gloo --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"

#!/bin/bash
# Megatron-LM style multi-process / multi-node BERT pretraining with tensor and data
# parallelism. Runs as written on one CPU machine (2 processes, TP=2); on a cluster set the
# torchrun variables on every node, e.g. GPUS_PER_NODE=8 NNODES=4 NODE_RANK=<0..3>
# MASTER_ADDR=<node0> BACKEND=nccl, and raise TP / the model size.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ -x "$ROOT/.venv/bin/python" ] || bash "$ROOT/scripts/bootstrap.sh"
TORCHRUN=${TORCHRUN:-$ROOT/.venv/bin/torchrun}

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
TP=${TP:-2}
BACKEND=${BACKEND:-gloo}
# The global batch must be a multiple of micro batch x data-parallel size (world / TP).
MICRO_BATCH=${MICRO_BATCH:-8}
DP=$(( GPUS_PER_NODE * NNODES / TP ))
GLOBAL_BATCH=${GLOBAL_BATCH:-$(( MICRO_BATCH * DP * 2 ))}

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$ROOT/quickstart_out/checkpoints_bert_distributed}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/../shared/data/tokenizers/bert-base-uncased-vocab.txt}
if [ -z "${DATA_PATH:-}" ]; then
  bash "$ROOT/examples/prepare_bert_data.sh" "$ROOT/quickstart_out"
  DATA_PATH=$ROOT/quickstart_out/bert_data/corpus_text_sentence
fi

DISTRIBUTED_ARGS="
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
"
BERT_ARGS="
    --tensor-model-parallel-size $TP
    --num-layers ${NUM_LAYERS:-4}
    --hidden-size ${HIDDEN_SIZE:-256}
    --num-attention-heads ${NUM_HEADS:-8}
    --seq-length 128
    --max-position-embeddings 512
    --micro-batch-size $MICRO_BATCH
    --global-batch-size $GLOBAL_BATCH
    --lr 0.0005
    --train-iters ${TRAIN_ITERS:-100}
    --lr-decay-iters ${TRAIN_ITERS:-100}
    --lr-decay-style linear
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --distributed-backend $BACKEND
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
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$TORCHRUN" $DISTRIBUTED_ARGS "$ROOT/pretrain_bert.py" \
    $BERT_ARGS $DATA_ARGS $OUTPUT_ARGS --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"

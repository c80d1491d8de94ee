#!/bin/bash
# Finetune a pretrained BERT on MNLI (Megatron-LM's examples/finetune_mnli_distributed.sh):
# tasks/main.py --task MNLI, a Classification head (pooler -> dropout -> Linear(h, 3)). Each
# epoch ends with a checkpoint and the accuracy of every --valid-data file, then overall.
#
#   TRAIN_DATA=data/glue_data/MNLI/train.tsv \
#   VALID_DATA="data/glue_data/MNLI/dev_matched.tsv data/glue_data/MNLI/dev_mismatched.tsv" \
#   PRETRAINED_CHECKPOINT=checkpoints/bert_345m VOCAB_FILE=bert-vocab.txt \
#   bash examples/finetune_mnli.sh
#
# Without TRAIN_DATA it runs here as written: a tiny random BERT (2 layers, TP=2 on two CPU
# ranks) on small synthetic MNLI TSVs (tasks/finetune_sample_data.py) with the WordPiece
# vocabulary in ../shared/data/tokenizers. The full recipe is the paper's 345M BERT on 8 GPUs:
# 5 epochs, lr 5e-5 with 6.5% warm-up, micro-batch 8.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }
TORCHRUN=$(dirname "$PY")/torchrun
VOCAB_FILE=${VOCAB_FILE:-$ROOT/../shared/data/tokenizers/bert-base-uncased-vocab.txt}

if [ -z "${TRAIN_DATA:-}" ]; then
  OUT=${OUT:-$ROOT/quickstart_out/mnli_demo}
  eval "$(cd "$ROOT" && "$PY" -m tasks.finetune_sample_data --task MNLI --out "$OUT")"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec "$TORCHRUN" --standalone --nproc-per-node 2 "$ROOT/tasks/main.py" \
       --task MNLI --seed 1234 --train-data $TRAIN_DATA --valid-data $VALID_DATA \
       --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE" \
       --epochs 3 --tensor-model-parallel-size 2 \
       --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
       --seq-length 32 --max-position-embeddings 32 --make-vocab-size-divisible-by 64 \
       --micro-batch-size 16 --global-batch-size 16 --lr 5.0e-3 --lr-decay-style linear \
       --lr-warmup-fraction 0.065 --weight-decay 1.0e-2 --clip-grad 1.0 \
       --hidden-dropout 0.1 --attention-dropout 0.1 \
       --save "$OUT/checkpoints" --save-interval 500000 --allow-overwrite-checkpoints \
       --log-interval 8 --eval-interval 1000 --eval-iters 4 --distributed-backend gloo "$@"
fi

WORLD_SIZE=${WORLD_SIZE:-8}
VALID_DATA=${VALID_DATA:-"data/glue_data/MNLI/dev_matched.tsv data/glue_data/MNLI/dev_mismatched.tsv"}
PRETRAINED_CHECKPOINT=${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert_345m_mnli}
DISTRIBUTED_ARGS="--nproc-per-node $WORLD_SIZE --nnodes 1 --node-rank 0 --master-addr localhost --master-port 6000"

"$TORCHRUN" $DISTRIBUTED_ARGS "$ROOT/tasks/main.py" \
       --task MNLI \
       --seed 1234 \
       --train-data $TRAIN_DATA \
       --valid-data $VALID_DATA \
       --tokenizer-type BertWordPieceLowerCase \
       --vocab-file $VOCAB_FILE \
       --epochs 5 \
       --pretrained-checkpoint $PRETRAINED_CHECKPOINT \
       --tensor-model-parallel-size 1 \
       --num-layers 24 \
       --hidden-size 1024 \
       --num-attention-heads 16 \
       --micro-batch-size 8 \
       --lr 5.0e-5 \
       --lr-decay-style linear \
       --lr-warmup-fraction 0.065 \
       --seq-length 512 \
       --max-position-embeddings 512 \
       --save-interval 500000 \
       --save $CHECKPOINT_PATH \
       --log-interval 10 \
       --eval-interval 100 \
       --eval-iters 50 \
       --weight-decay 1.0e-2 \
       --fp16 "$@"

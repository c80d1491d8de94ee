#!/usr/bin/env bash
# The main job, end to end on a CPU machine in a few minutes:
#   corpus (text already on this machine) -> tokenizer -> preprocess -> train a small GPT with
#   tensor parallelism 2 (torchrun, 2 processes) -> validation perplexity -> checkpoint ->
#   generated text from the checkpoint.
#
#   bash examples/quickstart.sh            (outputs in ./quickstart_out)
#
# Knobs (environment): ITERS (default 150), OUT, NPROC (default 2 = TP size).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
bash scripts/bootstrap.sh
OUT=${OUT:-$ROOT/quickstart_out}
ITERS=${ITERS:-150}
TP=${NPROC:-2}
PY=$ROOT/.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one thread per rank: 2 ranks share 2 cores

bash examples/prepare_data.sh "$OUT"

TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/tokenizer/vocab.json"
           --merge-file "$OUT/tokenizer/merges.txt")
rm -rf "$OUT/checkpoints" "$OUT/tensorboard"
echo "== train: GPT 4 layers x 256 hidden, TP=$TP, $ITERS iterations (log every 10)"
"$ROOT/.venv/bin/torchrun" --standalone --nproc-per-node "$TP" pretrain_gpt.py \
    --tensor-model-parallel-size "$TP" --distributed-backend gloo \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 15 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --train-iters "$ITERS" --log-interval 10 --eval-interval 50 --eval-iters 5 \
    --data-path "$OUT/data/corpus_text_document" --split 98,1,1 "${TOKENIZER[@]}" \
    --num-workers 1 --save "$OUT/checkpoints" --save-interval "$ITERS" \
    --tensorboard-dir "$OUT/tensorboard" --log-validation-ppl-to-tensorboard

echo "== generate: top-p sampling from the checkpoint (TP=$TP)"
"$ROOT/.venv/bin/torchrun" --standalone --nproc-per-node "$TP" tools/generate.py \
    --load "$OUT/checkpoints" --use-checkpoint-args --distributed-backend gloo \
    "${TOKENIZER[@]}" --micro-batch-size 1 \
    --prompt "It was a dark and stormy night, and" --prompt "The whale" \
    --num-tokens-to-generate 40 --top_p 0.9 --temperature 0.8

echo "== done: checkpoint in $OUT/checkpoints, TensorBoard logs in $OUT/tensorboard"

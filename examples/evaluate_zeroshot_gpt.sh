#!/bin/bash
# Zero-shot evaluation of a GPT checkpoint, Megatron-LM style (tasks/main.py): WikiText-103
# perplexity (with the adjusted perplexity against the original word count) and LAMBADA accuracy.
#
#   bash examples/evaluate_zeroshot_gpt.sh            (the quickstart's checkpoint and tokenizer)
#
# Runs as written after examples/quickstart.sh (TP=2 checkpoint in quickstart_out/checkpoints);
# for examples/pretrain_gpt.sh's checkpoint:
#   CHECKPOINT_PATH=quickstart_out/checkpoints_pretrain_gpt NPROC=1 bash examples/evaluate_zeroshot_gpt.sh
# Without WIKITEXT_DATA / LAMBADA_DATA it writes small files in those formats from text already on
# this machine (not the real data sets: their numbers compare checkpoints, not papers). For the
# paper's figures point them at WikiText-103's wiki.test.tokens and LAMBADA's lambada_test.jsonl
# and use the GPT-2 vocab.json/merges.txt the model was trained with (VOCAB_FILE, MERGE_FILE);
# on GPUs add --fp16 and a larger --micro-batch-size.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }
OUT=${OUT:-$ROOT/quickstart_out}

CHECKPOINT_PATH=${CHECKPOINT_PATH:-$OUT/checkpoints}
VOCAB_FILE=${VOCAB_FILE:-$OUT/tokenizer/vocab.json}
MERGE_FILE=${MERGE_FILE:-$OUT/tokenizer/merges.txt}
NPROC=${NPROC:-2}   # = the checkpoint's --tensor-model-parallel-size x pipeline size
[ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ] || {
  echo "no checkpoint in $CHECKPOINT_PATH: run examples/quickstart.sh first (or set CHECKPOINT_PATH)"
  exit 1; }

if [ -z "${WIKITEXT_DATA:-}" ] || [ -z "${LAMBADA_DATA:-}" ]; then
  "$PY" "$ROOT/tasks/zeroshot_gpt/sample_data.py" --text-dir "${TEXT_DIR:-$ROOT/../shared/data/corpus}" \
      --output-dir "$OUT/zeroshot" --lambada-max-words 60
fi
WIKITEXT_DATA=${WIKITEXT_DATA:-$OUT/zeroshot/wiki.test.tokens}
LAMBADA_DATA=${LAMBADA_DATA:-$OUT/zeroshot/lambada_test.jsonl}

COMMON_ARGS="
    --load $CHECKPOINT_PATH
    --use-checkpoint-args
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --micro-batch-size 8
    --log-interval 10
    --distributed-backend gloo
"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LAUNCH="$ROOT/.venv/bin/torchrun --standalone --nproc-per-node $NPROC"

echo "== WIKITEXT103: perplexity of $WIKITEXT_DATA"
$LAUNCH "$ROOT/tasks/main.py" --task WIKITEXT103 --valid-data "$WIKITEXT_DATA" \
    --overlapping-eval 32 $COMMON_ARGS "$@"

echo "== LAMBADA (strict): accuracy on $LAMBADA_DATA"
$LAUNCH "$ROOT/tasks/main.py" --task LAMBADA --valid-data "$LAMBADA_DATA" \
    --strict-lambada $COMMON_ARGS "$@"

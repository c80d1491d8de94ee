#!/bin/bash
# Finetune a pretrained BERT on SQuAD 1.1 or 2.0 (the standard BERT recipe: seq 384, document
# stride 128, question <= 64 tokens, answers <= 30 tokens, n-best 20), Megatron-LM style
# (tasks/main.py --task SQUAD). Each epoch ends with the official EM/F1 on the dev file and
# writes predictions.json (+ null_odds.json for 2.0) under $CHECKPOINT_PATH/squad_predictions.
#
#   SQUAD_VERSION=2.0 TRAIN_DATA=squad/train-v2.0.json VALID_DATA=squad/dev-v2.0.json \
#   PRETRAINED_CHECKPOINT=checkpoints/bert_345m VOCAB_FILE=bert-vocab.txt \
#   bash examples/finetune_squad.sh
#
#   DEMO=1 bash examples/finetune_squad.sh    (runs here: a tiny random BERT on a small
#                                              synthetic file in the SQuAD 2.0 format)
#
# The defaults are the paper's 345M BERT (24 layers, 1024 hidden, 16 heads) on 8 GPUs, global
# batch 32, lr 3e-5 with 10% linear warm-up (Google's run_squad.py), 2 epochs. For SQuAD 2.0,
# pick --null-score-diff-threshold from the dev run's best_f1_thresh (logged each epoch) and
# re-evaluate with --epochs 0 --load $CHECKPOINT_PATH.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { bash "$ROOT/scripts/bootstrap.sh"; PY=$ROOT/.venv/bin/python; }
TORCHRUN=$(dirname "$PY")/torchrun

SQUAD_VERSION=${SQUAD_VERSION:-1.1}
VOCAB_FILE=${VOCAB_FILE:-$ROOT/../shared/data/tokenizers/bert-base-uncased-vocab.txt}

if [ "${DEMO:-0}" = 1 ]; then
  OUT=${OUT:-$ROOT/quickstart_out/squad_demo}
  mkdir -p "$OUT"
  "$PY" - "$OUT" <<'PYEOF'
import json, random, sys
out = sys.argv[1]
colors = ["red", "blue", "green", "yellow", "black", "white", "brown", "pink"]
filler = "the cat walked to river and then looked at a small boat near hill my friend".split()
for name, n, seed in (("train-v2.0.json", 256, 1), ("dev-v2.0.json", 48, 2)):
    rng, data = random.Random(seed), []
    for i in range(n):
        words = [rng.choice(filler) for _ in range(14)]
        qa = {"id": f"{name}-{i}", "question": "which colour is named here ?"}
        if i % 4 == 3:
            qa.update(answers=[], is_impossible=True)
        else:
            color = rng.choice(colors).capitalize()
            words.insert(rng.randrange(15), color + ",")
            qa.update(answers=[{"text": color, "answer_start": " ".join(words).index(color + ",")}],
                      is_impossible=False)
        data.append({"title": str(i), "paragraphs": [{"context": " ".join(words), "qas": [qa]}]})
    json.dump({"version": "v2.0", "data": data}, open(f"{out}/{name}", "w"))
PYEOF
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec "$TORCHRUN" --standalone --nproc-per-node 2 "$ROOT/tasks/main.py" \
       --task SQUAD --squad-version 2.0 \
       --train-data "$OUT/train-v2.0.json" --valid-data "$OUT/dev-v2.0.json" \
       --epochs 2 --tensor-model-parallel-size 2 \
       --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
       --seq-length 32 --max-position-embeddings 32 --max-query-length 8 --doc-stride 16 \
       --micro-batch-size 8 --global-batch-size 8 --lr 1e-3 --lr-decay-style linear \
       --lr-warmup-fraction 0.1 --hidden-dropout 0 --attention-dropout 0 \
       --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE" \
       --save "$OUT/checkpoints" --save-interval 100000 --log-interval 8 --eval-iters 0 \
       --make-vocab-size-divisible-by 64 --distributed-backend gloo
fi

WORLD_SIZE=${WORLD_SIZE:-8}
TRAIN_DATA=${TRAIN_DATA:-data/squad/train-v$SQUAD_VERSION.json}
VALID_DATA=${VALID_DATA:-data/squad/dev-v$SQUAD_VERSION.json}
PRETRAINED_CHECKPOINT=${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert_345m_squad$SQUAD_VERSION}
for f in "$TRAIN_DATA" "$VALID_DATA"; do
  [ -f "$f" ] || { echo "$f not found: set TRAIN_DATA / VALID_DATA to the SQuAD json files" \
                        "(or DEMO=1 for a synthetic run)"; exit 1; }
done

DISTRIBUTED_ARGS="--nproc-per-node $WORLD_SIZE --nnodes 1 --node-rank 0 --master-addr localhost --master-port 6000"

"$TORCHRUN" $DISTRIBUTED_ARGS "$ROOT/tasks/main.py" \
       --task SQUAD \
       --squad-version $SQUAD_VERSION \
       --seed 1234 \
       --train-data $TRAIN_DATA \
       --valid-data $VALID_DATA \
       --tokenizer-type BertWordPieceLowerCase \
       --vocab-file $VOCAB_FILE \
       --epochs 2 \
       --pretrained-checkpoint $PRETRAINED_CHECKPOINT \
       --tensor-model-parallel-size 1 \
       --num-layers 24 \
       --hidden-size 1024 \
       --num-attention-heads 16 \
       --micro-batch-size 4 \
       --global-batch-size 32 \
       --eval-micro-batch-size 32 \
       --lr 3.0e-5 \
       --lr-decay-style linear \
       --lr-warmup-fraction 0.1 \
       --seq-length 384 \
       --max-position-embeddings 512 \
       --doc-stride 128 \
       --max-query-length 64 \
       --max-answer-length 30 \
       --n-best-size 20 \
       --null-score-diff-threshold 0.0 \
       --save-interval 100000 \
       --save $CHECKPOINT_PATH \
       --log-interval 10 \
       --eval-iters 0 \
       --weight-decay 1.0e-2 \
       --clip-grad 1.0 \
       --hidden-dropout 0.1 \
       --attention-dropout 0.1 \
       --fp16

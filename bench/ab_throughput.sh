#!/usr/bin/env bash
# Two builds side by side on the same GPU in one call: bench/gpt_throughput of build A and of build
# B on each preset, in the order A B B A so drift and warm-up hit both alike, then one JSON line per preset with the
# median tokens/s of each and B/A (and the peak memory of each). For "no change of behaviour"
# refactors: B/A should be 1 within noise.
# Usage: [AB_FLAGS=--deterministic] bench/ab_throughput.sh A_BIN_DIR B_BIN_DIR [presets...]   (dirs holding gpt_throughput)
set -uo pipefail
A=$1; B=$2; shift 2
PRESETS=${*:-gpt2-124M gpt2-350M gpt-1.3B gpt2-1.5B llama-1B}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for p in $PRESETS; do
  : > "$OUT/ab_$p.jsonl"
  for side in A B B A; do
    dir=$A; [[ $side == B ]] && dir=$B
    "$dir/gpt_throughput" --preset "$p" --steps 10 --warmup 3 --device cuda --dtype bf16 ${AB_FLAGS:-} 2>&1 |
      grep '"bench": "gpt_throughput"' | sed "s/^{/{\"side\": \"$side\", /" >> "$OUT/ab_$p.jsonl"
  done
  python3 - "$p" "$OUT/ab_$p.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[2])]
side = lambda s, k: [r[k] for r in rows if r["side"] == s]
out = {"bench": "ab_throughput", "preset": sys.argv[1]}
if side("A", "tokens_per_s") and side("B", "tokens_per_s"):
    a, b = statistics.median(side("A", "tokens_per_s")), statistics.median(side("B", "tokens_per_s"))
    out.update({"tokens_per_s_A": round(a), "tokens_per_s_B": round(b), "B_over_A": round(b / a, 4),
                "runs": [round(x) for x in side("A", "tokens_per_s")] + [round(x) for x in side("B", "tokens_per_s")]})
    out["peak_mem_gb_A"], out["peak_mem_gb_B"] = max(side("A", "peak_mem_gb")), max(side("B", "peak_mem_gb"))
    out["loss_A"], out["loss_B"] = side("A", "loss")[0], side("B", "loss")[0]
else:
    out["error"] = "a side produced no result"
print(json.dumps(out))
PY
done

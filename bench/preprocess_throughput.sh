#!/usr/bin/env bash
# preprocess_data throughput (MB/s of JSONL in) with the GPT-2 BPE tokenizer, --workers 1 and 2.
# The input (~100 MB by default) is generated at run time from tinyshakespeare: the text repeated
# and cut into ~600-character documents, one {"id", "text"} JSON object per line.
# Prints one JSON line per run to stdout.
#
# usage: bench/preprocess_throughput.sh [build-dir] [size-MB] [workers...]
#   env: TINYSHAKESPEARE, GPT2_VOCAB, GPT2_MERGES (default: ../shared/data/...), BENCH_TMP (default /tmp)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
size_mb=${2:-100}
shift $(($# > 2 ? 2 : $#))
workers=("$@")
[ ${#workers[@]} -eq 0 ] && workers=(1 2)
text=${TINYSHAKESPEARE:-$root/../shared/data/tinyshakespeare.txt}
vocab=${GPT2_VOCAB:-$root/../shared/data/gpt2-vocab.json}
merges=${GPT2_MERGES:-$root/../shared/data/gpt2-merges.txt}
tool=$build/bin/preprocess_data
for f in "$text" "$vocab" "$merges" "$tool"; do
  [ -e "$f" ] || { echo "preprocess_throughput: $f not found" >&2; exit 1; }
done

work=$(mktemp -d "${BENCH_TMP:-/tmp}/preprocess_bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 - "$text" "$work/input.jsonl" "$size_mb" <<'EOF'
import json, sys
text = open(sys.argv[1], encoding="utf-8").read()
target = int(sys.argv[3]) * 1024 * 1024
written, doc, pos = 0, 0, 0
with open(sys.argv[2], "w", encoding="utf-8") as out:
    while written < target:
        chunk = text[pos:pos + 600]
        pos = pos + 600 if pos + 600 < len(text) else 0
        line = json.dumps({"id": doc, "text": chunk}) + "\n"
        out.write(line)
        written += len(line.encode("utf-8"))
        doc += 1
EOF
bytes=$(stat -c %s "$work/input.jsonl")
docs=$(wc -l < "$work/input.jsonl")

for w in "${workers[@]}"; do
  start=$(date +%s.%N)
  "$tool" --input "$work/input.jsonl" --output-prefix "$work/out_w$w" --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$vocab" --merge-file "$merges" --append-eod --workers "$w" --log-interval 100000 2> "$work/log_w$w"
  end=$(date +%s.%N)
  tokens=$(( $(stat -c %s "$work/out_w${w}_text_document.bin") / 2 ))
  python3 -c "
import json, sys
secs = $end - $start
print(json.dumps({'bench': 'preprocess_throughput', 'tokenizer': 'GPT2BPETokenizer', 'workers': $w,
                  'input_bytes': $bytes, 'documents': $docs, 'tokens': $tokens, 'seconds': round(secs, 3),
                  'mb_per_s': round($bytes / secs / 2**20, 2), 'tokens_per_s': round($tokens / secs)}))"
done

#!/usr/bin/env bash
# DeepSeek-V3- and GPT-OSS-style models on the GPU machine, one call: the architecture GPU tests, our
# pretrain_gpt against bench/pytorch_arch_reference.py (plain PyTorch, eager and torch.compile) on the same
# shapes (tokens/s, peak memory), and short bf16 trainings on real text (Python docs + fortunes, GPT-2 BPE)
# whose loss must fall. JSON lines to $OUT/arch_bench.jsonl, a summary last.
#   here:            bench/arch_gpu.sh stage     (from a CUDA build in build/: binaries, libraries, corpus)
#   the GPU machine: bench/arch_gpu.sh run [tests] [bench] [train] [profile]
set -uo pipefail
cd "$(dirname "$0")/.."
D=.device/arch
if [[ ${1:-run} == stage ]]; then
  set -e
  rm -rf $D && mkdir -p $D/pkg/bin $D/pkg/lib $D/pkg/data
  cp build/bin/pretrain_gpt build/tests/gpu_tests $D/pkg/bin/
  strip $D/pkg/bin/*
  ldd build/bin/pretrain_gpt | awk '$3 ~ /^\// && $1 !~ /^(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt)\.|^libcu|^libnccl/ {print $3}' |
    xargs -r cp -L -t $D/pkg/lib/
  cp ../shared/gpu/env.sh bench/pytorch_arch_reference.py $D/pkg/
  TOK=tests/fixtures/megatron_data/tok-gpt2
  [[ -d /usr/share/doc/python3.11/html/_sources ]] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc
  jq -R -s -c 'split("\n%\n")[] | gsub("^\\s+|\\s+$"; "") | select(length > 0) | {text: .}' \
    /usr/share/games/fortunes/{fortunes,literature,people,riddles,science,wisdom,work,songs-poems,humorists,computers} \
    > /tmp/fortunes.jsonl
  find /usr/share/doc/python3.11/html/_sources -name '*.rst.txt' | sort |
    xargs -d '\n' -n 1 jq -R -s -c 'gsub("^\\s+|\\s+$"; "") | select(length > 0) | {text: .}' > /tmp/corpus.jsonl
  cat /tmp/fortunes.jsonl >> /tmp/corpus.jsonl
  ninja -C build preprocess_data >/dev/null
  build/bin/preprocess_data --input /tmp/corpus.jsonl --output-prefix $D/pkg/data/corpus \
    --tokenizer-type GPT2BPETokenizer --vocab-file $TOK/vocab.json --merge-file $TOK/merges.txt --append-eod \
    --workers 2 --log-interval 100000 >/dev/null
  cp $TOK/vocab.json $TOK/merges.txt $D/pkg/data/
  cp -r tests/fixtures/arch $D/pkg/arch_fixtures
  tar -C $D/pkg -cJf $D/pkg.tar.xz . && rm -rf $D/pkg
  du -sh $D
  exit 0
fi
shift || true
parts=${*:-tests bench train}
START=$(date +%s)
left() { echo $((570 - ($(date +%s) - START))); }
P=/tmp/archcuda
[[ -x $P/bin/pretrain_gpt ]] || { mkdir -p $P && tar -C $P -xJf $D/pkg.tar.xz; }
source $P/env.sh
export LD_LIBRARY_PATH=$P/lib:$LD_LIBRARY_PATH MEGATRON_BIN_DIR=$P/bin MEGATRON_FIXTURES=$PWD/tests/fixtures \
  MEGATRON_ARCH_FIXTURES=$P/arch_fixtures
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
J=$OUT/arch_bench.jsonl; : > $J
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# The same shapes as pytorch_arch_reference.py's presets.
DEEPSEEK="--num-layers 6 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --position-embedding-type rope --rope-type rope
  --multi-latent-attention --q-lora-rank 768 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --qk-layernorm
  --num-experts 64 --moe-layer-freq ([0]*1+[1]*5) --moe-ffn-hidden-size 1024 --moe-shared-expert-intermediate-size 1024
  --moe-router-topk 6 --moe-router-num-groups 8 --moe-router-group-topk 3 --moe-router-topk-scaling-factor 2.5
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type none
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm"
GPTOSS="--num-layers 6 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 --kv-channels 64
  --group-query-attention --num-query-groups 8 --normalization RMSNorm --norm-epsilon 1e-5
  --untie-embeddings-and-output-weights --position-embedding-type rope --rotary-base 150000
  --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
  --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
  --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880 --moe-router-load-balancing-type none
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm"
COMMON="--attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --device cuda --lr 1e-4 --eval-iters 0"

if [[ " $parts " == *" tests "* ]]; then
  echo "== architecture GPU tests"
  timeout 300 $P/bin/gpu_tests --gtest_filter=${ARCH_TEST_FILTER:-'*QuickGeglu*:*AttentionSinks*:*WindowAttention*:*ValueWidth*:CopyColumnsGpu.*:*MoeModelGpu*:MemoryPoolGpu.*:*GoldenGpu*:*CudaAttention*:*CudaRope*'} \
    2>&1 | tee $OUT/arch_gpu_tests.txt | grep -E "^\[  (PASSED|FAILED|SKIPPED)|FAILED|on cuda" | head -60
fi

if [[ " $parts " == *" bench "* ]]; then
  echo "== throughput ($(left) s left)"
  for m in ${ARCH_MODELS:-deepseek gptoss}; do
    F=$DEEPSEEK; [[ $m == gptoss ]] && F=$GPTOSS
    (cd /tmp && timeout 150 $P/bin/pretrain_gpt $F $COMMON --seq-length 4096 --max-position-embeddings 4096 \
      --micro-batch-size 1 --global-batch-size 1 --train-iters 12 --log-interval 1 --log-throughput \
      --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --make-vocab-size-divisible-by 128) \
      > $OUT/ours_$m.txt 2>&1
    python3 - $m $OUT/ours_$m.txt >> $J <<'PY'
import json, re, sys, statistics
m, path = sys.argv[1], sys.argv[2]
text = open(path).read()
tps = [float(x) for x in re.findall(r"tokens per second per GPU: ([0-9.]+)", text)]
mem = re.findall(r"max allocated: ([0-9.]+)", text)
if len(tps) < 6:
    print(json.dumps({"system": "megatron.cpp", "model": m, "error": text[-600:]}))
else:
    print(json.dumps({"system": "megatron.cpp", "model": m, "tokens_per_s": round(statistics.median(tps[4:])),
                      "peak_mem_MB": float(mem[-1]) if mem else None}))
PY
    tail -1 $J
    PYTHONUNBUFFERED=1 timeout 240 python3 $P/pytorch_arch_reference.py --preset $m-small --modes ${ARCH_TORCH_MODES:-compile} 2>&1 |
      tee -a $OUT/ref_$m.txt | grep '^{' >> $J
  done
fi

if [[ " $parts " == *" profile "* ]]; then  # where our step's time goes (--profile's op table)
  for m in ${ARCH_MODELS:-deepseek gptoss}; do
    F=$DEEPSEEK; [[ $m == gptoss ]] && F=$GPTOSS
    echo "== profile $m ($(left) s left)"
    (cd /tmp && timeout 150 $P/bin/pretrain_gpt $F $COMMON --seq-length 4096 --max-position-embeddings 4096 \
      --micro-batch-size 1 --global-batch-size 1 --train-iters 10 --log-interval 5 --profile --profile-step-start 6 \
      --profile-step-end 8 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
      --make-vocab-size-divisible-by 128) > $OUT/profile_$m.txt 2>&1
    sed -n '/> profile of rank/,/(iteration, wall)/p' $OUT/profile_$m.txt
  done
fi

if [[ " $parts " == *" train "* ]]; then
  echo "== bf16 training on real text ($(left) s left)"
  DATA="--data-path $P/data/corpus_text_document --split 100,0,0 --tokenizer-type GPT2BPETokenizer
    --vocab-file $P/data/vocab.json --merge-file $P/data/merges.txt"
  for m in ${ARCH_MODELS:-deepseek gptoss}; do
    F="$DEEPSEEK --mtp-num-layers 1"; [[ $m == gptoss ]] && F=$GPTOSS  # DeepSeek-V3 trains with one MTP depth
    # The same architecture at width 512, 4 layers: 400 iterations of 8 x 512 tokens.
    SMALL=$(echo $F | sed -E 's/--num-layers [0-9]+/--num-layers 4/; s/--hidden-size [0-9]+/--hidden-size 512/;
      s/--ffn-hidden-size [0-9]+/--ffn-hidden-size 1024/; s/--moe-ffn-hidden-size [0-9]+/--moe-ffn-hidden-size 256/;
      s/--num-attention-heads [0-9]+/--num-attention-heads 8/; s/--q-lora-rank [0-9]+/--q-lora-rank 192/;
      s/--kv-lora-rank [0-9]+/--kv-lora-rank 128/; s/--qk-head-dim [0-9]+/--qk-head-dim 64/;
      s/--qk-pos-emb-head-dim [0-9]+/--qk-pos-emb-head-dim 32/; s/--v-head-dim [0-9]+/--v-head-dim 64/;
      s/--moe-shared-expert-intermediate-size [0-9]+/--moe-shared-expert-intermediate-size 256/;
      s/\(\[0\]\*1\+\[1\]\*5\)/([0]*1+[1]*3)/; s/--num-query-groups [0-9]+/--num-query-groups 2/')
    (cd /tmp && timeout 120 $P/bin/pretrain_gpt $SMALL $COMMON $DATA --seq-length 512 --max-position-embeddings 512 \
      --micro-batch-size 8 --global-batch-size 8 --train-iters 400 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine \
      --lr-warmup-iters 40 --clip-grad 1.0 --log-interval 50) > $OUT/train_$m.txt 2>&1
    echo "$m rc=$?"
    grep -E "iteration +(50|200|400)/|error" $OUT/train_$m.txt | cut -c1-220
    python3 - $m $OUT/train_$m.txt >> $J <<'PY'
import json, re, sys
m, path = sys.argv[1], sys.argv[2]
text = open(path).read()
l = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]
mtp = [float(x) for x in re.findall(r"mtp_1 loss: ([0-9.E+-]+)", text)]
print(json.dumps({"bench": "arch_training", "model": m, "losses_every_50": l, "mtp_1_every_50": mtp,
                  "falls": len(l) >= 8 and l[-1] < l[0] - 1}))
PY
  done
fi
echo "== summary"
cat $J

#!/usr/bin/env bash
# A small Mixtral-style model (8 SwiGLU experts, top-2, aux and z losses, GQA, RoPE, RMSNorm) on real
# text — Debian's fortunes, as scripts/demo prepares them (GPT-2 BPE) — with the tokens each expert
# receives printed every log interval (--moe-per-layer-logging). Runs on the CPU by default.
# Usage: examples/mixtral/train_mixtral_tiny_fortunes.sh [more pretrain_gpt flags]
#   WORK=build/demo (where fortunes_text_document.{bin,idx} are: run scripts/demo once, or set it)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PRETRAIN=${PRETRAIN_GPT:-$ROOT/build/bin/pretrain_gpt}
WORK=${WORK:-$ROOT/build/demo}
TOK="$ROOT/tests/fixtures/megatron_data/tok-gpt2"
[ -f "$WORK/fortunes_text_document.bin" ] || { echo "no $WORK/fortunes_text_document.bin: run scripts/demo first (or set WORK)" >&2; exit 1; }
"$PRETRAIN" \
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4 \
  --group-query-attention --num-query-groups 2 --seq-length 128 --max-position-embeddings 128 \
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope \
  --untie-embeddings-and-output-weights \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 \
  --moe-token-dispatcher-type alltoall --moe-per-layer-logging \
  --micro-batch-size 8 --global-batch-size 8 --train-iters "${ITERS:-200}" \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 \
  --adam-beta2 0.95 --hidden-dropout 0.0 --attention-dropout 0.0 \
  --data-path "$WORK/fortunes_text_document" --split 98,2,0 --data-cache-path "$WORK/cache" \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$TOK/vocab.json" --merge-file "$TOK/merges.txt" \
  --log-interval 20 --eval-interval 100 --eval-iters 2 --device "${DEVICE:-cpu}" "$@"

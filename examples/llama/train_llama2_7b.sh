#!/usr/bin/env bash
# Llama-2 7B (32 layers, hidden 4096, 32 heads, SwiGLU ffn 11008, RMSNorm, RoPE, untied output) with
# Megatron's flags. Usage: examples/llama/train_llama2_7b.sh <data-prefix> <tokenizer.model> [checkpoint-dir]
set -euo pipefail
DATA=${1:?data prefix}
TOKENIZER=${2:?Llama-2 tokenizer.model}
CKPT=${3:-checkpoints/llama2_7b}
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}

"$PRETRAIN" \
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \
  --seq-length 4096 --max-position-embeddings 4096 \
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear \
  --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights \
  --micro-batch-size 1 --global-batch-size 1024 \
  --train-iters 250000 --lr 3.0e-4 --min-lr 3.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 \
  --data-path "$DATA" --split 99,1,0 \
  --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER" \
  --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save "$CKPT" --load "$CKPT" --save-interval 1000

#!/usr/bin/env bash
# Qwen3-30B-A3B (48 layers, hidden 2048, 32 heads / 4 query groups of 128 channels with per-head
# q/k RMSNorm, 128 SwiGLU experts of 768, top-8 renormalised, RoPE base 1e6, untied output) with the
# Megatron flags of Megatron-LM's examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh, on
# 2 nodes of 8 GPUs: EP 8, PP 2.
# Usage: examples/qwen3_moe/train_qwen3_30b_a3b.sh <checkpoint-dir> <hf-tokenizer-dir> <data-prefix>
# From the HF weights: build/bin/convert_checkpoint --from hf --load Qwen3-30B-A3B --save <checkpoint-dir>
# (Qwen's norm_topk_prob true is Megatron's default routing; a Qwen2-MoE / Qwen1.5-MoE model adds
# --moe-router-pre-softmax, --moe-shared-expert-intermediate-size and --moe-shared-expert-gate).
# Not yet in this build: --moe-grouped-gemm, and MoE layers on the GPU (they run with --device cpu).
set -euo pipefail
CKPT=${1:?checkpoint dir}
TOKENIZER=${2:?HF tokenizer folder}
DATA=${3:?data prefix}
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}

MODEL_ARGS=(
  --disable-bias-linear --untie-embeddings-and-output-weights
  --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32
  --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
  --seq-length 4096 --max-position-embeddings 40960
  --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=(
  --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-dtype fp32
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --moe-token-dispatcher-type alltoall
)
DATA_ARGS=(
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --make-vocab-size-divisible-by 1187
  --data-path "$DATA" --split 99990,8,2
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 256
  --lr 1e-4 --train-iters 100000 --lr-decay-style cosine --min-lr 1.0e-5 --lr-warmup-iters 500
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 8
  --use-distributed-optimizer --sequence-parallel
)
LOGGING_ARGS=(
  --log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
  --save "$CKPT" --load "$CKPT" --tensorboard-dir "$CKPT/tensorboard"
)

"$PRETRAIN" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"

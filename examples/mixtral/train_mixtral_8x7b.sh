#!/usr/bin/env bash
# Mixtral 8x7B (32 layers, hidden 4096, 32 heads / 8 query groups, 8 SwiGLU experts of 14336, top-2,
# RMSNorm, RoPE base 1e6, untied output) with the Megatron flags of Megatron-LM's
# examples/mixtral/train_mixtral_8x7b_distributed.sh, on 4 nodes of 8 GPUs: PP 4, EP 8.
# Usage (one process per GPU, e.g. under torchrun --no-python or srun):
#   examples/mixtral/train_mixtral_8x7b.sh <checkpoint-dir> <tokenizer.model> <data-prefix>
# From the HF weights: build/bin/convert_checkpoint --from hf --load Mixtral-8x7B-v0.1 --save <checkpoint-dir>
# (then --finetune, or keep --load). Not yet in this build: --moe-grouped-gemm (the experts run one
# after another, SequentialMLP), and MoE layers on the GPU (they run with --device cpu).
set -euo pipefail
CKPT=${1:?checkpoint dir}
TOKENIZER=${2:?Mixtral tokenizer.model}
DATA=${3:?data prefix}
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}

MODEL_ARGS=(
  --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0
  --normalization RMSNorm --position-embedding-type rope --swiglu
  --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
  --rotary-base 1000000
)
MOE_ARGS=(
  --num-experts 8 --moe-router-topk 2
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type alltoall
  --overlap-param-gather --overlap-grad-reduce
)
DATA_ARGS=(
  --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER"
  --data-path "$DATA" --split 99990,8,2
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 256
  --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5
  --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
  --use-distributed-optimizer --sequence-parallel
)
LOGGING_ARGS=(
  --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
  --save "$CKPT" --load "$CKPT" --tensorboard-dir "$CKPT/tensorboard" --no-load-optim --no-load-rng
)

"$PRETRAIN" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"

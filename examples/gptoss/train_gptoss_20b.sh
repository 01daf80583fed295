#!/usr/bin/env bash
# GPT-OSS-20B (24 layers, hidden 2880, 64 heads / 8 query groups of 64 channels, 32 experts of 2880
# with top-4, RMSNorm, YaRN (factor 32 over 4096 positions, base 150000, truncate false), attention
# sinks, a 128-token sliding window on every other layer, the clamped SwiGLU experts with biases)
# with the Megatron flags of Megatron-LM's examples/gptoss/02_train.sh (--quick-geglu
# --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --softmax-type learnable --window-size 127,0
# --window-attn-skip-freq 2), at the shape of the HF checkpoint, on 2 nodes of 8 GPUs: EP 8, PP 2.
# Usage (one process per GPU, e.g. under torchrun --no-python or srun):
#   examples/gptoss/train_gptoss_20b.sh <checkpoint-dir> <tokenizer-dir> <data-prefix>
# From the HF weights (bf16; HF's MXFP4 expert weights must be dequantised first):
#   build/bin/convert_checkpoint --from hf --load gpt-oss-20b --save <checkpoint-dir>
# Not yet in this build: sinks with --cp-comm-type a2a / a2a+p2p (refused at start; p2p and all_gather work).
set -euo pipefail
CKPT=${1:?checkpoint dir}
TOKENIZER=${2:?HF tokenizer folder (tokenizer.json)}
DATA=${3:?data prefix}
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}

MODEL_ARGS=(
  --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 --kv-channels 64
  --group-query-attention --num-query-groups 8
  --seq-length 4096 --max-position-embeddings 131072
  --normalization RMSNorm --norm-epsilon 1e-5 --untie-embeddings-and-output-weights
  --position-embedding-type yarn --rotary-base 150000 --rotary-scaling-factor 32
  --yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32 --yarn-beta-slow 1
  --no-yarn-correction-range-round-to-int
  --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
  --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
MOE_ARGS=(
  --num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 2880
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-z-loss-coeff 1e-3
  --moe-router-dtype fp32 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-permute-fusion
  --overlap-param-gather --overlap-grad-reduce
)
DATA_ARGS=(
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --data-path "$DATA" --split 99,1,0
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 128
  --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-fraction 0.05 --train-iters 100000
  --weight-decay 0.1 --clip-grad 1.0 --bf16 --recompute-activations
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 8
  --context-parallel-size 1 --use-distributed-optimizer --sequence-parallel
)
LOGGING_ARGS=(
  --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
  --save "$CKPT" --load "$CKPT" --tensorboard-dir "$CKPT/tensorboard" --no-load-optim --no-load-rng
)

"$PRETRAIN" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"

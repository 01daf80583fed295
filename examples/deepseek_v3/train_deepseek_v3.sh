#!/usr/bin/env bash
# DeepSeek-V3 (671B: 61 layers, hidden 7168, 128 heads of multi-latent attention — q_lora_rank 1536,
# kv_lora_rank 512, 128 + 64 query/key channels, 128 value channels —, YaRN x40, 3 dense layers then
# 58 MoE layers of 256 experts, top-8 in 4 of 8 groups by sigmoid scores with the expert bias,
# scaled by 2.5, one shared expert) with the Megatron flags of Megatron-LM's DeepSeek-V3 scripts
# (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, post_training/.../DeepSeek-R1.sh).
# Usage (one process per GPU, e.g. under srun or torchrun --no-python):
#   examples/deepseek_v3/train_deepseek_v3.sh <checkpoint-dir> <tokenizer-dir> <data-prefix>
# From the HF weights: build/bin/convert_checkpoint --from hf --load DeepSeek-V3 --save <checkpoint-dir>
# (the multi-token-prediction layers of the HF checkpoint are not read).
# Differences from Megatron's scripts: --moe-router-pre-softmax is left out (it only applies to softmax
# scores; Megatron ignores it with sigmoid, megatron.cpp refuses the combination), and the
# multi-token-prediction flags are not given. --rope-type is absent: MLA takes YaRN by default, as Megatron.
set -euo pipefail
CKPT=${1:?checkpoint dir}
TOKENIZER=${2:?DeepSeek-V3 tokenizer dir}
DATA=${3:?data prefix}
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}

MODEL_ARGS=(
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
  --seq-length 4096 --max-position-embeddings 163840
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006
  --position-embedding-type rope --rotary-base 10000 --rotary-percent 1.0
  --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
  --v-head-dim 128 --qk-layernorm
  --make-vocab-size-divisible-by 3232
)
MOE_ARGS=(
  --num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048
  --moe-shared-expert-intermediate-size 2048
  --moe-router-topk 8 --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
  --moe-router-dtype fp32 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion
)
DATA_ARGS=(
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
  --data-path "$DATA" --split 99,1,0
)
TRAINING_ARGS=(
  --micro-batch-size 1 --global-batch-size 8192
  --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --lr-warmup-init 3.9e-7
  --lr-warmup-samples 1536000 --lr-decay-samples 584765624 --train-samples 585937500
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16
  --recompute-granularity selective
)
MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 16 --expert-model-parallel-size 64
  --expert-tensor-parallel-size 1 --sequence-parallel
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
LOGGING_ARGS=(
  --log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
  --save "$CKPT" --load "$CKPT" --tensorboard-dir "$CKPT/tensorboard"
)

"$PRETRAIN" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
  "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"

#!/usr/bin/env bash
# GPT-3 125M (12 layers, hidden 768, 12 heads, seq 2048) on a preprocessed corpus, with Megatron's
# flags — the same script runs Megatron-LM with `python pretrain_gpt.py` in place of pretrain_gpt.
# Usage: examples/gpt3/train_gpt3_125m.sh <data-prefix> <vocab.json> <merges.txt> [checkpoint-dir]
set -euo pipefail
DATA=${1:?data prefix (e.g. my-corpus_text_document)}
VOCAB=${2:?GPT-2 vocab.json}
MERGES=${3:?GPT-2 merges.txt}
CKPT=${4:-checkpoints/gpt3_125m}
PRETRAIN=${PRETRAIN_GPT:-$(dirname "$0")/../../build/bin/pretrain_gpt}

"$PRETRAIN" \
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
  --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 4 --global-batch-size 256 \
  --train-iters 500000 --lr 6.0e-4 --min-lr 6.0e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --bf16 \
  --data-path "$DATA" --split 949,50,1 \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --log-interval 100 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --save "$CKPT" --load "$CKPT" --save-interval 5000 \
  --tensorboard-dir "$CKPT/tensorboard"

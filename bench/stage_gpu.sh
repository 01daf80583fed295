#!/usr/bin/env bash
# Builds the CUDA configuration (sm_90a, CUDA ops on) and stages what a run on the GPU machine needs in
# .device/ (git-ignored): the binaries, the GPU environment script and the PyTorch reference.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-gpu -G Ninja -DMEGATRON_CUDA=ON -DMEGATRON_CUDA_OPS=ON >/dev/null
ninja -C build-gpu gpu_tests golden_tests pretrain_gpt bench_gpt_throughput text_generation_server generate \
  convert_checkpoint
mkdir -p .device/bin
cp build-gpu/tests/gpu_tests build-gpu/tests/golden_tests build-gpu/bin/pretrain_gpt build-gpu/bench/gpt_throughput \
   build-gpu/bin/text_generation_server build-gpu/bin/generate build-gpu/bin/convert_checkpoint .device/bin/
# Debian's libsentencepiece travels with the binaries: the C++ class layout of another version's
# library (e.g. Ubuntu's) differs from the headers we built against.
mkdir -p .device/lib
cp -L "$(ldd build-gpu/bin/pretrain_gpt | awk '/libsentencepiece/ {print $3}')" .device/lib/
cp ../shared/gpu/env.sh ../shared/bench/pytorch_gpt_reference.py .device/ 2>/dev/null || true
du -sh .device

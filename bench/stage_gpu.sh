#!/usr/bin/env bash
# Builds the CUDA configuration (sm_90a, CUDA ops on) and stages what a run on the GPU machine needs in
# .device/ (git-ignored): the binaries, the GPU environment script and the PyTorch reference.
set -euo pipefail
cd "$(dirname "$0")/.."
# GPU_BUILD_DIR: another build folder of the same configuration (scripts/test's build/ is one when nvcc is
# present: CUDA sources and ops on, Release).
BD=${GPU_BUILD_DIR:-build-gpu}
cmake -S . -B "$BD" -G Ninja -DMEGATRON_CUDA=ON -DMEGATRON_CUDA_OPS=ON >/dev/null
ninja -C "$BD" gpu_tests golden_tests pretrain_gpt bench_gpt_throughput bench_op_timing bench_comm_bandwidth bench_gemm_algos text_generation_server generate \
  convert_checkpoint
mkdir -p .device/bin
cp "$BD"/tests/gpu_tests "$BD"/tests/golden_tests "$BD"/bin/pretrain_gpt "$BD"/bench/gpt_throughput \
   "$BD"/bench/op_timing "$BD"/bench/comm_bandwidth "$BD"/bench/gemm_algos \
   "$BD"/bin/text_generation_server "$BD"/bin/generate "$BD"/bin/convert_checkpoint .device/bin/
# Debian's libsentencepiece travels with the binaries: the C++ class layout of another version's
# library (e.g. Ubuntu's) differs from the headers we built against.
strip .device/bin/*  # the symbols are not needed there, and the working tree travels
mkdir -p .device/lib
cp -L "$(ldd "$BD"/bin/pretrain_gpt | awk '/libsentencepiece/ {print $3}')" .device/lib/
# OpenMPI's libraries travel too (the GPU machine may have no OpenMPI): the binaries link libmpi,
# but a single-process run never calls MPI_Init, so the libraries alone let them start.
ldd "$BD"/bin/pretrain_gpt | awk '/libmpi|libopen-(rte|pal)|libpmix|libhwloc|libevent/ {print $3}' |
  xargs -r cp -L -t .device/lib/
cp ../shared/gpu/env.sh ../shared/bench/pytorch_gpt_reference.py .device/ 2>/dev/null || true
cp bench/pytorch_reference.py .device/  # GPT presets as pytorch_gpt_reference.py, plus llama-1B
du -sh .device

#!/usr/bin/env bash
# H200 benchmark of the fused kernels; needs only jax with CUDA (no project install). ~8 minutes.
#   bash benchmarks/gpu_kernels.sh 2>&1 | tee benchmarks/results/gpu_kernels_h200.txt
# First a compiled-Triton correctness check (small bf16 problem vs "reference"); then the
# Triton block-size sweep per shape (T in {4096, 16384}, D=4096, V=151,936), whose best
# configs go to pallas_kernels/tuned/triton_<device>.json (commit it); then "triton" (tuned
# table) vs "xla" vs "reference": median ms, TFLOP/s, % of the measured bf16 GEMM rate,
# peak device memory. Extra arguments go to gpu_kernels.py (e.g. --no-sweep).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
date -u
git rev-parse --short HEAD 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 benchmarks/gpu_kernels.py --check
python3 benchmarks/gpu_kernels.py "$@"

#!/usr/bin/env bash
# One lent GPU, one call: the accelerator-path checks, where a step makes the host wait, and the GPU benchmarks.
# Run from the repository root on the device machine (its python3 has torch); logs and JSON go to $OUT (or ./gpu-out).
#   bash benchmarks/gpu_session.sh            # everything (about 5 minutes on an H200)
#   bash benchmarks/gpu_session.sh checks     # tests/cuda_check.py and the host waits only
#   bash benchmarks/gpu_session.sh main       # the checks, then the ~1B model (AC off and on) and 4 compiled blocks
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
WHAT=${1:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
# One rank: NCCL refuses two ranks on one GPU, and gloo with CUDA tensors crashed (SIGSEGV) at 2 and 4 ranks on an H200.
timeout 300 python3 -m tests.cuda_check --ws 1 --timeout 90 --host-syncs --json "$OUT/cuda_check.json" 2>&1 \
  | tee "$OUT/cuda_check.log" | grep -v "^  File\|^    \|^\[rank"
[ "$WHAT" = checks ] && exit 0
if [ "$WHAT" != main ]; then
timeout 200 python3 benchmarks/gpu.py --offload --layers 6 --ac off --steps 4 --warmup 2 --json "$OUT/gpu_offload.json" \
  2>&1 | tee "$OUT/gpu_offload.log" | tail -5
[ "$WHAT" = offload ] && exit 0
timeout 90 python3 benchmarks/gpu.py --tiny --steps 30 --warmup 5 --json "$OUT/gpu_tiny.json" 2>&1 | tee "$OUT/gpu_tiny.log" | tail -6
fi
timeout 240 python3 benchmarks/gpu.py --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log" | tail -8
timeout 240 python3 benchmarks/gpu.py --compile --layers 4 --ac off --steps 5 --warmup 3 --json "$OUT/gpu_compile.json" \
  2>&1 | tee "$OUT/gpu_compile.log" | tail -5

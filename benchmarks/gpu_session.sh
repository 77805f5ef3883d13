#!/usr/bin/env bash
# One lent GPU, one call: the accelerator-path checks, where a step makes the host wait, and the GPU benchmarks.
# Run from the repository root on the device machine (its python3 has torch); logs and JSON go to $OUT (or ./gpu-out).
#   bash benchmarks/gpu_session.sh            # everything (about 4 minutes on an H200)
#   bash benchmarks/gpu_session.sh checks     # tests/cuda_check.py and the host waits only
#   bash benchmarks/gpu_session.sh main       # everything but CPU offload
# Several ranks on one GPU: NCCL refuses two ranks on one device and gloo with CUDA tensors crashed (SIGSEGV) at 2
# and 4 ranks on an H200, so the cases train at one rank, and the multi-rank path (sharded peaks, reductions in
# flight, the agreement's read, HSDP) runs as rank 0 of a larger world under torch's fake process group.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
WHAT=${1:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LOG="$OUT/gpu.log"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$LOG"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  | tee -a "$LOG"
SECONDS=0
timeout 300 python3 -m tests.cuda_check --ws 1 --timeout 120 --host-syncs --fake-mesh 4 --fake-mesh 2x2 \
  --json "$OUT/cuda_check.json" 2>&1 | tee "$OUT/cuda_check.log" | grep -v "^  File\|^    \|^\[rank"
echo "cuda_check: ${SECONDS}s" | tee -a "$LOG"
[ "$WHAT" = checks ] && exit 0
bench() {  # one benchmarks/gpu.py run, its table appended to gpu.log
  local limit=$1; shift
  SECONDS=0
  echo "## gpu.py $*" | tee -a "$LOG"
  timeout "$limit" python3 benchmarks/gpu.py "$@" 2>&1 | grep -v "^  File\|^    " | tail -8 | tee -a "$LOG"
  echo "(${SECONDS}s)" | tee -a "$LOG"
}
bench 240                                                  # ~1B, one rank, AC off and on
bench 150 --fake-ws 8 --ac off --steps 6 --warmup 2         # rank 0 of 8: the sharded peak
bench 150 --fake-ws 8 --replicate 2 --ac off --steps 6 --warmup 2   # rank 0 of 2 x 4 (HSDP)
bench 90 --tiny --steps 30 --warmup 5                       # host-bound, one rank
bench 90 --tiny --fake-ws 4 --steps 30 --warmup 5           # host-bound, rank 0 of 4
bench 200 --compile --layers 4 --ac off --steps 5 --warmup 3
for ac in on off; do  # who holds the bytes at the peak, rank 0 of 8
  timeout 120 python3 benchmarks/gpu_peak.py --fake-ws 8 --ac $ac 2>&1 | tail -20 | tee -a "$LOG"
done
[ "$WHAT" = main ] && exit 0
bench 200 --offload --layers 6 --ac off --steps 4 --warmup 2

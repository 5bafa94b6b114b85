#!/usr/bin/env bash
# One device call, prepared ahead: the GPU check's sections in order of priority, each in its
# own process under its own time limit, so one that hangs cannot eat the others' time.
# Everything it prints goes to $OUT/log.txt; each section's figures to $OUT/<name>.json.
#   run (from the repo root, on the device machine):  bash benchmarks/gpu_session.sh [quick]
# SMALL=1 runs the same on a CPU with tiny shapes (a dry run); ITS sets the run's iterations.
# Needs the wheels the device image lacks in .whl/ (benchmarks/README or docs/gpu.md).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, pydantic; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'pydantic', pydantic.__version__)"
ITS=${ITS:-20}
T0=$(date +%s)

section() {  # name limit_s command...
  local name=$1 limit=$2
  shift 2
  echo "### $name start +$(( $(date +%s) - T0 )) s (limit $limit s)"
  timeout --kill-after=5 "$limit" "$@"
  echo "### $name rc=$? +$(( $(date +%s) - T0 )) s"
}
check() {  # name limit_s sections [extra args]
  local name=$1 limit=$2 only=$3
  shift 3
  section "$name" "$limit" python3 benchmarks/gpu_check.py --only "$only" \
    --json "$OUT/$name.json" ${SMALL:+--small} "$@"
}

# 1. issue 31 item 6: the multi-agent run, sync vs async, on one GPU (was 1.57)
check run 110 run --iterations "$ITS" --run-dir /tmp/runs/plain
# 1b. the same with the MPS daemon, so the pools' processes share the GPU at once instead of
# taking turns by time slices
if command -v nvidia-cuda-mps-control > /dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    check run_mps 80 run --iterations "$ITS" --run-dir /tmp/runs/mps
    echo quit | nvidia-cuda-mps-control
    sleep 1
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
else
  echo "### run_mps skipped: no nvidia-cuda-mps-control"
fi
tar czf "$OUT/runs.tar.gz" -C /tmp --exclude=checkpoints --exclude=samples.jsonl runs 2> /dev/null
[ "${1:-}" = quick ] && exit 0
# 2. the engine against generate: long-tailed requests, then a 1.1B Llama shape at batch 64/256
check engine 130 rollout,llama
# 3. issue 31's table on the device: the systems as real runs, the simulator beside them
DEV=cuda; [ -n "${SMALL:-}" ] && DEV=cpu
section compare 130 python3 -m flexmarl.cli.main bench compare examples/relay_chain.yaml \
  --systems flexmarl,flexmarl-sync,sync-disaggregated,marti --iterations "${CMP_ITS:-8}" \
  --rounds 1 --set runtime.devices=$DEV --out /tmp/compare
tar czf "$OUT/compare.tar.gz" -C /tmp --exclude=checkpoints --exclude=samples.jsonl compare 2> /dev/null
# 4. training: trainer vs plain loop, K=1 FSDP, swaps and publication, log-prob agreement
check train 90 training,fsdp,transfers,logprob
# 5. the engine benchmark's cases (a) and (b), if time is left
check cases 30 cases
echo "### done +$(( $(date +%s) - T0 )) s"

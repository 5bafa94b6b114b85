#!/usr/bin/env bash
# One device call, prepared ahead: the GPU check's sections in order of priority, each in its
# own process under its own time limit, so one that hangs cannot eat the others' time.
# Everything it prints goes to $OUT/log.txt; each section's figures to $OUT/gpu_check.json
# under the section's name (the device returns at most 8 files).
#   run (from the repo root, on the device machine):  bash benchmarks/gpu_session.sh
# SECTIONS picks and orders them (default: fsdp llama compare train split run mps engine cases);
# BUDGET_S (default 420) stops starting new ones after that many seconds: compare (260 s) starts
# third, by 210 s, and the later sections' limits are at most 110 s, so a call ends inside the
# device's 600 s per command.
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
    --json "$OUT/gpu_check.json" --key "$name" ${SMALL:+--small} "$@"
}

run_sync_async() {
  # issue 31 item 6: the multi-agent run, sync vs async, on one GPU (H200 12-04: 1.57; H100
  # 12-06: 0.669)
  check run 110 run --iterations "$ITS" --run-dir /tmp/runs/plain
}
run_mps() {
  # the same under the MPS daemon, so the pools' processes share the GPU at once instead of
  # taking turns by time slices (12-06: async 0.505 -> 0.413 s/iteration)
  if ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "### mps skipped: no nvidia-cuda-mps-control"
    return
  fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    check run_mps 80 run --iterations "$ITS" --run-dir /tmp/runs/mps
    echo quit | nvidia-cuda-mps-control
    sleep 1
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
run_compare() {
  # issue 31's table on the device: the systems as real runs, the simulator beside them (the
  # profile alone took 76 s on 12-06; it now also times real sync and async runs of the config)
  local dev=cuda
  [ -n "${SMALL:-}" ] && dev=cpu
  section compare 260 python3 -m flexmarl.cli.main bench compare examples/relay_chain.yaml \
    --systems flexmarl,flexmarl-sync,sync-disaggregated,marti --iterations "${CMP_ITS:-6}" \
    --rounds 1 --set runtime.devices=$dev --out /tmp/compare
  tar czf "$OUT/compare.tar.gz" -C /tmp --exclude=checkpoints --exclude=samples.jsonl \
    compare 2> /dev/null
}

# The order is the priority: what has never run on a GPU first. 12-06 measured run, mps,
# engine (rollout), training, cases; it did not reach llama, fsdp failed (mended since) and
# compare was cut after two systems.
for s in ${SECTIONS:-fsdp llama compare train split run mps engine cases}; do
  case $s in
    fsdp) check fsdp 60 fsdp ;;  # the K=1 NCCL trainer against the one-device trainer
    llama) check llama 150 llama ;;  # 1.1B, eager against CUDA-graph decode, vs generate
    compare) run_compare ;;
    train) check train 80 training,transfers,logprob ;;
    split) check split 60 split ;;  # the GPU default of model.split_call_tokens (unmeasured)
    run) run_sync_async ;;
    mps) run_mps ;;
    engine) check engine 110 rollout ;;  # long-tailed requests, engine against generate
    cases) check cases 30 cases ;;  # the engine benchmark's cases (a) and (b)
    *) echo "### unknown section $s" ;;
  esac
  [ -d /tmp/runs ] && tar czf "$OUT/runs.tar.gz" -C /tmp --exclude=checkpoints \
    --exclude=samples.jsonl runs 2> /dev/null
  [ $(( $(date +%s) - T0 )) -gt "${BUDGET_S:-420}" ] && { echo "### budget spent"; break; }
done
echo "### done +$(( $(date +%s) - T0 )) s"

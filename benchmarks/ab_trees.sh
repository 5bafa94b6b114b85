#!/usr/bin/env bash
# One benchmark command run alternately on two source trees (before / after a change), so that
# both see the same load: `benchmarks/ab_trees.sh BEFORE AFTER ROUNDS PYTHON ARGS...` runs
# `PYTHON ARGS...` in each tree (its flexmarl first on the path: PYTHONPATH=TREE), ROUNDS
# times, before first in even rounds and after first in odd ones, each run's output under a
# `== <label> round <r> ==` line with the load average. Compare the same script's
# alternating runs, not figures taken at different times on a shared machine.
set -euo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); rounds=$3; shift 3
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then order=("before:$before" "after:$after"); else
    order=("after:$after" "before:$before"); fi
  for item in "${order[@]}"; do
    label=${item%%:*}; tree=${item#*:}
    echo "== $label round $r ($(git -C "$tree" rev-parse --short HEAD), load $(cut -d' ' -f1-3 /proc/loadavg)) =="
    (cd "$tree" && PYTHONPATH="$tree" "$@")
  done
done

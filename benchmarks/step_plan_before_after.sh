#!/usr/bin/env bash
# Step time before/after a change, in the same run: benchmarks/profile_step.py at 1 row (real
# forward) and at 256 rows (stubbed forward: the engine's own per-step work), each shape run
# before, after, before, after, before, after under one CPU lock (other jobs wait, so the series
# is quiet), the lock released between shapes. Prints the medians of 3 and after/before, of the
# step and of the engine overhead (the step less the forward: at 256 rows the stubbed forward is a
# 50 MB copy of logits whose time swings with memory bandwidth, the same code on both sides).
#
#   BEFORE=/work/wt-before benchmarks/step_plan_before_after.sh [results file]
#
# BEFORE: a checkout of the earlier commit (git worktree add ... <commit> --detach).
# AFTER: a checkout of the later commit (default: this script's repository).
# PAIRS: before/after pairs a shape (default 3).
# LOCK: the lock file shared with other CPU jobs (default /tmp/pagedllm-cpu.lock).
# Each checkout runs its own benchmarks/profile_step.py with PYTHONPATH at its root.
set -euo pipefail

: "${BEFORE:?set BEFORE=<path of the earlier checkout>}"
AFTER=${AFTER:-$(cd "$(dirname "$0")/.." && pwd)}
LOCK=${LOCK:-/tmp/pagedllm-cpu.lock}
PAIRS=${PAIRS:-3}
OUT=${1:-/dev/stdout}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

SHAPES=(
  "1 row|--batch-size 1 --input-len 32 --context 64 --steps 200 --no-profiler"
  "256 rows|--batch-size 256 --input-len 990 --context 1000 --no-forward --steps 20 --no-profiler"
)

run_one() {  # run_one <checkout> <args...>: the last JSON line of profile_step
  local dir=$1; shift
  (cd "$dir" && PYTHONPATH=$dir python -m benchmarks.profile_step "$@" | tail -n 1)
}

commit_of() { git -C "$1" log -1 --format='%h %s' | cut -c1-100; }

{
  echo "# step time before/after ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p')" \
       "(family $(sed -n 's/^cpu family\t*: //p;T;q' /proc/cpuinfo)," \
       "model $(sed -n 's/^model\t*: //p;T;q' /proc/cpuinfo)), $(nproc) cores," \
       "$(grep -q avx512f /proc/cpuinfo && echo AVX-512 || echo 'no AVX-512')"
  echo "python: $(python -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
  echo "before: $BEFORE ($(commit_of "$BEFORE"))"
  echo "after:  $AFTER ($(commit_of "$AFTER"))"
} > "$OUT"

# Build or load each checkout's C kernels once, outside the timed series.
for dir in "$BEFORE" "$AFTER"; do
  flock "$LOCK" bash -c "set -eo pipefail; $(declare -f run_one); run_one '$dir' --batch-size 1 --input-len 8 --context 10 --steps 2 --no-profiler" > /dev/null
done

for shape in "${SHAPES[@]}"; do
  name=${shape%%|*}; args=${shape#*|}
  # shellcheck disable=SC2086
  series=$(flock "$LOCK" bash -c "set -eo pipefail; $(declare -f run_one)
    for i in \$(seq $PAIRS); do
      for side in before after; do
        dir=\$([ \$side = before ] && echo '$BEFORE' || echo '$AFTER')
        r=\$(run_one \"\$dir\" $args)
        echo \"\$side \$r\"
      done
    done")
  SERIES=$series NAME=$name ARGS=$args python - >> "$OUT" <<'EOF'
import json, os, statistics
runs = {"before": [], "after": []}
for line in os.environ["SERIES"].splitlines():
    side, _, js = line.partition(" ")
    runs[side].append(json.loads(js))
print(f"\n## {os.environ['NAME']}: profile_step {os.environ['ARGS']}")
med = {}
for side, rs in runs.items():
    steps, over = [r["step_ms"] for r in rs], [r["overhead_ms"] for r in rs]
    med[side] = statistics.median(steps), statistics.median(over)
    print(f"{side:6} step_ms {steps} median {med[side][0]:.2f}"
          f" | overhead_ms {over} median {med[side][1]:.2f}"
          f" | forward_ms {[r['model_forward_ms'] for r in rs]}")
print(f"after/before (median step_ms): {med['after'][0] / med['before'][0]:.3f},"
      f" (median overhead_ms): {med['after'][1] / med['before'][1]:.3f}")
EOF
done

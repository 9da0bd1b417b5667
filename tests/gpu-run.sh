#!/usr/bin/env bash
# Everything for one device call, after `../shared/gpu/pack` (carry .gpu):
#   the suite (two GPUs required when present), the command's outputs, the bench, then the suite
#   under compute-sanitizer. Logs land in $OUT/logs.tgz; command outputs in $OUT directly.
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/l1 /tmp/l2
export CUMEMPOOL_REQUIRE_GPU=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ "$gpus" -ge 2 ] && export CUMEMPOOL_REQUIRE_TWO_GPUS=1
OUT=/tmp/l1 bash .gpu/run.sh > /tmp/l1/suite.txt 2>&1; echo "suite rc=$?"
grep -E '^[a-z_]+: rc=|gpu suite' /tmp/l1/suite.txt
B=.gpu/bin/bin--cumempool
$B routes > "$OUT/routes.txt" 2>&1; echo "routes rc=$?"
$B routes --json > "$OUT/routes.json" 2>&1
$B doctor > "$OUT/doctor.txt" 2>&1; echo "doctor rc=$?"
if [ "${BENCH:-1}" = 1 ]; then timeout 300 $B bench --json-out "$OUT/bench.json" > "$OUT/bench.txt" 2>"$OUT/bench.err"; echo "bench rc=$?"; cat "$OUT/bench.txt"; fi
if [ "${SANITIZE_RUN:-1}" = 1 ]; then
  # The negative tests provoke driver refusals on purpose; compute-sanitizer would count each as
  # an "API error". Memory errors and leaks are what must be zero, so API errors are not reported.
  ( cd .gpu/bin && for b in test--*; do
      short=${b#test--}; short=${short%%--*}
      timeout "${SANITIZE_LIMIT:-90}" compute-sanitizer --tool memcheck --leak-check full --report-api-errors no \
        --target-processes all --error-exitcode 9 ./"$b" --include-ignored --test-threads=1 > /tmp/l2/$b.log 2>&1
      echo "$short: rc=$? $(grep -E "^test result:" /tmp/l2/$b.log | tail -1) | $(grep -h "ERROR SUMMARY" /tmp/l2/$b.log | tr '\n' ' ')"
    done ) | tee /tmp/l2/suite.txt
  echo "sanitizer summaries: $(grep -h 'ERROR SUMMARY' /tmp/l2/*.log | sort | uniq -c | tr '\n' ' ')"
fi
tar czf "$OUT/logs.tgz" -C /tmp l1 l2

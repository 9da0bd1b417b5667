#!/usr/bin/env bash
# Everything for one device call, after `../shared/gpu/pack` (carry .gpu):
#   the suite (two GPUs required when present), the command's outputs, the bench, then the suite
#   under compute-sanitizer. Logs land in $OUT/logs.tgz; command outputs in $OUT directly.
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/l1 /tmp/l2
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ "$gpus" -ge 2 ] && export CUMEMPOOL_REQUIRE_TWO_GPUS=1
OUT=/tmp/l1 bash .gpu/run.sh > /tmp/l1/suite.txt 2>&1; echo "suite rc=$?"
grep -E '^[a-z_]+: rc=|gpu suite' /tmp/l1/suite.txt
B=.gpu/bin/bin--cumempool
$B routes > "$OUT/routes.txt" 2>&1; echo "routes rc=$?"
$B routes --json > "$OUT/routes.json" 2>&1
$B doctor > "$OUT/doctor.txt" 2>&1; echo "doctor rc=$?"
if [ "${BENCH:-1}" = 1 ]; then timeout 240 $B bench --json > "$OUT/bench.json" 2>"$OUT/bench.err"; echo "bench rc=$?"; fi
if [ "${SANITIZE_RUN:-1}" = 1 ]; then
  OUT=/tmp/l2 SANITIZE=1 timeout "${SANITIZE_LIMIT:-330}" bash .gpu/run.sh > /tmp/l2/suite.txt 2>&1; echo "sanitize rc=$?"
  grep -E '^[a-z_]+: rc=|gpu suite' /tmp/l2/suite.txt
  grep -h 'ERROR SUMMARY' /tmp/l2/*.log | sort | uniq -c
fi
tar czf "$OUT/logs.tgz" -C /tmp l1 l2

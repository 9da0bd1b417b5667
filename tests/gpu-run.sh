#!/usr/bin/env bash
# Everything for one session on a GPU host, after `cargo xtask gpu-pack` (copy .gpu along): the
# suite (two GPUs required when present), the command's outputs, the bench, then the suite under
# compute-sanitizer. Command outputs land in $OUT (default .gpu/results); every log in
# $OUT/logs.tgz.
#   BENCH=0          skip the benches        SANITIZE_RUN=0     skip the sanitizer pass
#   WORKLOADS=0      skip the workload bench (bench/workloads.py: about 5 minutes, needs torch/CuPy)
#   PROBES=0         skip the driver probes of tests/probes (they need nvcc)
#   SANITIZE_LIMIT=S stop a sanitized test binary after S seconds (default 1200: the GPU suite's
#                    tests are one binary, run one test at a time under the sanitizer)
#   PACK=DIR         the pack, if not .gpu
cd "$(dirname "$0")/.." || exit 2
pack=${PACK:-.gpu}
[ -x "$pack/run.sh" ] || { echo "no GPU pack at $pack: run \`cargo xtask gpu-pack\` first" >&2; exit 2; }
OUT=${OUT:-$pack/results}
logs=$(mktemp -d)
mkdir -p "$OUT" "$logs/suite" "$logs/sanitizer"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ "$gpus" -ge 2 ] && export CUMEMPOOL_REQUIRE_TWO_GPUS=1
OUT=$logs/suite bash "$pack/run.sh" > "$logs/suite.txt" 2>&1; echo "suite rc=$?"
grep -E '^[a-z_-]+: rc=|gpu suite' "$logs/suite.txt"
cli=$pack/bin/bin--cumempool
$cli routes > "$OUT/routes.txt" 2>&1; echo "routes rc=$?"
$cli routes --json > "$OUT/routes.json" 2>&1
$cli doctor > "$OUT/doctor.txt" 2>&1; echo "doctor rc=$?"
if [ "${BENCH:-1}" = 1 ]; then
  timeout 300 $cli bench --threads 1,16 --json-out "$OUT/bench.json" > "$OUT/bench.txt" 2>"$OUT/bench.err"; echo "bench rc=$?"
  cat "$OUT/bench.txt"
  # The Python allocators, one run: the wheel run.sh installed into $pack/py.
  if [ -d "$pack/py" ]; then
    PYTHONPATH="$pack/py" timeout 300 python3 crates/cumempool-py/bench/alloc_pair.py > "$OUT/python-bench.txt" 2>&1
    echo "python bench rc=$?"; cat "$OUT/python-bench.txt"
    # Real workloads on every allocator: a fresh process per configuration and round (progress
    # and each failure's details in workloads.err).
    if [ "${WORKLOADS:-1}" = 1 ]; then
      PYTHONPATH="$pack/py" timeout 480 python3 crates/cumempool-py/bench/workloads.py \
        --json-out "$OUT/workloads.json" > "$OUT/workloads.txt" 2> "$OUT/workloads.err"
      echo "workloads rc=$?"; cat "$OUT/workloads.txt"
    fi
  fi
fi
if [ "${PROBES:-1}" = 1 ] && command -v nvcc >/dev/null; then
  # What the driver itself does, as docs/driver-behaviour.md quotes it.
  probes=$(mktemp -d)
  {
    for probe in capture reserve teardown; do
      nvcc -O2 "tests/probes/$probe.c" -o "$probes/$probe" -lcuda -lpthread || continue
    done
    echo "== capture"; "$probes/capture"
    echo "== reserve"; "$probes/reserve"
    for mode in now late; do
      printf '== teardown (%s): exit statuses of 10 runs:' "$mode"
      for _ in $(seq 10); do timeout 60 "$probes/teardown" "$mode" >/dev/null 2>&1; printf ' %s' "$?"; done
      echo
    done
  } > "$OUT/probes.txt" 2>&1
  cat "$OUT/probes.txt"
fi
if [ "${SANITIZE_RUN:-1}" = 1 ]; then
  SANITIZE=1 LIMIT=${SANITIZE_LIMIT:-1200} OUT=$logs/sanitizer bash "$pack/run.sh" | tee "$logs/sanitizer.txt"
  echo "sanitizer summaries: $(grep -h 'SUMMARY' "$logs"/sanitizer/*.log | sed 's/^=* *//' | sort | uniq -c | tr '\n' ' ')"
fi
tar czf "$OUT/logs.tgz" -C "$logs" .

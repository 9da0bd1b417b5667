#!/usr/bin/env bash
# The GPU suite as packed by `cargo xtask gpu-pack`: runs every test binary in bin/ beside this
# script with the GPU tests included. Needs the NVIDIA driver (and compute-sanitizer for
# SANITIZE=1); no Rust toolchain, no checkout.
#
#   bash run.sh [TEST_NAME_FILTER...]   arguments pass through to every test binary
#   BIN=PREFIX     only the test binaries whose name (after test--) starts with PREFIX
#   SANITIZE=1     each test binary under compute-sanitizer memcheck with the leak check
#   LIMIT=SECONDS  stop any one test binary after this long (default: no limit)
#   OUT=DIR        where each binary's log goes (default: a new temporary directory)
#   EXAMPLES=0     skip the examples (example--*), which otherwise run after the tests, each with
#                  its output shown; any that fails counts as a failed binary
#   PYTHON=0       skip the Python tests, which otherwise run last (under SANITIZE=1 too, see
#                  below): the wheel in wheels/ is
#                  installed into py/ beside this script (pip --no-index --no-deps --target) and
#                  pytest runs crates/cumempool-py/tests of the working tree this script sits in
#                  (the directory above it), counted in the summary line
# The last line is `gpu suite: N passed, M failed`; the exit status is 0 only if every binary passed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/bin" || exit 2
# A GPU test that cannot reach the driver must fail here, not skip quietly.
export CUMEMPOOL_REQUIRE_GPU=1 RUST_BACKTRACE=1
# NVLink multicast must stay off on the GPU machine (NCCL).
export NCCL_NVLS_ENABLE=0
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
limit=()
[ "${LIMIT:-0}" != 0 ] && limit=(timeout "$LIMIT")
sanitizer=()
if [ "${SANITIZE:-0}" = 1 ]; then
  command -v compute-sanitizer >/dev/null \
    || { echo "SANITIZE=1 needs compute-sanitizer (CUDA toolkit) on PATH" >&2; exit 2; }
  # The negative tests provoke driver refusals on purpose, so API errors are not reported: memory
  # errors and leaks are what must be zero. The IPC test's child is a process of its own.
  # Tests that the sanitizer misreads skip under it (docs/driver-behaviour.md says which).
  export CUMEMPOOL_UNDER_SANITIZER=1
  sanitizer=(compute-sanitizer --tool memcheck --leak-check full --report-api-errors no
             --target-processes all --error-exitcode 9)
fi
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
status=0 passed=0 failed=0
for b in test--*; do
  [ -x "$b" ] || continue
  name=${b#test--}
  [ -n "${BIN:-}" ] && [[ "$name" != "$BIN"* ]] && continue
  log="$out/$name.log"
  if [ ${#sanitizer[@]} -gt 0 ]; then
    "${limit[@]}" "${sanitizer[@]}" ./"$b" --include-ignored --test-threads=1 "$@" >"$log" 2>&1
    rc=$?
    # A binary whose tests never call CUDA is no sanitizer error.
    if [ $rc -ne 0 ] && grep -q 'terminated before first instrumented API call' "$log" \
       && grep -q '^test result: ok' "$log"; then rc=0; fi
  else
    "${limit[@]}" ./"$b" --include-ignored "$@" >"$log" 2>&1
    rc=$?
  fi
  line=$(grep -E '^test result:' "$log" | tail -1)
  p=$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$line")
  f=$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<<"$line")
  passed=$((passed + ${p:-0}))
  failed=$((failed + ${f:-0}))
  echo "$name: rc=$rc ${line:-no test result line}"
  [ ${#sanitizer[@]} -gt 0 ] && grep -hE 'ERROR SUMMARY|LEAK SUMMARY' "$log" | sed 's/^=* */    /'
  if [ $rc -ne 0 ]; then
    status=1
    [ -z "$line" ] && failed=$((failed + 1))
    grep -E 'panicked|^test .* FAILED|Invalid|rror' "$log" | head -12 | sed 's/^/    /'
  fi
done
if [ "${EXAMPLES:-1}" != 0 ] && [ -z "${BIN:-}" ] && [ ${#sanitizer[@]} -eq 0 ]; then
  for e in example--*; do
    [ -x "$e" ] || continue
    name=${e#example--}
    log="$out/example-$name.log"
    "${limit[@]}" ./"$e" >"$log" 2>&1
    rc=$?
    echo "example $name: rc=$rc"
    sed 's/^/    /' "$log" | head -40
    if [ $rc -ne 0 ]; then status=1; failed=$((failed + 1)); fi
  done
fi
# Under SANITIZE=1 the Python tests run under memcheck without host backtraces and without the
# leak check. A host backtrace taken at each allocation holds the Python frames on the stack
# alive, and with them every array in their locals, so CuPy's arrays outlive `del` and the tests
# that check their memory comes back fail (measured with compute-sanitizer 2025.3.1, driver 580).
# At exit the interpreter leaves PyTorch's and CuPy's own caches allocated, which a leak check
# would count; the tests check that cumempool's pools are back to 0 themselves.
py_sanitizer=()
[ ${#sanitizer[@]} -gt 0 ] && py_sanitizer=(compute-sanitizer --tool memcheck --report-api-errors no
                                             --show-backtrace device --target-processes all
                                             --error-exitcode 9)
if [ "${PYTHON:-1}" != 0 ] && [ -z "${BIN:-}" ]; then
  tree=$(cd "$here/.." && pwd)
  tests="$tree/crates/cumempool-py/tests"
  wheel=$(ls "$here"/wheels/cumempool-*.whl 2>/dev/null | head -1)
  log="$out/python.log"
  if [ -z "$wheel" ] || [ ! -d "$tests" ]; then
    echo "python: no wheel in $here/wheels or no $tests"; status=1; failed=$((failed + 1))
  else
    rm -rf "$here/py"
    python3 -m pip install --quiet --no-index --no-deps --target "$here/py" "$wheel" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
      (cd "$tree/crates/cumempool-py" && PYTHONPATH="$here/py" CUMEMPOOL_REQUIRE_LIBRARIES=1 \
        "${limit[@]}" "${py_sanitizer[@]}" python3 -m pytest -q -rs -p no:cacheprovider tests) \
        >>"$log" 2>&1
      rc=$?
    fi
    line=$(grep -E '^=* ?[0-9]+ (passed|failed|errors?|skipped)' "$log" | tail -1)
    p=$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<" $line")
    f=$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<<" $line")
    e=$(sed -nE 's/.* ([0-9]+) errors?.*/\1/p' <<<" $line")
    passed=$((passed + ${p:-0}))
    failed=$((failed + ${f:-0} + ${e:-0}))
    echo "python: rc=$rc ${line:-no pytest summary line}"
    [ ${#py_sanitizer[@]} -gt 0 ] && grep -hE 'ERROR SUMMARY' "$log" | sed 's/^=* */    /'
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
      status=1
      [ -z "$line" ] && failed=$((failed + 1))
      grep -E '^(FAILED|ERROR)|Error' "$log" | head -20 | sed 's/^/    /'
    fi
  fi
fi
echo "logs: $out"
echo "gpu suite: $passed passed, $failed failed"
exit $status

#!/usr/bin/env bash
# Run the same tests N times in a row, to catch a rare failure (a rank's abort at exit): stops at the first
# failing run and prints how many passed. Each run's output is kept in LOGS/run-K.log; a process that dumps
# core (ulimit -c unlimited, /proc/sys/kernel/core_pattern "core": the file lands in this folder) gets its
# every thread's stack written beside it (gdb, when installed) and the core moved into LOGS. Python's
# faulthandler and torch's C++ stack traces are on.
#   scripts/repeat_tests.sh 20 tests/test_parallel.py -k "split or vocabulary or lockstep or images or exits"
# LOGS (default /tmp/dgemma-repeat) and PYTHON (default python) can be set; run it under `nice -n 19` on a
# shared machine (it still loads it).
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:?how many runs}
shift
LOGS=${LOGS:-/tmp/dgemma-repeat}
PYTHON=${PYTHON:-python}
mkdir -p "$LOGS"
ulimit -c unlimited
export PYTHONFAULTHANDLER=1 TORCH_SHOW_CPP_STACKTRACES=1
passed=0
for k in $(seq 1 "$N"); do
    start=$(date +%s)
    "$PYTHON" -m pytest -q -p no:cacheprovider "$@" > "$LOGS/run-$k.log" 2>&1
    code=$?
    for core in core core.*; do
        [ -f "$core" ] || continue
        if command -v gdb > /dev/null; then
            gdb -batch -ex "thread apply all bt" "$(command -v "$PYTHON")" "$core" > "$LOGS/run-$k-$core-stacks.txt" 2>&1
        fi
        mv "$core" "$LOGS/run-$k-$core"
    done
    echo "run $k: exit $code in $(( $(date +%s) - start )) s, load $(cut -d' ' -f1 /proc/loadavg): $(tail -1 "$LOGS/run-$k.log")"
    if [ "$code" -ne 0 ]; then
        echo "passed $passed of $N in a row; run $k failed: $LOGS/run-$k.log"
        exit 1
    fi
    passed=$k
done
echo "passed $N of $N in a row"

#!/usr/bin/env bash
# Run test tiers several times in a row and report each run, to catch flaky tests.
#
#   hack/repeat-tests.sh [--runs N] [--load] [--] [TARGET...]
#
# TARGET is a make target (default: test). --load keeps every core busy with a busy loop
# (one `yes > /dev/null` per core) for the whole time, the way a loaded CI machine is.
# Stops at the first red run (a flaky test is a defect: its log is kept and named).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=5
load=0
targets=()
while (($#)); do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --load) load=1; shift ;;
        --) shift; targets+=("$@"); break ;;
        *) targets+=("$1"); shift ;;
    esac
done
((${#targets[@]})) || targets=(test)

logs="$(mktemp -d "${TMPDIR:-/tmp}/rankguard-repeat.XXXXXX")"
burners=()
stop_load() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_load EXIT
if ((load)); then
    for _ in $(seq "$(nproc)"); do yes >/dev/null & burners+=("$!"); done
    echo "load: ${#burners[@]} busy loops (one per core)"
fi

for i in $(seq "$runs"); do
    started=$(date +%s)
    log="$logs/run-$i.log"
    if make "${targets[@]}" >"$log" 2>&1; then
        result=green
    else
        result=RED
    fi
    # One pytest summary per target (e.g. cluster, then e2e), joined on one line.
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | paste -sd ';' - || true)
    echo "run $i/$runs: $result in $(( $(date +%s) - started ))s  ${summary}"
    if [[ $result == RED ]]; then
        echo "log: $log"
        grep -E "^(FAILED|ERROR) " "$log" | head -n 20 || true
        exit 1
    fi
done
echo "all $runs runs green (logs in $logs)"

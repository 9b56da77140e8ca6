#!/usr/bin/env bash
# Runs fuzz targets for RUNS executions each (default 10 million), spread
# over JOBS processes (default: one per core), each from a copy of its seed
# corpus, and says per target how many executions ran, in how long, and
# which crash, leak or timeout inputs were written.
#
#   make fuzz && tests/fuzz/campaign.sh                # all targets
#   RUNS=1000000 TARGETS="frames" tests/fuzz/campaign.sh
#
# BIN: where the targets are (build-fuzz/tests/fuzz); OUT_DIR: where each
# target's grown corpus, logs and artifacts go (fuzz-out/<target>). Merge
# what is worth keeping back into the seed corpus with a size cap, e.g.
#   build-fuzz/tests/fuzz/fuzz-frames -merge=1 -max_len=1024 \
#     tests/fuzz/corpus/frames fuzz-out/frames/corpus
set -uo pipefail
bin=$(cd "${BIN:-build-fuzz/tests/fuzz}" && pwd)
src=$(cd "$(dirname "$0")" && pwd)
runs=${RUNS:-10000000}
jobs=${JOBS:-$(nproc)}
out=${OUT_DIR:-fuzz-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
for t in ${TARGETS:-descriptor frames handshake ring ring-records xfer-header sets-table sets-consumer tensor-meta}; do
  w=$out/$t
  rm -rf "$w"
  mkdir -p "$w/corpus" "$w/logs"
  cp "$src/corpus/$t"/* "$w/corpus/"
  per=$(((runs + jobs - 1) / jobs))
  start=$(date +%s)
  (cd "$w/logs" && "$bin/fuzz-$t" -runs="$per" -jobs="$jobs" -workers="$jobs" \
    -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    ${MAX_TIME:+-max_total_time=$MAX_TIME} \
    -artifact_prefix="$w/" "$w/corpus" >/dev/null 2>&1)
  end=$(date +%s)
  total=$(cat "$w"/logs/fuzz-*.log 2>/dev/null |
    awk '/^stat::number_of_executed_units/ {s += $2} END {print s + 0}')
  arts=$(cd "$w" && ls -d crash-* leak-* timeout-* oom-* 2>/dev/null | tr '\n' ' ')
  echo "$t: $total executions in $((end - start)) s over $jobs processes" \
    "(at most $per each); corpus $(ls "$w/corpus" | wc -l) files; artifacts: ${arts:-none}"
done

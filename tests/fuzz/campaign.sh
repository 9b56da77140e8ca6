#!/usr/bin/env bash
# Runs fuzz targets for RUNS executions each (default 10 million), spread
# over JOBS processes (default: one per core), each from a copy of its seed
# corpus, and says per target how many executions ran, in how long, and
# which crash, leak or timeout inputs were written.
#
#   make fuzz && tests/fuzz/campaign.sh                # all targets
#   RUNS=1000000 TARGETS="frames" tests/fuzz/campaign.sh
#
# A target's executions run in segments of at most SEGMENT per process
# (default 1,000,000), each segment going on from the corpus the ones
# before it grew: under AddressSanitizer a fuzz process's mappings grow
# with the threads it has started (about 15 per 1000 executions of
# sets-consumer, whose every input starts emulator stream threads; flat
# without AddressSanitizer, so the library's own), and one process reaches
# vm.max_map_count (65530) near 4 million executions.
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
seg=${SEGMENT:-1000000}
for t in ${TARGETS:-descriptor frames handshake ring ring-records xfer-header sets-table sets-consumer tensor-meta}; do
  w=$out/$t
  rm -rf "$w"
  mkdir -p "$w/corpus" "$w/logs"
  cp "$src/corpus/$t"/* "$w/corpus/"
  start=$(date +%s)
  total=0
  n=0
  stop=""
  while [ "$total" -lt "$runs" ] && [ -z "$stop" ]; do
    left=$((runs - total))
    this=$((left < seg * jobs ? left : seg * jobs))
    per=$(((this + jobs - 1) / jobs))
    limit=""
    if [ -n "${MAX_TIME:-}" ]; then
      rest=$((MAX_TIME - ($(date +%s) - start)))
      [ "$rest" -le 0 ] && break
      limit=-max_total_time=$rest
    fi
    arts_before=$(cd "$w" && ls -d crash-* leak-* timeout-* oom-* 2>/dev/null | wc -l)
    mkdir -p "$w/logs/$n"
    (cd "$w/logs/$n" && "$bin/fuzz-$t" -runs="$per" -jobs="$jobs" -workers="$jobs" \
      -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 $limit \
      -artifact_prefix="$w/" "$w/corpus" >/dev/null 2>&1)
    done_n=$(cat "$w/logs/$n"/fuzz-*.log 2>/dev/null |
      awk '/^stat::number_of_executed_units/ {s += $2} END {print s + 0}')
    total=$((total + done_n))
    arts_after=$(cd "$w" && ls -d crash-* leak-* timeout-* oom-* 2>/dev/null | wc -l)
    # A segment that found something, or ran nothing (its logs say why),
    # ends the target's campaign; so does its time.
    if [ "$arts_after" -gt "$arts_before" ]; then
      stop="an artifact in segment $n"
    elif [ "$done_n" -eq 0 ]; then
      stop="segment $n ran nothing (see $w/logs/$n)"
    elif [ "$done_n" -lt "$this" ] && [ -z "$limit" ]; then
      stop="segment $n ran $done_n of $this (see $w/logs/$n)"
    fi
    n=$((n + 1))
  done
  end=$(date +%s)
  arts=$(cd "$w" && ls -d crash-* leak-* timeout-* oom-* 2>/dev/null | tr '\n' ' ')
  echo "$t: $total executions in $((end - start)) s over $jobs processes" \
    "($n segments of at most $seg each); corpus $(ls "$w/corpus" | wc -l) files;" \
    "artifacts: ${arts:-none}${stop:+; stopped: $stop}"
done

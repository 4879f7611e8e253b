#!/usr/bin/env bash
# soak.sh: the mixed CUDA soak (moe's TestSoak: goroutines sharing one BLAS
# Context through per-stream views, one Context switched between two streams
# before every call, cuBLAS, cuBLASLt, graph replays and MoE forwards of every
# mode, every result compared bitwise with its one-stream reference) for SOAK
# (default 5m). SOAK_LOG (default $OUT/soak.log) is its log; with SHARED=1 other
# processes use the GPU at the same time, so the test logs the device's free
# memory without checking it, and this script checks the soak process's own
# device memory instead (nvidia-smi, every 15 s): it must not grow by more than
# 64 MiB from the first sample after the warm-up to the last.
# Build first (here): bash bench/gpu/pack.sh ./moe
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SOAK=${SOAK:-5m}
LOG=${SOAK_LOG:-$OUT/soak.log}
secs=$(( $(echo "$SOAK" | sed -E 's/m$/*60/; s/s$//') ))
shared=(); [ "${SHARED:-0}" = 1 ] && shared=(GPUCTX_SOAK_SHARED=1)
cd moe || exit 1
# env execs the test binary, so $! is the process nvidia-smi lists.
env "${shared[@]}" GPUCTX_SOAK="$SOAK" ../.gpu/moe.test -test.count=1 -test.v \
  -test.timeout "$((secs + 100))s" -test.run 'TestSoak$' > "$LOG" 2>&1 &
pid=$!
: > "$LOG.mem"
while kill -0 $pid 2>/dev/null; do
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
    awk -F', *' -v p=$pid -v t=$SECONDS '$1 == p { print t, $2 }' >> "$LOG.mem"
  sleep 15
done
wait $pid; rc=$?
first=$(awk '$1 >= 45 { print $2; exit }' "$LOG.mem"); last=$(tail -1 "$LOG.mem" | awk '{print $2}')
verdict="flat"
[ -n "$first" ] && [ -n "$last" ] && [ "$last" -gt $((first + 64)) ] && verdict="GREW" && rc=1
{ echo "soak $SOAK rc=$rc; this process's device memory (MiB) after warm-up ${first:-?}, at the end ${last:-?}: $verdict"
  grep -E "soak|phase|--- " "$LOG" | head -12; } | tee -a "$LOG"
exit $rc

#!/usr/bin/env bash
# Session 4 diagnostic (not a benchmark): cycles per phase of
# gpuctx_moe_route_align's last block, from a temporary build whose kernel
# writes clock64() deltas after the logits (instrumented moe.test built from a
# scratch worktree; the instrumentation is not in the repository).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && timeout 200 ../.gpu/moe.test -test.count=1 -test.v -test.run 'TestZZRouteAlignPhases') > "$OUT/radiag.txt" 2>&1
echo "rc=$?"; grep -E "cycles|FAIL|ok|PASS|panic" "$OUT/radiag.txt" | head -30

#!/usr/bin/env bash
# soak.sh: the MoE soak test on CUDA (moe's TestSoak: forwards of every mode
# and size from several goroutines, outputs checked) for SOAK (default 5m).
# Build first (here): bash bench/gpu/pack.sh ./moe
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SOAK=${SOAK:-5m}
(cd moe && GPUCTX_SOAK=$SOAK timeout 560 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 550s -test.run 'TestSoak$') > "$OUT/soak.log" 2>&1
echo "soak $SOAK rc=$?"; grep -E "soak|phase|--- " "$OUT/soak.log" | head -12

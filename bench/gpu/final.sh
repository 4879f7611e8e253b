#!/usr/bin/env bash
# Final check on the GPU machine: every packed test binary on CUDA, and the BLAS
# callback overhead again. Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
.gpu/gpuctx info > "$OUT/info.txt" 2>&1
RUN=${RUN:-.} bash .gpu/run.sh 2>&1 | tail -4
grep -E -- '^--- (FAIL|SKIP)' "$OUT/gpu-tests.log" | head
grep -E -- '--- PASS: .*/cuda ' "$OUT/gpu-tests.log" | sed 's#/cuda .*##; s#^ *--- PASS: ##' | sort | uniq -c | sort -rn | head -30
(.gpu/root.test -test.run XXX -test.bench 'BindingOverhead/cuda|AlternatingStreams/cuda|OverheadVsBare' -test.benchtime 300ms -test.count 3) > "$OUT/binding.txt" 2>&1
grep -E '^Benchmark.*ns/op' "$OUT/binding.txt"
.gpu/gpuctx moe bench --tokens 1,8,64,1024 --mode single,dual,auto --out "$OUT/moe-auto.md" > /dev/null 2>&1
sed -n '/^| tokens/,/^$/p' "$OUT/moe-auto.md"

#!/usr/bin/env bash
# Verification run 1 (issue 7): every packed CUDA test binary, then
# compute-sanitizer memcheck and racecheck over the CUDA tests of the root
# package (contexts, BLAS, graphs), cuBLAS and the MoE layer (fused kernels).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; echo "tests rc=$?"; tail -4 "$OUT/tests-summary.txt"
grep -E -- '^\s*--- FAIL' "$OUT/gpu-tests.log" | head -20
san() { # tool name dir binary run-regexp timeout
  (cd "$3" && timeout "$6" compute-sanitizer --tool "$1" --error-exitcode 9 "$4" -test.count=1 -test.run "$5") > "$OUT/$1-$2.log" 2>&1
  echo "$1 $2 rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$1-$2.log" | tail -1) $(grep -E '^(ok|PASS|FAIL)' "$OUT/$1-$2.log" | tail -1)"
}
san memcheck root . "$PWD/.gpu/root.test" 'Context|Graph|Gemm|Geam|Blas|Stream|Event|DeviceLost|Stress' 100
san memcheck cublas backend/cuda/cublas "$PWD/.gpu/backend_cuda_cublas.test" '.' 60
san memcheck moe moe "$PWD/.gpu/moe.test" 'TestLayer(FusedTiles|FusedShared|Fixtures|DirectGraphs|Misaligned|DualBitwise)/cuda' 150
san racecheck moe moe "$PWD/.gpu/moe.test" 'TestLayerFusedTiles/cuda|TestLayerFusedShared/cuda/deepseek-v2-lite' 80

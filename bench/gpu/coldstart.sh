#!/usr/bin/env bash
# coldstart.sh: first-run cost on the GPU machine (issue 24). With an empty
# GPUCTX_KERNEL_CACHE directory (compiled kernels and, in its tuning/ folder,
# the tuning results), the wall time of
#   1. the first moe run of a DeepSeek-V2-Lite-size layer (bf16, written by
#      moe init into /tmp)        target <= 5 s
#   2. a second moe run (warm)    target <= 0.6 s
#   3. the first moe bench (cold cache again: kernels and tuning)   target <= 15 s
#   4. a second moe bench (warm)
# each printed with moe run -v's phases, then a summary against the targets.
# Build first (here): bash bench/gpu/pack.sh ./cmd/gpuctx   (carry [".gpu"])
# Then on the GPU machine: bash bench/gpu/coldstart.sh   (about 2-4 minutes)
# Environment: OUT (default /tmp/out), TOKENS and SETS of moe bench (default
# 1,64 and 1), MODE of moe run (default auto).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOKENS=${TOKENS:-1,64}; SETS=${SETS:-1}; MODE=${MODE:-auto}
G=.gpu/gpuctx
[ -x "$G" ] || { echo "coldstart.sh: $G missing: run bash bench/gpu/pack.sh ./cmd/gpuctx here and carry .gpu"; exit 1; }
FIX=/tmp/dsv2
export GPUCTX_KERNEL_CACHE=/tmp/gpuctx-coldstart-cache
nproc_=$(nproc 2>/dev/null || echo "?")
echo "== $($G --version 2>&1 | head -1); $nproc_ CPUs; cache $GPUCTX_KERNEL_CACHE"
if ! timeout 180 $G moe init --preset deepseek-v2-lite --dir $FIX --dtype bf16 > "$OUT/coldstart-init.log" 2>&1; then
  echo "moe init failed:"; tail -5 "$OUT/coldstart-init.log"; exit 1
fi
declare -A WALL
# timed NAME CMD...: runs CMD (stderr to the terminal, stdout to $OUT) and
# records its wall time in seconds.
timed() {
  local name=$1; shift
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout 240 "$@" > "$OUT/coldstart-$name.out" 2> "$OUT/coldstart-$name.err"; rc=$?
  t1=$(date +%s.%N)
  WALL[$name]=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  echo "== $name: wall ${WALL[$name]} s (exit $rc)"
  grep -v '^\s*$' "$OUT/coldstart-$name.err" | tail -12
  [ $rc -eq 0 ] || echo "   FAILED: see $OUT/coldstart-$name.err"
}
RUN=(moe run --model $FIX --input $FIX/input.safetensors --output /tmp/coldstart-y.safetensors --dtype bf16 --mode "$MODE" -v)
BENCH=(moe bench --preset deepseek-v2-lite --tokens "$TOKENS" --sets "$SETS")
rm -rf "$GPUCTX_KERNEL_CACHE"
timed run-cold $G "${RUN[@]}"
timed run-warm $G "${RUN[@]}"
rm -rf "$GPUCTX_KERNEL_CACHE"
timed bench-cold $G "${BENCH[@]}" --out "$OUT/coldstart-bench-cold.md"
timed bench-warm $G "${BENCH[@]}" --out "$OUT/coldstart-bench-warm.md"
echo "== cache: $(ls "$GPUCTX_KERNEL_CACHE" | grep -c '\.bin$') kernel images, $(ls "$GPUCTX_KERNEL_CACHE/tuning" 2>/dev/null | wc -l) tuning entries"
echo "== summary (issue 24 targets)"
verdict() { awk -v t="$2" -v m="$3" 'BEGIN { print (t <= m) ? "ok" : "MISS" }'; }
printf '  %-28s %8.2f s  target <= %4s s  %s\n' "first moe run (cold)" "${WALL[run-cold]}" 5 "$(verdict x "${WALL[run-cold]}" 5)"
printf '  %-28s %8.2f s  target <= %4s s  %s\n' "second moe run (warm)" "${WALL[run-warm]}" 0.6 "$(verdict x "${WALL[run-warm]}" 0.6)"
printf '  %-28s %8.2f s  target <= %4s s  %s\n' "first moe bench (cold)" "${WALL[bench-cold]}" 15 "$(verdict x "${WALL[bench-cold]}" 15)"
printf '  %-28s %8.2f s\n' "second moe bench (warm)" "${WALL[bench-warm]}"
grep -h "tuning cache\|tile" "$OUT/coldstart-bench-warm.md" 2>/dev/null | head -4

#!/usr/bin/env bash
# Session 4, first call: where the small-batch time goes, and issue 10's moe run
# breakdown. Build: bash bench/gpu/pack.sh ./cmd/gpuctx
#  1. moe init of a DeepSeek-V2-Lite-sized layer (1.1 GiB), moe run -v with a
#     cold then a warm kernel cache, then with the cache disabled.
#  2. one traced eager forward per case (every kernel a span) for
#     Qwen3-30B-A3B at 1 token and DeepSeek-V2-Lite at 1 and 8 tokens.
#  3. ncu (SpeedOfLight, occupancy) over one eager Qwen3 forward at 1 token with
#     the tuner's tiles forced, and over the peer's kernels at 1 token.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
FIX=/tmp/dsv2
timeout 90 .gpu/gpuctx moe init --preset deepseek-v2-lite --dir $FIX > /dev/null 2>&1 || echo "moe init failed"
ls -la $FIX
export GPUCTX_KERNEL_CACHE=/tmp/kcache
TIMEFORMAT="wall %R s"
{
for run in cold warm warm2; do
  echo "== moe run -v, $run kernel cache"
  time timeout 60 .gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output /tmp/y.safetensors --dtype bf16 --mode dual -v 2>&1 >/dev/null
done
echo "== moe run -v, GPUCTX_KERNEL_CACHE=off"
time GPUCTX_KERNEL_CACHE=off timeout 60 .gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output /tmp/y.safetensors --dtype bf16 --mode dual -v 2>&1 >/dev/null
} > "$OUT/moe-run.txt" 2>&1
cat "$OUT/moe-run.txt"
{
for c in "qwen3-30b-a3b 1 single" "deepseek-v2-lite 1 single,dual" "deepseek-v2-lite 8 single,dual" "qwen3-30b-a3b 8 single"; do
  set -- $c
  echo "=== trace $1 T=$2 modes $3"
  timeout 90 .gpu/gpuctx moe bench --preset $1 --tokens $2 --mode $3 --small-batch -1 --iters 20 --trace /tmp/t.json --out /tmp/t.md > /tmp/t.log 2>&1 || tail -5 /tmp/t.log
  grep -E "^\| [0-9]|note: fused tiles" /tmp/t.md | cut -c1-400
  python3 bench/gpu/timeline.py /tmp/t.json
done
} > "$OUT/traces.txt" 2>&1
tail -60 "$OUT/traces.txt"
TILE=$(grep -o "T=1 (bucket 1, fused shared false): up [a-z0-9]*" "$OUT/traces.txt" | head -1 | awk '{print $NF}')
echo "forced tile for ncu: $TILE"
timeout 150 ncu --clock-control none --kernel-name regex:gpuctx_moe --launch-count 8 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1 --mode single --small-batch -1 --tile ${TILE:-m16n32k128w1x2s4} --iters 1 --warmup 0 --no-graphs > "$OUT/ncu-qwen3-1.txt" 2>&1
grep -E "gpuctx_moe|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Grid Size|Registers Per" "$OUT/ncu-qwen3-1.txt" | head -80
timeout 150 ncu --clock-control none --kernel-name regex:"moe|topk|align|sum|gemm|mm" --launch-skip 40 --launch-count 12 \
  --section SpeedOfLight --section LaunchStats \
  python3 .gpu/peers/triton_fused_moe.py --preset qwen3-30b-a3b --tokens 1 --iters 2 --warmup 1 > "$OUT/ncu-peer-qwen3-1.txt" 2>&1
grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|Grid Size" "$OUT/ncu-peer-qwen3-1.txt" | head -60

#!/usr/bin/env bash
# Session 5, fifth GPU call: 1-token forwards got 10-23 us slower between
# s5_early.sh (f2a4e20) and s5_route.sh (97d8386). The CLI of four commits
# (.gpu/bisect/gpuctx-<commit>.gz) runs the same small benchmarks; then the
# phases of route_align (scratch test moe/zz_ra_phases_test.go) and the
# kernels of one traced eager forward at 1 token.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
row() { grep -E "^\| +[0-9]" "$1" | cut -c1-120; }
for gz in .gpu/bisect/gpuctx-*.gz; do
  c=$(basename "$gz" .gz); gunzip -c "$gz" > /tmp/$c; chmod +x /tmp/$c
  for run in "qwen3-30b-a3b 1,8 single" "deepseek-v2-lite 1,8 fused"; do set -- $run
    timeout 60 /tmp/$c moe bench --preset $1 --tokens $2 --mode $3 --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
    echo "== $c $1 $3 rc=$?"; row /tmp/b.md
  done
done
c=$(ls .gpu/bisect/ | tail -1); c=${c%.gz}
GPUCTX_EARLY_LAUNCH=0 timeout 60 /tmp/$c moe bench --preset qwen3-30b-a3b --tokens 1,8 --mode single --small-batch -1 --out /tmp/b.md > /dev/null 2>&1
echo "== $c GPUCTX_EARLY_LAUNCH=0 qwen3 rc=$?"; row /tmp/b.md
(cd moe && timeout 60 ../.gpu/moe.test -test.count=1 -test.v -test.run 'TestZZRouteAlignPhases') > /tmp/zz.log 2>&1; echo "zz rc=$?"; grep -E "^zz " /tmp/zz.log
for p in qwen3-30b-a3b deepseek-v2-lite; do
  timeout 60 /tmp/$c moe bench --preset $p --tokens 1 --mode single --small-batch -1 --trace /tmp/t1.json --out /tmp/t1.md > /dev/null 2>&1
  echo "== trace $p 1 token ($c) rc=$?"; python3 bench/gpu/timeline.py /tmp/t1.json 2>&1 | tail -6
done
echo "== total $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# pack.sh: build what the GPU machine needs from this checkout into .gpu/.
# Self-contained: needs only this repository and a Go toolchain (no GPU). The GPU
# machine has no Go toolchain: it gets compiled test binaries, the CLIs and the peers.
#
#   bash bench/gpu/pack.sh [PKG-PATTERN...]   (default: every package with tests, ./...)
#
# It writes into .gpu/ (ignored by git):
#   NAME.test     CGO_ENABLED=0 go test -c -ldflags='-s -w' of every package with tests;
#                 NAME is the import path below the module, '/' -> '_' (root: "root")
#   tests.txt     one line per test binary: NAME DIR, DIR relative to the repository
#                 root ("." for the root package), so run.sh finds the package folder
#                 (its testdata) in the copy on the GPU machine
#   CMD           every cmd/CMD, with -X main.buildCommit=HEAD so moe bench reports it
#   peers/        bench/peers/ (e.g. peers/triton_fused_moe.py, the vLLM Triton peer)
#   run.sh        runs every test binary from its package folder; logs to $OUT
# CLI=DIR builds the gpuctx binary from another folder (default ./cmd/gpuctx).
#
# Then run the device tool with carry [".gpu"] and e.g. the command  bash .gpu/run.sh
# Environment read by run.sh there: RUN (a -test.run regexp, default "."),
# BENCH (a -test.bench regexp, default none), EXTRA (more flags for every binary).
# Logs land in $OUT/gpu-tests.log (it comes back with the reply).
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
rm -rf .gpu && mkdir -p .gpu
pkgs=("$@"); [ ${#pkgs[@]} -gt 0 ] || pkgs=(./...)
export CGO_ENABLED=0
mod=$(go list -m)
list=$(go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.ImportPath}}{{end}}' "${pkgs[@]}")
: > .gpu/tests.txt
while read -r path; do
  [ -n "$path" ] || continue
  # the folder relative to the repository root, from the import path (one module)
  case "$path" in
    "$mod") rel=. ;;
    "$mod"/*) rel=${path#"$mod"/} ;;
    *) echo "pack.sh: $path is not in module $mod" >&2; exit 1 ;;
  esac
  name=$(echo "$rel" | sed 's#/#_#g'); [ "$rel" != . ] || name=root
  go test -c -ldflags='-s -w' -o ".gpu/$name.test" "$path"
  echo "$name $rel" >> .gpu/tests.txt
done <<< "$list"
rev=$(git rev-parse HEAD)
for c in cmd/*/; do
  c=${c%/}
  src=./$c; [ "$(basename "$c")" != gpuctx ] || src=${CLI:-./cmd/gpuctx}
  go build -ldflags="-s -w -X main.buildCommit=$rev" -o ".gpu/$(basename "$c")" "$src"
done
# the peers travel with the binaries (python3 .gpu/peers/triton_fused_moe.py)
mkdir -p .gpu/peers
cp bench/peers/*.py .gpu/peers/
cat > .gpu/run.sh <<'RUN'
#!/usr/bin/env bash
# Runs every packed test binary from its package folder; logs to $OUT.
top=$(cd "$(dirname "$0")/.." && pwd)
log=${OUT:-/tmp}/gpu-tests.log
fail=0
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | tee "$log"
while read -r name dir; do
  echo "=== $name ($dir)" | tee -a "$log"
  args=(-test.run "${RUN:-.}" -test.count=1 -test.v)
  [ -n "${BENCH:-}" ] && args+=(-test.bench "$BENCH" -test.benchmem)
  # shellcheck disable=SC2086
  (cd "$top/$dir" && "$top/.gpu/$name.test" "${args[@]}" ${EXTRA:-}) >>"$log" 2>&1 || { fail=1; echo "FAIL $name" | tee -a "$log"; }
  grep -E '^(--- FAIL|FAIL|ok|PASS|panic)' "$log" | tail -3
done < "$top/.gpu/tests.txt"
echo "totals: $(grep -E '^ *--- (PASS|FAIL|SKIP)' "$log" | awk '{print $2}' | sort | uniq -c | tr -s ' \n' ' ')"
grep -E '^--- (FAIL|SKIP)' "$log" | head -20
exit $fail
RUN
chmod +x .gpu/run.sh
size=$(du -sb .gpu | cut -f1)
echo "packed $((size >> 20)) MiB ($size bytes) into .gpu/ (limit for what the device tool carries: 64 MiB)"
if [ "$size" -gt $((60 << 20)) ]; then
  echo "pack.sh: warning: .gpu/ is near or over the 64 MiB carry limit; pass only the packages needed, e.g. bash bench/gpu/pack.sh . ./moe/..." >&2
fi
cat .gpu/tests.txt

#!/usr/bin/env bash
# pack.sh: build what the GPU machine needs into .gpu/ (like ../shared/tools/gpu-pack,
# whose tests.txt gets the root package's folder wrong: "root /abs/path" instead of
# "root ."). Usage: bash bench/gpu/pack.sh [PKG...]   (default: . ./backend/cuda/... ./moe/...)
# CLI=DIR picks the folder the gpuctx binary is built from (default ./cmd/gpuctx).
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
pkgs=("$@"); [ ${#pkgs[@]} -gt 0 ] || pkgs=(. ./backend/cuda/... ./moe/...)
export CGO_ENABLED=0
# build the shared tool's run.sh, then fix tests.txt
../shared/tools/gpu-pack "${pkgs[@]}" >/dev/null 2>&1 || true
rm -f .gpu/*.test; : > .gpu/tests.txt
mod=$(go list -m)
go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.ImportPath}} {{.Dir}}{{end}}' "${pkgs[@]}" | while read -r path dir; do
  [ -n "$path" ] || continue
  name=$(echo "${path#$mod}" | sed 's#^/##; s#/#_#g'); [ -n "$name" ] || name=root
  rel=$(realpath --relative-to="$top" "$dir")
  go test -c -ldflags='-s -w' -o ".gpu/$name.test" "$path"
  echo "$name $rel" >> .gpu/tests.txt
done
go build -ldflags="-s -w -X main.buildCommit=$(git rev-parse HEAD)" -o .gpu/gpuctx "${CLI:-./cmd/gpuctx}"
if [ ! -f .gpu/run.sh ]; then
  # gpu-pack stopped before writing run.sh: write an equivalent one.
  cat > .gpu/run.sh <<'RUN'
#!/usr/bin/env bash
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
fi
du -sh .gpu | awk '{print "packed", $1, "into .gpu/"}'; cat .gpu/tests.txt

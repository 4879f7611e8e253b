#!/usr/bin/env bash
# ab.sh: one device call that compares two builds, this checkout's against a
# base commit's, taking turns (base, new, base, new, ...) so that the GPU's
# drift falls on both alike. bench/RESULTS.md's A/B calls (a tile against its
# parent, a register split, a routing change) were written by hand before.
#
# Here (a Go toolchain, no GPU):
#
#   bash bench/gpu/ab.sh BASE [PKG-PATTERN...]
#
# runs pack.sh with the packages (the CLI always), then builds the same CLI
# and test binaries at commit BASE in a temporary git worktree, gzipped into
# .gpu/base/ (two CLIs unpacked would pass much of the device tool's 64 MiB),
# and writes .gpu/ab-run.sh. On the GPU machine:
#
#   bash .gpu/ab-run.sh ROUNDS 'COMMAND'...
#
# runs each COMMAND ROUNDS times for each build, alternating, from the
# checkout's root. In a COMMAND, $GPUCTX is the build's CLI, $BIN its folder
# of test binaries (a test binary runs from its package folder for its
# testdata: cd first), and $AB "base" or "new". Output goes to stdout, each
# line prefixed "[AB ROUND]", and to $OUT/ab.log. Example:
#
#   bash .gpu/ab-run.sh 2 \
#     '"$GPUCTX" moe bench --preset qwen3-30b-a3b --dtype fp8 --tokens 1,8 --iters 50 --out /tmp/l.md >/dev/null && grep "^| [0-9]" /tmp/l.md' \
#     'cd moe/internal/moekernels && "$BIN"/moe_internal_moekernels.test -test.run "^$" -test.bench "W8A8Expert/deepseek-v2-lite/T=4096$" -test.benchtime 1x'
#
# A -test.bench pattern is split at every '/', parentheses or not: write
# T=4096$ once per level, not "(a/b|c/d)".
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/gpu/ab.sh BASE [PKG-PATTERN...]" >&2; exit 2; }
base=$1
shift
top=$(git rev-parse --show-toplevel)
cd "$top"
rev=$(git rev-parse --verify "$base^{commit}") || { echo "ab.sh: $base is not a commit" >&2; exit 2; }
bash bench/gpu/pack.sh "$@"
wt=$(mktemp -d)
trap 'git worktree remove --force "$wt" >/dev/null 2>&1 || rm -rf "$wt"' EXIT
git worktree add -q --detach "$wt" "$rev"
mkdir -p .gpu/base
(
  cd "$wt"
  export CGO_ENABLED=0
  go build -ldflags="-s -w -X main.buildCommit=$rev" -o "$top/.gpu/base/gpuctx" ./cmd/gpuctx
  while read -r name rel; do
    [ -n "$name" ] || continue
    if [ -d "$rel" ]; then
      go test -c -ldflags='-s -w' -o "$top/.gpu/base/$name.test" "./$rel"
    else
      echo "ab.sh: $rel does not exist at $base: no base $name.test" >&2
    fi
  done < "$top/.gpu/tests.txt"
)
shopt -s nullglob
gzip -f .gpu/base/gpuctx .gpu/base/*.test
echo "$rev" > .gpu/base/commit
cat > .gpu/ab-run.sh <<'RUN'
#!/usr/bin/env bash
# Runs each command ROUNDS times per build, base first, alternating (bench/gpu/ab.sh).
set -u
[ $# -ge 2 ] || { echo "usage: bash .gpu/ab-run.sh ROUNDS 'COMMAND'..." >&2; exit 2; }
rounds=$1
shift
top=$(cd "$(dirname "$0")/.." && pwd)
log=${OUT:-/tmp}/ab.log
unpacked=${TMPDIR:-/tmp}/gpuctx-ab-$(cat "$top/.gpu/base/commit")
mkdir -p "$unpacked"
for f in "$top"/.gpu/base/*.gz; do
  out="$unpacked/$(basename "$f" .gz)"
  [ -x "$out" ] || { gunzip -c "$f" > "$out" && chmod +x "$out"; }
done
echo "base $(cat "$top/.gpu/base/commit"), new: this checkout's .gpu" | tee -a "$log"
fail=0
for cmd in "$@"; do
  for r in $(seq 1 "$rounds"); do
    for ab in base new; do
      if [ "$ab" = base ]; then bin=$unpacked; else bin=$top/.gpu; fi
      echo "== [$ab $r] $cmd" | tee -a "$log"
      (cd "$top" && AB=$ab GPUCTX=$bin/gpuctx BIN=$bin bash -c "$cmd") 2>&1 | sed "s/^/[$ab $r] /" | tee -a "$log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
    done
  done
done
exit $fail
RUN
chmod +x .gpu/ab-run.sh
size=$(du -sb .gpu | cut -f1)
echo "ab.sh: base $rev in .gpu/base/ ($(du -sh .gpu/base | cut -f1)); .gpu/ is $((size >> 20)) MiB (the device tool carries 64 MiB)"

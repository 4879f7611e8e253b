// Command mutate breaks the binding contract on purpose, one mutation at a
// time, and records whether the plain CPU test suite catches each one (issue
// 20's table). For every mutation it edits the source (an exact text
// replacement inside one named function, or text appended to a file), runs
// the contract tests -runs times (each a separate `go test -count=1`, so
// that a catch is counted per run) and the plain suite of the packages once,
// restores the source (also when a run fails, the build breaks or the
// command is interrupted), and writes the table to -out.
//
// Run it from the module root with a clean work tree (it refuses otherwise):
//
//	go run ./internal/cmd/mutate            # every mutation, 10 runs each
//	go run ./internal/cmd/mutate -only lt-reread-lend -runs 3
//
// On a 2-core machine the whole table takes about 5-10 minutes.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"time"
)

// edit replaces old with new, exactly once, inside the body of function fn
// of file; with fn empty it appends new to the file.
type edit struct{ file, fn, old, new string }

// mutation is one deliberate break of the contract.
type mutation struct {
	name  string // short id (-only)
	row   string // what it breaks, as issue 20's table says it
	edits []edit
}

var mutations = []mutation{
	{"ws-not-reapplied", "workspace not re-applied after set-stream (bind trusts set-stream to keep it)", []edit{
		{"context.go", "setStream", "\tif !keepsWS {\n\t\tsl.applied = nil\n\t}\n", ""}}},
	{"blas-release-early", "Blas callback: release the slot before the callback", []edit{
		{"context.go", "BlasFlavour", "defer c.release(sl)", "c.release(sl)"}}},
	{"lt-release-early", "BlasLt callback: release the slot before the callback", []edit{
		{"context.go", "BlasLt", "defer c.release(sl)", "c.release(sl)"}}},
	{"oplock-dropped", "the per-call op lock in blasops dropped", []edit{
		{"blasops.go", "lock", "if old&opLocked == 0 && l.state.CompareAndSwap(old, old|opLocked) {", "if true {"},
		{"blasops.go", "unlock", "l.state.Add(^uint64(0))", "_ = l"}}},
	{"blas-reread-lend", "Blas: the stream read a second time when lending", []edit{
		{"context.go", "BlasFlavour", "sl.Handle.lend(c, s)", "sl.Handle.lend(c, c.stream.Load())"}}},
	{"blas-reread-bind", "Blas: the stream read a second time when binding", []edit{
		{"context.go", "BlasFlavour", "c.bind(sl, s)", "c.bind(sl, c.stream.Load())"}}},
	{"lt-reread-lend", "BlasLt: the stream read a second time when lending", []edit{
		{"context.go", "BlasLt", "sl.Handle.lend(c, s)", "sl.Handle.lend(c, c.stream.Load())"}}},
	{"lt-reread-bind", "BlasLt: the stream read a second time when binding", []edit{
		{"context.go", "BlasLt", "c.bind(sl, s)", "c.bind(sl, c.stream.Load())"}}},
	{"raw-handle-getter", "a new exported method that hands out the raw library handle", []edit{
		{"blasops.go", "", "", "\n// Raw returns the library handle, for calls gpuctx does not wrap.\nfunc (h Blas) Raw() hal.BlasHandle { return h.sl.Handle.blas }\n"}}},
}

type options struct {
	runs    int
	run     string
	pkgs    []string
	out     string
	only    string
	timeout time.Duration
	noBase  bool
}

func main() {
	var o options
	var pkgs string
	flag.IntVar(&o.runs, "runs", 10, "contract-test runs per mutation")
	flag.StringVar(&o.run, "run", "TestContract|TestAPI", "the contract tests (-run pattern)")
	flag.StringVar(&pkgs, "pkgs", "./ ./backend/cpu ./internal/handlepool ./conformance", "packages of the contract tests and the plain suite")
	flag.StringVar(&o.out, "out", "internal/cmd/mutate/results.md", "results table")
	flag.StringVar(&o.only, "only", "", "run only the mutation of this name")
	flag.DurationVar(&o.timeout, "timeout", 120*time.Second, "go test -timeout (a hang counts as a catch)")
	flag.BoolVar(&o.noBase, "nobaseline", false, "skip the unmutated baseline run")
	flag.Parse()
	o.pkgs = strings.Fields(pkgs)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := runAll(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "mutate:", err)
		os.Exit(1)
	}
}

// result is what the suite did with one mutation.
type result struct {
	m          mutation
	caught     int    // contract runs that failed
	plain      string // the plain suite: "caught", "not caught", or why not run
	firstFail  string // a line of the first failing output
	buildError string
}

func runAll(ctx context.Context, o options) error {
	files := map[string]bool{}
	for _, m := range mutations {
		for _, e := range m.edits {
			files[e.file] = true
		}
	}
	for f := range files {
		if err := exec.Command("git", "diff", "--quiet", "HEAD", "--", f).Run(); err != nil {
			return fmt.Errorf("%s has uncommitted changes (or git failed: %v); commit them first: mutate restores files to their content at start", f, err)
		}
	}
	if !o.noBase {
		fmt.Println("baseline (no mutation)")
		if n, out := contractRuns(ctx, o, 1); n != 0 {
			return fmt.Errorf("the contract tests fail without a mutation:\n%s", out)
		}
		if ok, out := goTest(ctx, o, nil); !ok {
			return fmt.Errorf("the plain suite fails without a mutation:\n%s", out)
		}
	}
	var results []result
	for _, m := range mutations {
		if o.only != "" && m.name != o.only {
			continue
		}
		r, err := runOne(ctx, o, m)
		if err != nil {
			return err
		}
		fmt.Printf("%-20s caught %d/%d, plain suite: %s\n", m.name, r.caught, o.runs, r.plain)
		results = append(results, r)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	return os.WriteFile(o.out, table(o, results), 0o644)
}

// runOne applies m, runs the tests and restores the source.
func runOne(ctx context.Context, o options, m mutation) (r result, err error) {
	r.m = m
	orig, err := apply(m.edits)
	defer func() {
		for f, b := range orig {
			if werr := os.WriteFile(f, b, 0o644); werr != nil {
				err = errors.Join(err, fmt.Errorf("restoring %s: %w", f, werr))
			}
		}
	}()
	if err != nil {
		return r, fmt.Errorf("mutation %s: %w", m.name, err)
	}
	if out, berr := exec.CommandContext(ctx, "go", "vet", "./").CombinedOutput(); berr != nil {
		r.buildError = firstLine(string(out))
		r.plain = "does not build"
		return r, nil
	}
	var out string
	r.caught, out = contractRuns(ctx, o, o.runs)
	r.firstFail = failLine(out)
	if ok, pout := goTest(ctx, o, nil); ok {
		r.plain = "not caught"
	} else {
		r.plain = "caught"
		if r.firstFail == "" {
			r.firstFail = failLine(pout)
		}
	}
	return r, nil
}

// apply makes the edits and returns the files' original contents.
func apply(edits []edit) (map[string][]byte, error) {
	orig := map[string][]byte{}
	for _, e := range edits {
		cur, err := os.ReadFile(e.file)
		if err != nil {
			return orig, err
		}
		if _, ok := orig[e.file]; !ok {
			orig[e.file] = cur
		}
		next, err := replaceIn(cur, e)
		if err != nil {
			return orig, err
		}
		if err := os.WriteFile(e.file, next, 0o644); err != nil {
			return orig, err
		}
	}
	return orig, nil
}

// replaceIn applies e to src.
func replaceIn(src []byte, e edit) ([]byte, error) {
	if e.fn == "" {
		return append(bytes.Clone(src), e.new...), nil
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, e.file, src, 0)
	if err != nil {
		return nil, err
	}
	for _, d := range f.Decls {
		fd, ok := d.(*ast.FuncDecl)
		if !ok || fd.Name.Name != e.fn || fd.Body == nil {
			continue
		}
		lo, hi := fset.Position(fd.Body.Pos()).Offset, fset.Position(fd.Body.End()).Offset
		body := string(src[lo:hi])
		if n := strings.Count(body, e.old); n != 1 {
			return nil, fmt.Errorf("%s: %s: %q occurs %d times, want once (the source changed: update the mutation)", e.file, e.fn, e.old, n)
		}
		out := append(bytes.Clone(src[:lo]), strings.Replace(body, e.old, e.new, 1)...)
		return append(out, src[hi:]...), nil
	}
	return nil, fmt.Errorf("%s: no function %s (the source changed: update the mutation)", e.file, e.fn)
}

// contractRuns runs the contract tests n times and returns how many failed
// and the output of the first failure.
func contractRuns(ctx context.Context, o options, n int) (failed int, firstOut string) {
	for range n {
		if ok, out := goTest(ctx, o, []string{"-run", o.run}); !ok {
			if failed == 0 {
				firstOut = out
			}
			failed++
		}
	}
	return failed, firstOut
}

// goTest runs go test on o.pkgs with extra flags and reports whether it passed.
func goTest(ctx context.Context, o options, extra []string) (bool, string) {
	args := append([]string{"test", "-count=1", "-timeout", o.timeout.String()}, extra...)
	cmd := exec.CommandContext(ctx, "go", append(args, o.pkgs...)...)
	out, err := cmd.CombinedOutput()
	return err == nil, string(out)
}

func firstLine(s string) string {
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			return l
		}
	}
	return ""
}

// failLine picks the most telling line of a failing go test output.
func failLine(out string) string {
	for _, key := range []string{"ErrHandleMisuse", "contract broken", "panic:", "_test.go:", "--- FAIL"} {
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, key) {
				l = strings.TrimSpace(l)
				if len(l) > 160 {
					l = l[:160] + "..."
				}
				return l
			}
		}
	}
	return ""
}

// table formats the results as a Markdown table.
func table(o options, rs []result) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Mutation results\n\nWritten by `go run ./internal/cmd/mutate` on %s (%s).\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"), gitHead())
	fmt.Fprintf(&b, "Contract tests: `go test -count=1 -run '%s' %s`, %d runs per mutation; plain suite: `go test -count=1 %s`, once.\n\n",
		o.run, strings.Join(o.pkgs, " "), o.runs, strings.Join(o.pkgs, " "))
	b.WriteString("| mutation | broken on purpose | contract runs failed | plain suite | first failure |\n|---|---|---|---|---|\n")
	defer b.WriteString(notes)
	for _, r := range rs {
		why := r.firstFail
		if r.buildError != "" {
			why = "build: " + r.buildError
		}
		fmt.Fprintf(&b, "| %s | %s | %d/%d | %s | %s |\n", r.m.name, r.m.row, r.caught, o.runs, r.plain, strings.ReplaceAll(why, "|", "\\|"))
	}
	return b.Bytes()
}

// notes explain the table.
const notes = `
Notes
- ws-not-reapplied is an equivalent mutant under per-stream workspaces: every
  rebind moves a handle to a stream with a different workspace, so bind applies
  that one whatever it believes set-stream kept. It is caught, every run, by the
  one-workspace-per-handle half of WorkspaceReappliedAfterSetStream (the CPU
  handle refuses a GEMM after set-stream dropped the workspace, as cuBLAS would
  silently run it on its default pool).
- "first failure" is the first telling line of the first failing contract run;
  the contract cases are TestContract in contract_test.go (rules x handle kinds
  x policies) and TestAPI in api_test.go.
`

func gitHead() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "unknown commit"
	}
	return "commit " + strings.TrimSpace(string(out))
}

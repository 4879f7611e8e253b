package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
)

// traceHelp is the --trace flag's help, shared by moe run, moe bench and gemm.
const traceHelp = "write a timeline of the device work (Chrome trace-event JSON: open it in ui.perfetto.dev) to this file"

// traceRun is one --trace recording: a Tracer attached to a device while the
// traced work runs.
type traceRun struct {
	path  string
	dev   *gpuctx.Device
	tr    *gpuctx.Tracer
	reads []readFile // files the run reads: the trace may not replace one
}

// startTrace attaches a new tracer to dev when path is set (nil otherwise),
// with meta as the trace's metadata.
func startTrace(dev *gpuctx.Device, path string, reads []readFile, meta map[string]string) (*traceRun, error) {
	if path == "" {
		return nil, nil
	}
	t := gpuctx.NewTracer()
	meta["backend"] = dev.Backend()
	meta["device"] = dev.Info().Name
	meta["timestamps"] = map[string]string{
		"cuda": "GPU time from timing events recorded around each operation on its stream",
		"cpu":  "wall clock when each stream's goroutine reached the events recorded around each operation",
	}[dev.Backend()]
	for k, v := range meta {
		if v != "" {
			t.SetMetadata(k, v)
		}
	}
	if err := dev.SetTracer(t); err != nil {
		return nil, fail("starting the --trace recording", "", err)
	}
	return &traceRun{path: path, dev: dev, tr: t, reads: reads}, nil
}

// pause detaches the tracer: work after it is not recorded until resume.
func (r *traceRun) pause() {
	if r != nil {
		_ = r.dev.SetTracer(nil)
	}
}

// resume attaches the tracer again.
func (r *traceRun) resume() {
	if r != nil {
		_ = r.dev.SetTracer(r.tr)
	}
}

// finish detaches the tracer, writes the trace (atomically) and releases it.
// It waits for the traced work to complete.
func (a *app) finishTrace(r *traceRun) error {
	if r == nil {
		return nil
	}
	r.pause()
	defer r.tr.Close()
	var buf bytes.Buffer
	if err := r.tr.WriteJSON(&buf); err != nil {
		return fail("reading the --trace timeline", "", err)
	}
	if err := checkOutput("--trace", r.path, r.reads); err != nil {
		return err
	}
	if err := writeOutput(r.path, buf.Bytes()); err != nil {
		return fail(fmt.Sprintf("writing --trace %s", r.path), "check that the directory is writable and has space", err)
	}
	fmt.Fprintf(a.errOut, "trace: %d operations written to %s (open it in https://ui.perfetto.dev)\n", r.tr.Spans(), r.path)
	return nil
}

// recordArgs keeps the command line for the records a run writes (the trace's
// metadata) in the app behind root's commands.
func recordArgs(root *cobra.Command, args []string) {
	root.SetContext(context.WithValue(context.Background(), argsKey{}, args))
}

// argsKey is the context key of the command line recorded by recordArgs.
type argsKey struct{}

// invocation is the command line of cmd's run as the user typed it, each
// argument shell-quoted where needed ("gpuctx moe run --model /tmp/m ..."),
// with $GPUCTX_BACKEND in front when it is set.
func invocation(cmd *cobra.Command) string {
	var args []string
	if ctx := cmd.Context(); ctx != nil {
		args, _ = ctx.Value(argsKey{}).([]string)
	}
	parts := []string{cmd.Root().Name()}
	if v := os.Getenv(gpuctx.BackendEnv); v != "" {
		parts = append([]string{gpuctx.BackendEnv + "=" + quoteArg(v)}, parts...)
	}
	for _, s := range args {
		parts = append(parts, quoteArg(s))
	}
	return strings.Join(parts, " ")
}

// quoteArg returns s as one shell word: unchanged when it needs no quoting,
// else in single quotes.
func quoteArg(s string) string {
	plain := s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune(",._-+/:=@%^", r))
	}) < 0
	if plain {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Command gpuctx is the command-line front end of the gpuctx GPU runtime: it
// reports what the runtime finds on this machine (gpuctx info) and runs its
// benchmarks.
//
// Adding a command: write one file in this directory whose init calls
//
//	register(func(a *app) *cobra.Command { return &cobra.Command{...} })
//
// Use a.openRuntime to open the backend chosen by --backend / GPUCTX_BACKEND,
// a.out for output, a.jsonOut to honour --json, and return errors from RunE
// (wrap them with fail to say what to do): main prints one line on stderr and
// exits 1 (a vendor library that cannot be loaded gets a few lines: what to do,
// then the paths tried; see loadErrorText).
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/internal/dynload"
)

// app is the state shared by every command of one invocation.
type app struct {
	backend string // --backend: "", or one of backendNames
	json    bool   // --json
	out     io.Writer
	errOut  io.Writer
}

// backendNames are the values --backend and $GPUCTX_BACKEND take, as
// gpuctx.OpenBackend accepts them; the help, the errors and the README list
// them from here (TestDocsMatchCLI).
var backendNames = []string{"auto", "cuda", "rocm", "cpu"}

// backendList is backendNames as prose: "auto, cuda, rocm or cpu".
func backendList() string {
	n := len(backendNames)
	return strings.Join(backendNames[:n-1], ", ") + " or " + backendNames[n-1]
}

// commands are the constructors registered by each command's file (init).
var commands []func(a *app) *cobra.Command

// register adds a top-level command; call it from an init function.
func register(f func(a *app) *cobra.Command) { commands = append(commands, f) }

const longHelp = `gpuctx is a pure-Go GPU runtime for inference work. Its BLAS contexts bind
their library handles (cuBLAS, cuBLASLt, rocBLAS) to the stream the caller
chose, before every call and under the handle's lock, so that work issued on a
side stream really runs there and several streams can overlap safely from many
goroutines. The vendor libraries are loaded at run time: one binary (built with
CGO_ENABLED=0) runs on a machine with an NVIDIA GPU (cuda), an AMD GPU (rocm)
or none (cpu).

Start with "gpuctx info": it prints the backend, every device and the libraries
loaded, after compiling one kernel and creating one BLAS handle.

Environment:
  GPUCTX_BACKEND           auto (default: cuda, else rocm, else cpu), cuda,
                           rocm or cpu; --backend overrides it. A forced
                           backend that is unavailable is an error, never a
                           silent fallback.
  GPUCTX_LIBRARY_PATH      colon-separated directories searched first for the
                           vendor libraries (libcuda, libcublas, libcublasLt,
                           libnvrtc; libamdhip64, libhiprtc, librocblas).
  GPUCTX_BLAS_WORKSPACE    per-stream BLAS workspace in bytes (default 32 MiB
                           on compute capability >= 9.0, else 4 MiB).
  GPUCTX_MAX_BLAS_HANDLES  BLAS handles pooled per device and math flavour
                           (default 16).
  GPUCTX_KERNEL_CACHE      directory of the compiled-kernel cache (default
                           $XDG_CACHE_HOME or ~/.cache, /gpuctx/kernels; the
                           tuning results go to its tuning/ folder, by default
                           /gpuctx/tuning), or off to compile and tune in
                           every process.`

// newRootCmd builds a fresh command tree writing to stdout and stderr.
func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	a := &app{out: stdout, errOut: stderr}
	root := &cobra.Command{
		Use:           "gpuctx",
		Short:         "Stream-safe GPU runtime for inference: device info and benchmarks",
		Long:          longHelp,
		Version:       version(),
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			b := strings.ToLower(strings.TrimSpace(a.backend))
			if b == "" || slices.Contains(backendNames, b) {
				return nil
			}
			return fail(fmt.Sprintf("--backend %q is not a backend", a.backend), "use "+backendList(), nil)
		},
	}
	root.SetVersionTemplate("gpuctx {{.Version}}\n")
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.PersistentFlags().StringVar(&a.backend, "backend", "",
		"backend to use: "+backendList()+"; unset: $GPUCTX_BACKEND, else auto")
	root.PersistentFlags().BoolVar(&a.json, "json", false, "print machine-readable JSON instead of text")
	for _, f := range commands {
		root.AddCommand(f(a))
	}
	return root
}

// run executes the command line args and returns the process exit code. Every
// failure, a panic included, becomes one line on stderr and exit code 1.
func run(args []string, stdout, stderr io.Writer) (code int) {
	defer func() {
		if p := recover(); p != nil {
			fmt.Fprintln(stderr, "gpuctx: "+oneLine(fmt.Sprintf("internal error: %v: please report it with the command line you ran", p)))
			code = 1
		}
	}()
	defer releaseBlasPreload()
	root := newRootCmd(stdout, stderr)
	root.SetArgs(args)
	recordArgs(root, args)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(stderr, errorLine(err))
		return 1
	}
	return 0
}

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// cliError is a failure with the advice to print after it: the one error type
// of the CLI and of package bench (its What, Fix and cause Err).
type cliError = bench.Error

// fail returns an error printed as "gpuctx: <what>: <cause>: <fix>".
func fail(what, fix string, err error) error { return bench.Fail(what, fix, err) }

// errorLine renders err as the stderr text "gpuctx: ...": one line, except
// when a vendor library could not be loaded (see loadErrorText). Errors that
// did not come through fail (cobra's argument and flag errors) get a pointer
// to the help.
func errorLine(err error) string {
	var le *dynload.LoadError
	if errors.As(err, &le) {
		return loadErrorText(err, le)
	}
	msg := dedupe(oneLine(err.Error()))
	var ce *cliError
	if !errors.As(err, &ce) {
		msg += ": run 'gpuctx --help' for usage"
	}
	return "gpuctx: " + msg
}

// dedupe drops the repeats that wrapping adds to an unavailable backend's
// message ("... is unavailable: cuda: backend unavailable: ...").
func dedupe(s string) string {
	for _, b := range []string{"cuda", "rocm", "cpu"} {
		s = strings.ReplaceAll(s, "unavailable: "+b+": backend unavailable: ", "unavailable: ")
	}
	return s
}

// loadErrorText lays out a failure to load a vendor library: what failed on
// the first line, then what to do (the command's advice first, then the
// loader's), then every path tried, one per line:
//
//	gpuctx: opening backend "cuda" (from --backend): cannot load CUDA driver (libcuda.so.1, libcuda.so)
//	what to do:
//	  - to run without a GPU, use --backend cpu
//	  - set GPUCTX_LIBRARY_PATH to the directory ... holding libcuda.so.1, or install the NVIDIA driver (...)
//	paths tried:
//	  libcuda.so.1: cannot open shared object file: No such file or directory
//	  /usr/local/cuda/lib64/libcuda.so.1: no such file
func loadErrorText(err error, le *dynload.LoadError) string {
	var b strings.Builder
	b.WriteString("gpuctx: ")
	var ce *cliError
	if errors.As(err, &ce) {
		b.WriteString(ce.What + ": ")
	}
	b.WriteString(le.Summary())
	b.WriteString("\nwhat to do:")
	if ce != nil && ce.Fix != "" {
		b.WriteString("\n  - " + ce.Fix)
	}
	b.WriteString("\n  - " + le.Fix())
	b.WriteString("\npaths tried:")
	for _, t := range le.Tried() {
		b.WriteString("\n  " + t)
	}
	return b.String()
}

// oneLine joins a multi-line message into one line ("; " between lines, a
// space after a line ending in ':' or '?') and drops repeated "gpuctx: "
// prefixes left by wrapped errors.
func oneLine(s string) string {
	var b strings.Builder
	for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
		if l = strings.TrimSpace(l); l == "" {
			continue
		}
		if b.Len() > 0 {
			if prev := b.String(); strings.HasSuffix(prev, ":") || strings.HasSuffix(prev, "?") {
				b.WriteString(" ")
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(l)
	}
	return strings.TrimPrefix(strings.ReplaceAll(b.String(), ": gpuctx: ", ": "), "gpuctx: ")
}

// openRuntime opens the backend named by --backend, else $GPUCTX_BACKEND,
// else auto. The caller closes the Runtime.
func (a *app) openRuntime() (*gpuctx.Runtime, error) {
	name, from := a.backend, "--backend"
	if name == "" {
		name, from = os.Getenv(gpuctx.BackendEnv), gpuctx.BackendEnv
	}
	if name == "" {
		name = "auto"
	}
	startBlasPreload(name)
	rt, err := gpuctx.OpenBackend(name)
	if err != nil {
		fix := "set " + gpuctx.BackendEnv + " or --backend to " + backendList()
		if errors.Is(err, gpuctx.ErrUnavailable) {
			fix = "to run without a GPU, use --backend cpu"
		}
		return nil, fail(fmt.Sprintf("opening backend %q (from %s)", name, from), fix, err)
	}
	return rt, nil
}

// version describes the build: the module version (or "devel"), then the
// commit (main.buildCommit when set with -ldflags "-X main.buildCommit=REV",
// else vcs.revision from the build info), the commit date (vcs.time) and
// "modified" when the work tree had uncommitted changes (vcs.modified), e.g.
// "devel (commit abc1234, 2026-12-01, modified)". go run (unless
// -buildvcs=true), builds outside a git checkout or in a git worktree (the go
// command looks for a .git directory) and builds with -buildvcs=false carry no
// commit.
func version() string {
	bi, _ := debug.ReadBuildInfo()
	return formatVersion(bi, buildCommit)
}

// pseudoVersion matches the tail of a Go pseudo-version.
var pseudoVersion = regexp.MustCompile(`\d{14}-[0-9a-f]{12}(\+dirty)?$`)

// formatVersion is version for the build info bi (may be nil) and the
// link-time commit override.
func formatVersion(bi *debug.BuildInfo, override string) string {
	v, rev, date, modified := "devel", "", "", false
	if bi != nil {
		// A tagged version is kept; the pseudo-version the go command derives
		// from the commit (v0.0.0-20261201143537-64955ab386c7[+dirty]) says
		// nothing the commit and date below do not, so it reads as devel.
		if bi.Main.Version != "" && bi.Main.Version != "(devel)" && !pseudoVersion.MatchString(bi.Main.Version) {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.time":
				if t, err := time.Parse(time.RFC3339, s.Value); err == nil {
					date = t.UTC().Format("2006-01-02")
				}
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
	}
	if override != "" {
		rev, date, modified = override, "", false
	}
	var parts []string
	if rev != "" {
		parts = append(parts, "commit "+rev[:min(len(rev), 12)])
	}
	if date != "" {
		parts = append(parts, date)
	}
	if modified {
		parts = append(parts, "modified")
	}
	if len(parts) == 0 {
		return v + " (no commit recorded: go run records one only with -buildvcs=true; go build and go install do in a git checkout, though not in a git worktree, unless -buildvcs=false; or set it with -ldflags \"-X main.buildCommit=REV\")"
	}
	return v + " (" + strings.Join(parts, ", ") + ")"
}

// jsonOut writes v as indented JSON to a.out.
func (a *app) jsonOut(v any) error {
	enc := json.NewEncoder(a.out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// openDevice opens the runtime (see openRuntime) and its device 0. The caller
// closes the Runtime.
func (a *app) openDevice() (*gpuctx.Runtime, *gpuctx.Device, error) {
	rt, err := a.openRuntime()
	if err != nil {
		return nil, nil, err
	}
	dev, err := rt.Device(0)
	if err != nil {
		_ = rt.Close()
		return nil, nil, fail("opening device 0", "check 'gpuctx info'", err)
	}
	return rt, dev, nil
}

// Package kernels is the registry of gpuctx's device kernels and holds the
// basic ones (basic.cu). A package registers its kernels once, from an init
// function, with Register: the CUDA C source file that defines them and, for
// every kernel, its parameter kinds and its Go body (the CPU twin). The
// backends stay generic: the CUDA backend compiles whatever sources are
// registered (NVRTC at run time, once per process per compute capability, so
// no CUDA toolkit is needed at build time) and the CPU backend runs the Go
// bodies. Package moe registers the Mixture-of-Experts kernels this way
// (moe/internal/moekernels).
//
// Every kernel is extern "C" (its name is not mangled) and its name starts
// with Prefix. The basic kernels use a 1-D grid-stride loop (any grid and
// block size covers all n elements) and take element counts as a 64-bit
// integer (int64 on the Go side). Launch arguments are passed in the order
// listed:
//
//	Kernel            Parameters (Go types)                              Effect
//	gpuctx_empty      ()                                                 nothing; for launch-overhead benchmarks
//	gpuctx_fill_f32   (y hal.Ptr, v float32, n int64)                    y[i] = v
//	gpuctx_axpby_f32  (y hal.Ptr, x hal.Ptr, a, b float32, n int64)      y[i] = a*x[i] + b*y[i]
//	gpuctx_add_i32    (y hal.Ptr, v int32, n int64)                      y[i] += v
//
// A Go body (Kernel.CPU) runs on the CPU stream's goroutine after Launch has
// checked the argument count and types against Kernel.Params; it computes the
// whole result (grid and block are only validated) and returns errors (bad
// pointers, bad sizes) that become the stream's sticky error. Twin builds a
// Kernel whose parameters are the fields of a struct (a field of struct type
// stands for its own fields, so that parameters can be grouped), so the body
// reads named fields; Args and Flatten list them in launch order.
//
// Register must be called from init functions only: the registry is read
// (Sources, Lookup, ...) without further synchronisation by the backends, and
// Register panics once it has been read. Everything else here is safe to use
// from any goroutine.
package kernels

import (
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
)

// Prefix is the prefix every gpuctx kernel name starts with.
const Prefix = "gpuctx_"

// Source is one CUDA C source file and the kernels it defines.
type Source struct {
	// File names the source (unique across the registry), e.g. "moe.cu"; the
	// CUDA backend compiles and loads each file as one module and names it in
	// compiler errors.
	File string
	// Text is the CUDA C source exactly as NVRTC compiles it: generated
	// preludes (limits as #define) and appended instances included.
	Text string
	// Kernels lists every extern "C" kernel of Text with its Go body, with the
	// parameter kinds of its C parameter list (CheckSignatures verifies both).
	Kernels []Kernel
	// Archs, when not empty, lists the only CUDA compute capabilities
	// (major*10 + minor, e.g. 90) the file is written for: it uses features of
	// their architecture-specific targets (sm_90a's wgmma), so the CUDA backend
	// compiles it for sm_XYa and only on those devices; elsewhere (other GPUs,
	// ROCm) its kernels are unavailable (hal.ErrUnavailable). The Go bodies
	// run on the CPU backend whatever Archs says.
	Archs []int
}

// Kernel is one kernel: its name, its parameter kinds in order and its Go body.
type Kernel struct {
	Name   string
	Params []ArgKind
	CPU    Func
}

// Func is the Go body of a kernel. args have been checked against the
// kernel's Params, so a body may type-assert them (Twin does it for you).
type Func func(m Memory, args []any) error

// registry holds registered sources and kernels.
type registry struct {
	mu      sync.Mutex
	read    bool              // set by the first reader; Register panics after
	sources map[string]string // file -> text
	archs   map[string][]int  // file -> Source.Archs, for files that have them
	kernels map[string]entry  // kernel name -> kernel and file
}

type entry struct {
	k    Kernel
	file string
}

// std is the process-wide registry.
var std registry

// Register adds a source file and its kernels. Call it from init functions
// only. It panics on a repeated file or kernel name, a name without Prefix, a
// kernel without a Go body, or a call after the registry has been read: all
// programming errors that any test of the registering package catches.
func Register(s Source) { std.register(s) }

func (r *registry) register(s Source) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.read {
		panic("kernels: Register(" + s.File + ") after the registry was read: register from an init function")
	}
	if s.File == "" {
		panic("kernels: Register: empty file name")
	}
	if _, dup := r.sources[s.File]; dup {
		panic("kernels: source " + s.File + " registered twice")
	}
	for i, k := range s.Kernels {
		switch {
		case !strings.HasPrefix(k.Name, Prefix):
			panic(fmt.Sprintf("kernels: %s: kernel %q lacks the %q prefix", s.File, k.Name, Prefix))
		case k.CPU == nil:
			panic(fmt.Sprintf("kernels: %s: kernel %s has no Go body", s.File, k.Name))
		}
		if e, dup := r.kernels[k.Name]; dup {
			panic(fmt.Sprintf("kernels: kernel %s registered by both %s and %s", k.Name, e.file, s.File))
		}
		for _, o := range s.Kernels[:i] {
			if o.Name == k.Name {
				panic(fmt.Sprintf("kernels: kernel %s listed twice in %s", k.Name, s.File))
			}
		}
	}
	if r.sources == nil {
		r.sources, r.archs, r.kernels = map[string]string{}, map[string][]int{}, map[string]entry{}
	}
	r.sources[s.File] = s.Text
	if len(s.Archs) > 0 {
		r.archs[s.File] = append([]int(nil), s.Archs...)
	}
	for _, k := range s.Kernels {
		k.Params = append([]ArgKind(nil), k.Params...)
		r.kernels[k.Name] = entry{k: k, file: s.File}
	}
}

// snapshot marks the registry read and returns its maps (never modified
// afterwards).
func (r *registry) snapshot() (map[string]string, map[string]entry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.read = true
	return r.sources, r.kernels
}

// Sources returns a fresh map from file name (e.g. "basic.cu") to the CUDA C
// text of every registered source.
func Sources() map[string]string {
	srcs, _ := std.snapshot()
	out := make(map[string]string, len(srcs))
	for f, t := range srcs {
		out[f] = t
	}
	return out
}

// Archs returns the Source.Archs of file: nil when the file compiles for
// every architecture.
func Archs(file string) []int {
	std.snapshot()
	return append([]int(nil), std.archs[file]...)
}

// Lookup returns the registered kernel name and the file that defines it.
func Lookup(name string) (k Kernel, file string, ok bool) {
	_, ks := std.snapshot()
	e, ok := ks[name]
	return e.k, e.file, ok
}

// kernelDecl matches an extern "C" __global__ kernel definition and captures its name.
var kernelDecl = regexp.MustCompile(`extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?void\s+(\w+)\s*\(`)

// Index returns the names of the kernels declared extern "C" __global__ in
// src, in source order.
func Index(src string) []string {
	var names []string
	for _, m := range kernelDecl.FindAllStringSubmatch(src, -1) {
		names = append(names, m[1])
	}
	return names
}

// paramLists returns, for every kernel defined in src, the text of its
// parameter list (between the parentheses).
func paramLists(src string) map[string]string {
	out := map[string]string{}
	for _, m := range kernelDecl.FindAllStringSubmatchIndex(src, -1) {
		name := src[m[2]:m[3]]
		depth, end := 1, len(src)
		for i, r := range src[m[1]:] {
			if r == '(' {
				depth++
			} else if r == ')' {
				if depth--; depth == 0 {
					end = m[1] + i
					break
				}
			}
		}
		out[name] = src[m[1]:end]
	}
	return out
}

// splitParams splits a C parameter list at its top-level commas; an empty
// list has no parameters.
func splitParams(list string) []string {
	if strings.TrimSpace(list) == "" || strings.TrimSpace(list) == "void" {
		return nil
	}
	var out []string
	depth, start := 0, 0
	for i, r := range list {
		switch r {
		case '(':
			depth++
		case ')':
			depth--
		case ',':
			if depth == 0 {
				out = append(out, list[start:i])
				start = i + 1
			}
		}
	}
	return append(out, list[start:])
}

// ParamCounts returns a fresh map from kernel name to the number of
// parameters in its definition, for every kernel of every registered source.
func ParamCounts() map[string]int {
	out := map[string]int{}
	for _, src := range Sources() {
		for name, list := range paramLists(src) {
			out[name] = len(splitParams(list))
		}
	}
	return out
}

// Files returns a fresh map from kernel name to the registered source file
// that defines it (parsed from the CUDA C text).
func Files() map[string]string {
	out := map[string]string{}
	for file, src := range Sources() {
		for _, n := range Index(src) {
			out[n] = file
		}
	}
	return out
}

// Names returns every kernel name defined by a registered source, sorted.
func Names() []string {
	var out []string
	for n := range Files() {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// cKinds returns the parameter kinds of a C parameter list.
func cKinds(list string) ([]ArgKind, error) {
	var out []ArgKind
	for _, p := range splitParams(list) {
		p = strings.Join(strings.Fields(p), " ")
		p = strings.TrimPrefix(p, "const ")
		var k ArgKind
		switch {
		case strings.Contains(p, "*"):
			k = ArgPtr
		case strings.HasPrefix(p, "unsigned long long "):
			k = ArgU64
		case strings.HasPrefix(p, "long long "):
			k = ArgI64
		case strings.HasPrefix(p, "unsigned int ") || strings.HasPrefix(p, "unsigned "):
			k = ArgU32
		case strings.HasPrefix(p, "int "):
			k = ArgI32
		case strings.HasPrefix(p, "float "):
			k = ArgF32
		case strings.HasPrefix(p, "double "):
			k = ArgF64
		default:
			return nil, fmt.Errorf("parameter %q has a C type with no ArgKind", p)
		}
		out = append(out, k)
	}
	return out, nil
}

// CheckSignatures reports every mismatch between the registered CUDA sources
// and the registered kernels: a kernel a source defines that has no Go body,
// a Go body whose source does not define it, and parameter kinds that differ
// from the C parameter list. A launch that passes the CPU backend's checks
// then passes the same arguments to CUDA. It returns nil when all agree.
func CheckSignatures() error {
	srcs, ks := std.snapshot()
	return checkSignatures(srcs, ks)
}

func checkSignatures(srcs map[string]string, ks map[string]entry) error {
	var errs []string
	defined := map[string]bool{}
	for file, src := range srcs {
		for name, list := range paramLists(src) {
			defined[name] = true
			e, ok := ks[name]
			if !ok {
				errs = append(errs, fmt.Sprintf("%s (%s) has no Go body", name, file))
				continue
			}
			if e.file != file {
				errs = append(errs, fmt.Sprintf("%s is defined in %s but registered with %s", name, file, e.file))
			}
			want, err := cKinds(list)
			if err != nil {
				errs = append(errs, fmt.Sprintf("%s (%s): %v", name, file, err))
				continue
			}
			if !slices.Equal(e.k.Params, want) {
				errs = append(errs, fmt.Sprintf("%s: Go parameters %v, CUDA source %v", name, e.k.Params, want))
			}
		}
	}
	for name, e := range ks {
		if !defined[name] {
			errs = append(errs, fmt.Sprintf("%s is registered with %s, which does not define it", name, e.file))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	sort.Strings(errs)
	return fmt.Errorf("kernels: %d signature mismatches:\n%s", len(errs), strings.Join(errs, "\n"))
}

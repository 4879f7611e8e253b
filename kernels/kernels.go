// Package kernels holds the CUDA C sources of gpuctx's own device kernels. They
// are embedded in the binary and compiled at run time (NVRTC on CUDA, once per
// process per compute capability), so no CUDA toolkit is needed at build time.
// The CPU backend implements the same kernel names in Go.
//
// Every kernel is extern "C" (its name is not mangled), uses a 1-D grid-stride
// loop (any grid and block size covers all n elements), and takes element
// counts as a 64-bit integer (int64 on the Go side). Launch arguments are
// passed in the order listed:
//
//	Kernel            Parameters (Go types)                              Effect
//	gpuctx_empty      ()                                                 nothing; for launch-overhead benchmarks
//	gpuctx_fill_f32   (y hal.Ptr, v float32, n int64)                    y[i] = v
//	gpuctx_axpby_f32  (y hal.Ptr, x hal.Ptr, a, b float32, n int64)      y[i] = a*x[i] + b*y[i]
//	gpuctx_add_i32    (y hal.Ptr, v int32, n int64)                      y[i] += v
//
// Everything here is read-only data and safe to use from any goroutine.
package kernels

import (
	"embed"
	"regexp"
	"sort"
	"strings"
)

//go:embed *.cu
var files embed.FS

// Sources returns a fresh map from file name (e.g. "basic.cu") to its CUDA C
// source text.
func Sources() map[string]string {
	ents, err := files.ReadDir(".")
	if err != nil {
		return map[string]string{}
	}
	out := make(map[string]string, len(ents))
	for _, e := range ents {
		b, err := files.ReadFile(e.Name())
		if err != nil {
			continue
		}
		out[e.Name()] = string(b)
	}
	return out
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

// Files returns a fresh map from kernel name to the file that defines it.
func Files() map[string]string {
	out := map[string]string{}
	for file, src := range Sources() {
		for _, n := range Index(src) {
			out[n] = file
		}
	}
	return out
}

// Names returns every kernel name, sorted.
func Names() []string {
	var out []string
	for n := range Files() {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Prefix is the prefix every gpuctx kernel name starts with.
const Prefix = "gpuctx_"

// valid reports whether name looks like a gpuctx kernel name.
func valid(name string) bool { return strings.HasPrefix(name, Prefix) }

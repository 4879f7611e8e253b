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
// The Mixture-of-Experts kernels of moe.cu (driven by package moe) take int32
// dimensions and flags (0/1) instead, and some need a fixed launch shape.
// "act" pointers hold f32, or bf16 bits when bf16 = 1 (elem_bytes 4 or 2);
// all math is f32 with a fixed summation order, bf16 stores round to nearest
// even. E <= 512 experts, K <= 16 per token.
//
//	gpuctx_moe_route    (logits, bias, topk_idx, topk_w hal.Ptr, T, E, K, scoring, method,
//	                     groups, topk_groups, has_bias, norm int32, norm_eps, scale float32,
//	                     ks, ns int32)
//	    per token: scores = softmax (scoring 0) or sigmoid (1) of logits [T,E] f32;
//	    choice = scores + bias[E] f32 if has_bias; method 1 (group_limited_greedy):
//	    group score = max choice, method 2 (noaux_tc): sum of the top 2; keep
//	    topk_groups groups, other choices = 0; top-K of choice (ties: lower index)
//	    -> topk_idx [T,K] i32; weight = score (method 2) or choice, / (sum+norm_eps)
//	    if norm, * scale -> topk_w [T,K] f32. Rows have stride ks >= K+ns; slots
//	    K..K+ns-1 get the shared experts E..E+ns-1 with weight 1. Block (32,1,1), any grid.
//	gpuctx_moe_plan     (topk_idx, counts, offsets, pos hal.Ptr, TK, E int32)
//	    stable counting sort of TK assignments by expert: counts [E], offsets
//	    [E+1] (exclusive prefix), pos [TK] = row of assignment t*K+k (-1 if its
//	    expert is out of range). Grid (1,1,1), block (256,1,1).
//	gpuctx_moe_gather   (x, pos, xp hal.Ptr, TK, K, H, elem_bytes int32)
//	    xp[pos[a], :] = x[a/K, :] for rows of H elements. Any grid and block.
//	gpuctx_moe_swiglu   (h, act hal.Ptr, rows, I, bf16 int32)
//	    act[r,i] = silu(h[r,i]) * h[r,I+i], h [rows,2I] -> act [rows,I]. Any shape.
//	gpuctx_moe_combine  (out, pos, w, shared, gate, y hal.Ptr, T, K, H, has_routed,
//	                     has_shared, has_gate, bf16 int32)
//	    y[t,:] = sum_k w[t,k]*out[pos[t,k],:] (k ascending, pos -1 skipped) +
//	    sigmoid(gate[t]) (or 1 without has_gate) * shared[t,:]; gate f32 [T].
//	    Pointers of absent parts are not read. Any grid and block.
//	gpuctx_moe_expert_up   (xp, gu, counts, offsets, act hal.Ptr, E, H, I, bf16 int32)
//	    for each expert e and row r of its plan rows: act[r,i] = silu(g)*u with
//	    g = xp[r,:].gu[e,i,:], u = xp[r,:].gu[e,I+i,:], both rounded to the dtype.
//	    H, I multiples of 8. Grid (ceil(I/8), E), block 256.
//	gpuctx_moe_expert_down (act, down, counts, offsets, out hal.Ptr, E, H, I, bf16 int32)
//	    out[r,h] = act[r,:].down[e,h,:] for each expert's plan rows. Grid
//	    (ceil(H/8), E), block 256.
//
// The fused routed path (graph-capturable: no host round trip) sorts the
// assignments into blocks of BM rows per expert, runs the grouped expert GEMMs
// of moe_gemm.cu on them (gpuctx_moe_up_<tag>, gpuctx_moe_down_<tag>, one pair
// per tile config; see MoEGemm) and combines the rows in assignment order:
//
//	gpuctx_moe_align    (topk_idx, sorted, block_expert, npost hal.Ptr, TK, E, BM, cap int32)
//	    stable sort of the TK assignments (topk_idx [TK] i32; out-of-range experts
//	    skipped) into per-expert segments, experts in order, each padded to a
//	    multiple of BM rows (empty experts get none): sorted [cap] = assignment
//	    of each row, TK for padding and for every row from npost to cap;
//	    block_expert [cap/BM] = expert of each block, -1 from npost/BM on;
//	    npost [1] = padded row count. E <= 512, cap a multiple of BM and at
//	    least npost; size it roundup(TK + min(E,TK)*(BM-1), BM). Grid (1,1,1),
//	    block (512,1,1).
//	gpuctx_moe_combine_rows (out, w, shared, gate, y hal.Ptr, T, K, H, has_routed,
//	                     has_shared, has_gate, bf16 int32)
//	    gpuctx_moe_combine with pos[t,k] = t*K+k: y[t,:] = sum_k w[t,k]*out[t*K+k,:]
//	    + sigmoid(gate[t]) (or 1) * shared[t,:]. Any grid and block.
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
	if src, ok := out[MoEGemmFile]; ok {
		out[MoEGemmFile] = src + moeGemmInstances()
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

// ParamCounts returns a fresh map from kernel name to the number of
// parameters in its definition, for every kernel of every source file.
func ParamCounts() map[string]int {
	out := map[string]int{}
	for _, src := range Sources() {
		for _, m := range kernelDecl.FindAllStringSubmatchIndex(src, -1) {
			name := src[m[2]:m[3]]
			depth, n, empty := 1, 1, true
			for _, r := range src[m[1]:] {
				if r == '(' {
					depth++
				} else if r == ')' {
					if depth--; depth == 0 {
						break
					}
				} else if r == ',' && depth == 1 {
					n++
				} else if r != ' ' && r != '\n' && r != '\t' {
					empty = false
				}
			}
			if empty {
				n = 0
			}
			out[name] = n
		}
	}
	return out
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

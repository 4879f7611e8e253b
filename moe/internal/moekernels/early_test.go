package moekernels

import (
	"regexp"
	"slices"
	"strings"
	"testing"
)

// function returns the names of the pointer parameters and the body (between
// its braces) of the function or kernel called name in src, or ok false.
// Parameters passed by value (sizes, flags) are left out: reading them
// before a kernel's wait cannot race with the kernel ahead.
func function(src, name string) (params []string, body string, ok bool) {
	i := strings.Index(src, " "+name+"(")
	if i < 0 {
		return nil, "", false
	}
	i += len(name) + 2
	depth, j := 1, i
	for ; j < len(src) && depth > 0; j++ {
		switch src[j] {
		case '(':
			depth++
		case ')':
			depth--
		}
	}
	for _, p := range strings.Split(src[i:j-1], ",") {
		if f := strings.Fields(strings.TrimSpace(p)); len(f) > 0 && strings.Contains(p, "*") {
			params = append(params, strings.TrimLeft(f[len(f)-1], "*&"))
		}
	}
	k := strings.IndexByte(src[j:], '{')
	if k < 0 {
		return nil, "", false
	}
	start := j + k + 1
	depth = 1
	for j = start; j < len(src) && depth > 0; j++ {
		switch src[j] {
		case '{':
			depth++
		case '}':
			depth--
		}
	}
	return params, src[start : j-1], true
}

// TestWaitsFirst checks in the sources as compiled that every kernel
// WaitsFirst accepts calls MOE_GRID_WAIT() before it mentions any of its
// pointer parameters (for a generated GEMM instance: in the template it
// calls), so that launching it early cannot read what the kernel ahead of it
// is still writing; and that WaitsFirst refuses kernels that do not wait.
// The expert GEMM templates wait in moe_tile_begin (moe_tile.cuh), which the
// test follows.
// The one planned exception is the up kernel's blocks of fused shared-expert
// rows (moe_shared_rows), which run on without the wait: the test checks that
// moe_shared_rows takes no pointer but the block's own row tables, so what
// those blocks read is x and the weights only (moe_tile.cuh says why that is
// safe).
// usedBefore reports each of params that code mentions (outside comments and
// strings) as used before kernel name's MOE_GRID_WAIT().
func usedBefore(t *testing.T, name, code string, params []string) {
	t.Helper()
	code = regexp.MustCompile(`//[^\n]*|"[^"\n]*"`).ReplaceAllString(code, "")
	for _, p := range params {
		if regexp.MustCompile(`\b` + regexp.QuoteMeta(p) + `\b`).MatchString(code) {
			t.Errorf("%s: parameter %s is used before MOE_GRID_WAIT()", name, p)
		}
	}
}

func TestWaitsFirst(t *testing.T) {
	srcs := []string{RouteSource(), GemmSource(), WgmmaSource(), FP8MMASource(), W8A8Source()}
	names := append([]string(nil), earlyKernels...)
	for _, c := range MoEGemms {
		if c.HasUp() {
			names = append(names, c.UpName())
		}
		names = append(names, c.DownName())
	}
	for _, c := range FP8Gemms {
		names = append(names, c.UpName(), c.DownName())
	}
	names = append(names, FP8QuantName)
	for _, c := range W8A8Gemms {
		names = append(names, c.Name())
	}
	instance := regexp.MustCompile(`^\s*(\w+)<[^;]*>\([^;]*\);\s*$`)
	for _, name := range names {
		if !WaitsFirst(name) {
			t.Errorf("WaitsFirst(%q) = false", name)
		}
		var params []string
		var body, src string
		for _, s := range srcs {
			if p, b, ok := function(s, name); ok {
				params, body, src = p, b, s
				break
			}
		}
		if src == "" {
			t.Errorf("%s: not found in the sources", name)
			continue
		}
		if m := instance.FindStringSubmatch(body); m != nil { // a generated instance
			var ok bool
			if params, body, ok = function(src, m[1]); !ok {
				t.Errorf("%s: template %s not found", name, m[1])
				continue
			}
		}
		waitsBeforeUse(t, name, src, params, body)
	}
	params, _, ok := function(GemmSource(), "moe_shared_rows")
	if !ok || !slices.Equal(params, []string{"row_src", "row_dst"}) {
		t.Errorf("moe_shared_rows: pointer parameters %v (found %v), want only the row tables [row_src row_dst]", params, ok)
	}
	for _, name := range []string{"gpuctx_moe_swiglu", "gpuctx_moe_gather", "gpuctx_moe_combine", "gpuctx_moe_plan", "gpuctx_moe_expert_up"} {
		if WaitsFirst(name) {
			t.Errorf("WaitsFirst(%q) = true; it does not wait", name)
		}
	}
}

// waitHelpers are the functions of moe_tile.cuh through which the expert
// GEMM templates wait: moe_tile_begin, and moe_tile_expert, which it calls.
var waitHelpers = []string{"moe_tile_begin", "moe_tile_expert"}

// waitsBeforeUse checks that kernel name's code body (params its pointer
// parameters) mentions none of them before MOE_GRID_WAIT(), following a
// call to a wait helper that comes first into the helper's body, where only
// the block's own row tables may be touched before the wait.
func waitsBeforeUse(t *testing.T, name, src string, params []string, body string) {
	t.Helper()
	var own []string
	for depth := 0; depth < 4; depth++ {
		global := slices.DeleteFunc(slices.Clone(params), func(p string) bool { return slices.Contains(own, p) })
		w := strings.Index(body, "MOE_GRID_WAIT();")
		h, helper := -1, ""
		for _, hn := range waitHelpers {
			if i := strings.Index(body, hn+"<"); i >= 0 && (h < 0 || i < h) {
				h, helper = i, hn
			}
		}
		if h >= 0 && (w < 0 || h < w) {
			usedBefore(t, name, body[:h], global)
			var ok bool
			if params, body, ok = function(src, helper); !ok {
				t.Errorf("%s: %s not found", name, helper)
				return
			}
			own = []string{"row_src", "row_dst"}
			continue
		}
		if w < 0 {
			t.Errorf("%s: no MOE_GRID_WAIT()", name)
			return
		}
		usedBefore(t, name, body[:w], global)
		return
	}
	t.Errorf("%s: wait helpers nested too deep", name)
}

package moekernels

import (
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/kernels"
)

// launchSync launches kernel name on a new stream with args and waits; it
// returns the stream's error.
func launchSync(t *testing.T, d *device, name string, args ...any) error {
	t.Helper()
	s, err := d.dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatalf("NewStream: %v", err)
	}
	if err := s.Launch(mustKernel(t, d, name), one, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0, args...); err != nil {
		return err
	}
	return s.Synchronize()
}

func alloc(t *testing.T, d *device, n int) Ptr {
	t.Helper()
	p, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func sig64(v float64) float64 { return 1 / (1 + math.Exp(-v)) }

func softmax64(l []float64) []float64 {
	m := math.Inf(-1)
	for _, v := range l {
		m = max(m, v)
	}
	var s float64
	out := make([]float64, len(l))
	for i, v := range l {
		out[i] = math.Exp(v - m)
		s += out[i]
	}
	for i := range out {
		out[i] /= s
	}
	return out
}

// TestMoERoute checks gpuctx_moe_route on hand-made tokens where the grouped
// selections differ from a plain top-k, and on exact ties.
func TestMoERoute(t *testing.T) {
	d := newTestDevice(t)
	type args struct{ scoring, method, groups, topkGroups, hasBias, norm int32 }
	sm := softmax64([]float64{2, -5, 1.5, 1.4, 0, 0, 1.6, -2})
	s1 := sig64(1)
	tests := []struct {
		name    string
		logits  []float32
		bias    []float32
		K       int
		a       args
		eps     float32
		scale   float32
		wantIdx []int32
		wantW   []float64
	}{
		{
			// Exact tie between experts 1 and 2: the lower index comes first.
			name: "softmax greedy ties", logits: []float32{0, 1, 1, 0.5}, K: 2,
			a: args{0, 0, 1, 1, 0, 0}, scale: 1, wantIdx: []int32{1, 2},
			wantW: []float64{softmax64([]float64{0, 1, 1, 0.5})[1], softmax64([]float64{0, 1, 1, 0.5})[2]},
		},
		{
			// group_limited_greedy, 4 groups of 2, keep 2: groups {0,1} (max
			// score of expert 0) and {6,7} (expert 6); experts 2 and 3 are masked
			// although they beat expert 7.
			name: "group max", logits: []float32{2, -5, 1.5, 1.4, 0, 0, 1.6, -2}, K: 3,
			a: args{0, 1, 4, 2, 0, 0}, scale: 1.5, wantIdx: []int32{0, 6, 7},
			wantW: []float64{sm[0] * 1.5, sm[6] * 1.5, sm[7] * 1.5},
		},
		{
			// noaux_tc: group top-2 sums 1.00, 1.56 (with bias 0.1 on expert 3),
			// 1.00, 1.15: keep groups 1 and 3. Expert 0 has the top score but is
			// masked; expert 3 wins over 2 through its bias; weights are the
			// unbiased sigmoids, renormalised, times 2.5.
			name: "noaux_tc", logits: []float32{3, -3, 1, 1, 0, 0, -1, 2}, bias: []float32{0, 0, 0, 0.1, 0, 0, 0, 0}, K: 2,
			a: args{1, 2, 4, 2, 1, 1}, eps: 1e-20, scale: 2.5, wantIdx: []int32{7, 3},
			wantW: []float64{sig64(2) / (sig64(2) + s1) * 2.5, s1 / (sig64(2) + s1) * 2.5},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			E, K := len(tc.logits), tc.K
			// Two tokens: the second is the first reversed, so indices mirror.
			logits := append(slices.Clone(tc.logits), tc.logits...)
			slices.Reverse(logits[E:])
			bias := tc.bias
			if bias == nil {
				bias = make([]float32, E)
			}
			lp, bp := upload(t, d, asBytes(logits)), upload(t, d, asBytes(bias))
			ip, wp := alloc(t, d, 4*2*K), alloc(t, d, 4*2*K)
			a := tc.a
			if err := launchSync(t, d, "gpuctx_moe_route", lp, bp, ip, wp, int32(2), int32(E), int32(K),
				a.scoring, a.method, a.groups, a.topkGroups, a.hasBias, a.norm, tc.eps, tc.scale, int32(K), int32(0)); err != nil {
				t.Fatal(err)
			}
			idx := fromBytes[int32](download(t, d, ip, 4*2*K))
			w := fromBytes[float32](download(t, d, wp, 4*2*K))
			if !slices.Equal(idx[:K], tc.wantIdx) {
				t.Fatalf("token 0 experts %v, want %v", idx[:K], tc.wantIdx)
			}
			for k := range K {
				if math.Abs(float64(w[k])-tc.wantW[k]) > 1e-6*math.Max(1, tc.wantW[k]) {
					t.Errorf("token 0 weight %d = %v, want %v", k, w[k], tc.wantW[k])
				}
			}
			// Token 1 (reversed logits) picks the mirrored experts when nothing
			// breaks the symmetry (no bias, no tie).
			if tc.bias == nil && tc.name != "softmax greedy ties" {
				for k := range K {
					if got, want := idx[K+k], int32(E-1)-tc.wantIdx[k]; got != want {
						t.Errorf("token 1 expert %d = %d, want %d", k, got, want)
					}
					if math.Abs(float64(w[K+k]-w[k])) > 1e-7 {
						t.Errorf("token 1 weight %d = %v, token 0 has %v", k, w[K+k], w[k])
					}
				}
			}
		})
	}
}

// TestMoEPlan checks the stable counting sort, including an invalid index.
func TestMoEPlan(t *testing.T) {
	d := newTestDevice(t)
	idx := []int32{3, 1, 0, 3, 3, 2, 1, 0, 3, 1, 9}
	const E = 4
	ip := upload(t, d, asBytes(idx))
	cp, op, pp := alloc(t, d, 4*E), alloc(t, d, 4*(E+1)), alloc(t, d, 4*len(idx))
	if err := launchSync(t, d, "gpuctx_moe_plan", ip, cp, op, pp, int32(len(idx)), int32(E)); err != nil {
		t.Fatal(err)
	}
	if got := fromBytes[int32](download(t, d, cp, 4*E)); !slices.Equal(got, []int32{2, 3, 1, 4}) {
		t.Errorf("counts %v", got)
	}
	if got := fromBytes[int32](download(t, d, op, 4*(E+1))); !slices.Equal(got, []int32{0, 2, 5, 6, 10}) {
		t.Errorf("offsets %v", got)
	}
	if got := fromBytes[int32](download(t, d, pp, 4*len(idx))); !slices.Equal(got, []int32{6, 2, 0, 7, 8, 5, 3, 1, 9, 4, -1}) {
		t.Errorf("pos %v", got)
	}
}

// TestMoEGatherSwigluCombine checks the row kernels in f32 and bf16.
func TestMoEGatherSwigluCombine(t *testing.T) {
	d := newTestDevice(t)
	for _, bf := range []int32{0, 1} {
		name := map[int32]string{0: "f32", 1: "bf16"}[bf]
		// put/get store and read activations in the tested dtype.
		put := func(v []float32) Ptr {
			if bf == 0 {
				return upload(t, d, asBytes(v))
			}
			h := make([]uint16, len(v))
			for i, x := range v {
				h[i] = f32ToBF16(x)
			}
			return upload(t, d, asBytes(h))
		}
		get := func(p Ptr, n int) []float32 {
			if bf == 0 {
				return fromBytes[float32](download(t, d, p, 4*n))
			}
			h := fromBytes[uint16](download(t, d, p, 2*n))
			out := make([]float32, n)
			for i, x := range h {
				out[i] = bf16ToF32(x)
			}
			return out
		}
		round := func(v float32) float32 {
			if bf == 0 {
				return v
			}
			return bf16ToF32(f32ToBF16(v))
		}
		eb := int32(4 - 2*bf)
		t.Run(name+"/gather", func(t *testing.T) {
			x := put([]float32{1, 2, 3, 4, 5, 6}) // T=3, H=2
			pos := upload(t, d, asBytes([]int32{4, 0, 5, 1, -1, 2}))
			xp := put(make([]float32, 12))
			if err := launchSync(t, d, "gpuctx_moe_gather", x, pos, xp, int32(6), int32(2), int32(2), eb); err != nil {
				t.Fatal(err)
			}
			want := []float32{1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3, 4}
			if got := get(xp, 12); !slices.Equal(got, want) {
				t.Errorf("xp %v, want %v", got, want)
			}
		})
		t.Run(name+"/swiglu", func(t *testing.T) {
			hv := []float32{1, -2, 3, 0.5, 0.25, 4, -1, 2} // rows 2, I 2
			h := put(hv)
			act := put(make([]float32, 4))
			if err := launchSync(t, d, "gpuctx_moe_swiglu", h, act, int32(2), int32(2), bf); err != nil {
				t.Fatal(err)
			}
			got := get(act, 4)
			for r := range 2 {
				for i := range 2 {
					g, u := round(hv[r*4+i]), round(hv[r*4+2+i])
					want := round(float32(float64(g) / (1 + math.Exp(-float64(g))) * float64(u)))
					if math.Abs(float64(got[r*2+i]-want)) > 1e-6*math.Max(1, math.Abs(float64(want)))+float64(bf)*1e-2*math.Abs(float64(want)) {
						t.Errorf("act[%d,%d] = %v, want %v", r, i, got[r*2+i], want)
					}
				}
			}
		})
		t.Run(name+"/combine", func(t *testing.T) {
			// T=2, K=2, H=3; token 0's second choice is absent (pos -1).
			outv := []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
			out := put(outv)
			pos := upload(t, d, asBytes([]int32{2, -1, 0, 3}))
			w := upload(t, d, asBytes([]float32{0.5, 9, 0.25, 2}))
			shv := []float32{1, 1, 1, -2, -2, -2}
			sh := put(shv)
			gate := upload(t, d, asBytes([]float32{0, 100}))
			y := put(make([]float32, 6))
			for _, c := range []struct {
				routed, shared, gated int32
				want                  []float32
			}{
				{1, 1, 1, []float32{0.5*7 + 0.5, 0.5*8 + 0.5, 0.5*9 + 0.5, 0.25*1 + 2*10 - 2, 0.25*2 + 2*11 - 2, 0.25*3 + 2*12 - 2}},
				{1, 0, 0, []float32{0.5 * 7, 0.5 * 8, 0.5 * 9, 0.25*1 + 2*10, 0.25*2 + 2*11, 0.25*3 + 2*12}},
				{0, 1, 0, []float32{1, 1, 1, -2, -2, -2}},
			} {
				if err := launchSync(t, d, "gpuctx_moe_combine", out, pos, w, sh, gate, y, int32(2), int32(2), int32(3),
					c.routed, c.shared, c.gated, bf); err != nil {
					t.Fatal(err)
				}
				got := get(y, 6)
				for i := range got {
					if want := round(c.want[i]); math.Abs(float64(got[i]-want)) > 1e-6*math.Max(1, math.Abs(float64(want))) {
						t.Errorf("routed=%d shared=%d gated=%d: y %v, want %v", c.routed, c.shared, c.gated, got, c.want)
						break
					}
				}
			}
		})
	}
}

// TestMoEKernelErrors checks that bad sizes and indices become stream errors
// naming the kernel instead of out-of-range accesses.
func TestMoEKernelErrors(t *testing.T) {
	d := newTestDevice(t)
	// A failed kernel loses the device (as a sticky CUDA error does): each
	// case runs on a device of its own.
	buf := &bufArg{}
	tests := []struct {
		name, kernel string
		args         []any
		want         string
	}{
		{"too many experts", "gpuctx_moe_route", []any{buf, buf, buf, buf, int32(1), int32(600), int32(2), int32(0), int32(0),
			int32(1), int32(1), int32(0), int32(0), float32(0), float32(1), int32(2), int32(0)}, "E=600"},
		{"groups do not divide", "gpuctx_moe_route", []any{buf, buf, buf, buf, int32(1), int32(8), int32(2), int32(0), int32(1),
			int32(3), int32(1), int32(0), int32(0), float32(0), float32(1), int32(2), int32(0)}, "groups=3"},
		{"logits outside the buffer", "gpuctx_moe_route", []any{buf, buf, buf, buf, int32(100), int32(64), int32(2), int32(0), int32(0),
			int32(1), int32(1), int32(0), int32(0), float32(0), float32(1), int32(2), int32(0)}, "logits"},
		{"shared slots do not fit", "gpuctx_moe_route", []any{buf, buf, buf, buf, int32(1), int32(8), int32(2), int32(0), int32(0),
			int32(1), int32(1), int32(0), int32(0), float32(0), float32(1), int32(3), int32(2)}, "ks=3"},
		{"plan without experts", "gpuctx_moe_plan", []any{buf, buf, buf, buf, int32(4), int32(0)}, "E=0"},
		{"gather bad element size", "gpuctx_moe_gather", []any{buf, buf, buf, int32(1), int32(1), int32(1), int32(3)}, "elem_bytes=3"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDevice(t)
			args := append([]any(nil), tc.args...)
			for i, a := range args {
				if a == buf {
					args[i] = alloc(t, d, 4096)
				}
			}
			err := launchSync(t, d, tc.kernel, args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.kernel) {
				t.Fatalf("got %v, want an error naming %s and containing %q", err, tc.kernel, tc.want)
			}
		})
	}
	// A position outside xp.
	x := upload(t, d, asBytes([]float32{1, 2}))
	pos := upload(t, d, asBytes([]int32{5}))
	xp := alloc(t, d, 8)
	if err := launchSync(t, d, "gpuctx_moe_gather", x, pos, xp, int32(1), int32(1), int32(2), int32(4)); err == nil || !strings.Contains(err.Error(), "pos[0] = 5") {
		t.Errorf("gather with pos out of range: %v", err)
	}
}

// TestKernelSignaturesMatchCUDA checks that every kernel of the registered
// CUDA sources (this package's and the basic ones) has a Go body with the
// parameter kinds of its C parameter list, so that a launch that works on the
// CPU backend passes the same arguments on CUDA, and that this package's
// sources define every MoE kernel package moe looks up.
func TestKernelSignaturesMatchCUDA(t *testing.T) {
	if err := kernels.CheckSignatures(); err != nil {
		t.Fatal(err)
	}
	files := kernels.Files()
	want := []string{"gpuctx_moe_route", "gpuctx_moe_plan", "gpuctx_moe_gather", "gpuctx_moe_swiglu",
		"gpuctx_moe_combine", "gpuctx_moe_expert_up", "gpuctx_moe_expert_down", "gpuctx_moe_align",
		"gpuctx_moe_combine_rows", "gpuctx_moe_route_align"}
	for _, name := range want {
		if f := files[name]; f != RouteFile {
			t.Errorf("%s defined in %q, want %s", name, f, RouteFile)
		}
		if _, _, ok := kernels.Lookup(name); !ok {
			t.Errorf("%s has no Go body", name)
		}
	}
	want = nil
	for _, c := range MoEGemms {
		if c.HasUp() {
			want = append(want, c.UpName())
		}
		want = append(want, c.DownName())
	}
	for _, name := range want {
		if f := files[name]; !strings.HasPrefix(f, "moe_gemm_m") && !strings.HasPrefix(f, "moe_wgmma_m") {
			t.Errorf("%s defined in %q, want its tile's unit", name, f)
		}
		if _, _, ok := kernels.Lookup(name); !ok {
			t.Errorf("%s has no Go body", name)
		}
	}
}

// bufArg stands for a 4 KiB buffer of the device a case runs on.
type bufArg struct{}

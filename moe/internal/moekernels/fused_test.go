package moekernels

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// poison32 and poisonBF16 fill outputs before a launch, so that a test sees
// which elements a kernel wrote (poisonBF16 is a bf16 NaN).
const (
	poison32   = int32(0x7eadbeef)
	poisonBF16 = uint16(0x7fc1)
)

func filled[T any](n int, v T) []T {
	s := make([]T, n)
	for i := range s {
		s[i] = v
	}
	return s
}

// uploadOrAlloc uploads b, or allocates 4 bytes when b is empty (Alloc(0) is
// not a valid device pointer).
func uploadOrAlloc(t *testing.T, d *device, b []byte) Ptr {
	t.Helper()
	if len(b) == 0 {
		return alloc(t, d, 4)
	}
	return upload(t, d, b)
}

func bf16Bits(v []float64) []uint16 {
	h := make([]uint16, len(v))
	for i, x := range v {
		h[i] = f32ToBF16(float32(x))
	}
	return h
}

// alignCap is the caller's size of sorted: room for every assignment plus
// BM-1 padding rows for each expert that can be non-empty.
func alignCap(TK, E, BM int) int { return roundUp(TK+min(E, TK)*(BM-1), BM) }

// runAlign launches gpuctx_moe_align on poisoned outputs, segments from
// expert first on, and returns them.
func runAlign(t *testing.T, d *device, idx []int32, E, BM, cp, first int) (sorted, blockExpert []int32, npost int32, ptrs [3]Ptr) {
	t.Helper()
	ip := uploadOrAlloc(t, d, asBytes(idx))
	sp := uploadOrAlloc(t, d, asBytes(filled(cp, poison32)))
	bp := uploadOrAlloc(t, d, asBytes(filled(cp/BM, poison32)))
	np := upload(t, d, asBytes([]int32{poison32}))
	if err := launchSync(t, d, "gpuctx_moe_align", ip, sp, bp, np, int32(len(idx)), int32(E), int32(BM), int32(cp), int32(first)); err != nil {
		t.Fatal(err)
	}
	sorted = fromBytes[int32](download(t, d, sp, 4*cp))
	blockExpert = fromBytes[int32](download(t, d, bp, 4*(cp/BM)))
	npost = fromBytes[int32](download(t, d, np, 4))[0]
	return sorted, blockExpert, npost, [3]Ptr{sp, bp, np}
}

// TestMoEAlign checks the block-aligned sort on hand-computed cases.
func TestMoEAlign(t *testing.T) {
	d := newTestDevice(t)
	tests := []struct {
		name            string
		idx             []int32
		E, BM, cap      int
		first           int
		wantSorted      []int32
		wantBlockExpert []int32
		wantNpost       int32
	}{
		{
			// Expert 0: assignments 1, 5 (one block); expert 1 empty; expert 2:
			// 0, 2, 4, 6, 7 (two blocks); 5 and -1 are out of range. cap 24 > 20
			// (the caller's size) > 12 (needed): the tail is padding.
			name: "empty expert, bad index, spare cap",
			idx:  []int32{2, 0, 2, 5, 2, 0, 2, 2, -1}, E: 3, BM: 4, cap: 24,
			wantSorted:      []int32{1, 5, 9, 9, 0, 2, 4, 6, 7, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9},
			wantBlockExpert: []int32{0, 2, 2, -1, -1, -1},
			wantNpost:       12,
		},
		{
			// The same routing with the segments from expert 2 on: 2, 0, 1.
			name: "segments from expert 2",
			idx:  []int32{2, 0, 2, 5, 2, 0, 2, 2, -1}, E: 3, BM: 4, cap: 24, first: 2,
			wantSorted:      []int32{0, 2, 4, 6, 7, 9, 9, 9, 1, 5, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9},
			wantBlockExpert: []int32{2, 2, 0, -1, -1, -1},
			wantNpost:       12,
		},
		{
			// From expert 1 (empty): 1, 2, 0.
			name: "segments from an empty expert",
			idx:  []int32{2, 0, 0, 2}, E: 3, BM: 2, cap: 8, first: 1,
			wantSorted:      []int32{0, 3, 1, 2, 4, 4, 4, 4},
			wantBlockExpert: []int32{2, 0, -1, -1},
			wantNpost:       4,
		},
		{
			name: "exact cap, no spare block",
			idx:  []int32{1, 1, 0, 1}, E: 3, BM: 2, cap: 6,
			wantSorted:      []int32{2, 4, 0, 1, 3, 4},
			wantBlockExpert: []int32{0, 1, 1},
			wantNpost:       6,
		},
		{
			name: "full blocks, no padding",
			idx:  []int32{2, 0, 0, 2}, E: 3, BM: 2, cap: 8,
			wantSorted:      []int32{1, 2, 0, 3, 4, 4, 4, 4},
			wantBlockExpert: []int32{0, 2, -1, -1},
			wantNpost:       4,
		},
		{
			name: "no valid assignment",
			idx:  []int32{3, -2}, E: 3, BM: 4, cap: 4,
			wantSorted:      []int32{2, 2, 2, 2},
			wantBlockExpert: []int32{-1},
			wantNpost:       0,
		},
		{
			name: "no assignments", E: 3, BM: 4, cap: 4,
			wantSorted:      []int32{0, 0, 0, 0},
			wantBlockExpert: []int32{-1},
			wantNpost:       0,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sorted, be, npost, _ := runAlign(t, d, tc.idx, tc.E, tc.BM, tc.cap, tc.first)
			if !slices.Equal(sorted, tc.wantSorted) {
				t.Errorf("sorted %v, want %v", sorted, tc.wantSorted)
			}
			if !slices.Equal(be, tc.wantBlockExpert) {
				t.Errorf("block_expert %v, want %v", be, tc.wantBlockExpert)
			}
			if npost != tc.wantNpost {
				t.Errorf("npost %d, want %d", npost, tc.wantNpost)
			}
		})
	}
}

// TestMoEAlignRandom checks the properties of the sort on random routings:
// every valid assignment appears once, in its expert's segment (segments in
// expert order from a random first expert, wrapping round, each rounded up
// to BM rows), in increasing order; every other row is padding (TK);
// block_expert names each segment's blocks and -1 beyond.
func TestMoEAlignRandom(t *testing.T) {
	d := newTestDevice(t)
	r := rand.New(rand.NewPCG(1, 2))
	for it := range 200 {
		E := 1 + r.IntN(40)
		BM := []int{1, 2, 3, 4, 8, 16, 64}[r.IntN(7)]
		TK := r.IntN(120)
		idx := make([]int32, TK)
		for i := range idx {
			idx[i] = int32(r.IntN(E+4) - 2) // a few out of range on both sides
		}
		cp := alignCap(TK, E, BM) + BM*r.IntN(3)
		if cp == 0 {
			cp = BM
		}
		first := 0
		if it%2 == 1 {
			first = r.IntN(E)
		}
		t.Run(fmt.Sprintf("%d/E=%d/BM=%d/TK=%d/first=%d", it, E, BM, TK, first), func(t *testing.T) {
			sorted, be, npost, _ := runAlign(t, d, idx, E, BM, cp, first)
			seen := make([]bool, TK)
			row := 0
			for o := range E {
				e := (first + o) % E
				var want []int32
				for a, x := range idx {
					if int(x) == e {
						want = append(want, int32(a))
					}
				}
				n := roundUp(len(want), BM)
				for j := range n {
					w := int32(TK)
					if j < len(want) {
						w = want[j]
						seen[w] = true
					}
					if sorted[row+j] != w {
						t.Fatalf("expert %d: sorted[%d] = %d, want %d (segment %v from row %d)", e, row+j, sorted[row+j], w, want, row)
					}
				}
				for b := row / BM; b < (row+n)/BM; b++ {
					if be[b] != int32(e) {
						t.Fatalf("block_expert[%d] = %d, want %d", b, be[b], e)
					}
				}
				row += n
			}
			if int(npost) != row {
				t.Fatalf("npost %d, want %d", npost, row)
			}
			for p := row; p < cp; p++ {
				if sorted[p] != int32(TK) {
					t.Fatalf("sorted[%d] = %d beyond npost, want TK=%d", p, sorted[p], TK)
				}
			}
			for b := row / BM; b < cp/BM; b++ {
				if be[b] != -1 {
					t.Fatalf("block_expert[%d] = %d beyond npost, want -1", b, be[b])
				}
			}
			for a, x := range idx {
				if x >= 0 && int(x) < E && !seen[a] {
					t.Fatalf("assignment %d (expert %d) missing", a, x)
				}
			}
		})
	}
}

// TestMoEFusedGemm runs align, up and down for every tile config and checks
// them against float64 references: act rows of assignments (bf16 tolerance),
// zero padding rows, untouched rows beyond npost, out rows of routed
// assignments, untouched out rows of unrouted ones.
func TestMoEFusedGemm(t *testing.T) {
	d := newTestDevice(t)
	shapes := []struct{ T, K, E, H, I int }{
		{T: 5, K: 3, E: 6, H: 16, I: 24},
		{T: 40, K: 2, E: 3, H: 32, I: 16}, // several blocks per expert at BM 16
	}
	for _, c := range MoEGemms {
		for si, sh := range shapes {
			t.Run(fmt.Sprintf("%s/%d", c.Tag(), si), func(t *testing.T) {
				T, K, E, H, I, BM := sh.T, sh.K, sh.E, sh.H, sh.I, c.BM
				TK := T * K
				rg := lcg(7 + si)
				x, gu, dn := bf16Bits(rg.vals(T*H)), bf16Bits(rg.vals(E*2*I*H)), bf16Bits(rg.vals(E*H*I))
				r := rand.New(rand.NewPCG(uint64(si), 3))
				idx := make([]int32, TK)
				for a := range idx {
					idx[a] = int32(r.IntN(E))
				}
				idx[1] = int32(E) // unrouted: its out row must stay untouched
				idx[TK-1] = -1
				cp := alignCap(TK, E, BM)
				sorted, be, npost, pl := runAlign(t, d, idx, E, BM, cp, 0)

				xp, gp, dp := upload(t, d, asBytes(x)), upload(t, d, asBytes(gu)), upload(t, d, asBytes(dn))
				ap := upload(t, d, asBytes(filled(cp*I, poisonBF16)))
				upName := c.UpName()
				if !c.HasUp() { // a down-only tile: any up kernel of its BM fills act
					upName = upTileOf(t, c).UpName()
				}
				if err := launchSync(t, d, upName, xp, gp, pl[0], pl[1], pl[2], ap,
					int32(TK), int32(K), int32(H), int32(I), int32(E), int32(0)); err != nil {
					t.Fatal(err)
				}
				act := fromBytes[uint16](download(t, d, ap, 2*cp*I))
				f := func(h uint16) float64 { return float64(bf16ToF32(h)) }
				var got, want []float64
				for p := range cp {
					ar := act[p*I : (p+1)*I]
					switch a := int(sorted[p]); {
					case p >= int(npost):
						if !slices.Equal(ar, filled(I, poisonBF16)) {
							t.Fatalf("act row %d beyond npost=%d written: %v", p, npost, ar)
						}
					case a >= TK:
						if !slices.Equal(ar, make([]uint16, I)) {
							t.Fatalf("padding act row %d = %v, want zeros", p, ar)
						}
					default:
						e, tok := int(be[p/BM]), a/K
						for i := range I {
							var g, u float64
							for h := range H {
								g += f(x[tok*H+h]) * f(gu[(e*2*I+i)*H+h])
								u += f(x[tok*H+h]) * f(gu[(e*2*I+I+i)*H+h])
							}
							got = append(got, f(ar[i]))
							want = append(want, g*sig64(g)*u)
						}
					}
				}
				if len(want) == 0 {
					t.Fatal("no routed rows")
				}
				if e := relErr(got, want); !(e < 1e-2) {
					t.Fatalf("act: relative error %g", e)
				}

				op := upload(t, d, asBytes(filled(TK*H, poisonBF16)))
				if err := launchSync(t, d, c.DownName(), ap, dp, pl[0], pl[1], pl[2], op,
					int32(TK), int32(H), int32(I)); err != nil {
					t.Fatal(err)
				}
				out := fromBytes[uint16](download(t, d, op, 2*TK*H))
				rowOf := filled(TK, -1)
				for p := range int(npost) {
					if a := int(sorted[p]); a < TK {
						rowOf[a] = p
					}
				}
				got, want = got[:0], want[:0]
				for a := range TK {
					or := out[a*H : (a+1)*H]
					p := rowOf[a]
					if p < 0 {
						if !slices.Equal(or, filled(H, poisonBF16)) {
							t.Fatalf("out row %d of an unrouted assignment written: %v", a, or)
						}
						continue
					}
					e := int(be[p/BM])
					for h := range H {
						var v float64
						for i := range I {
							v += f(act[p*I+i]) * f(dn[(e*H+h)*I+i])
						}
						got = append(got, f(or[h]))
						want = append(want, v)
					}
				}
				if e := relErr(got, want); !(e < 1e-2) {
					t.Fatalf("out: relative error %g", e)
				}
			})
		}
	}
}

// TestMoECombineRows checks that gpuctx_moe_combine_rows is
// gpuctx_moe_combine with pos = identity, bit for bit, with absent parts'
// pointers null.
func TestMoECombineRows(t *testing.T) {
	d := newTestDevice(t)
	const T, K, H = 3, 4, 9
	rg := lcg(11)
	pos := make([]int32, T*K)
	for i := range pos {
		pos[i] = int32(i)
	}
	pp := upload(t, d, asBytes(pos))
	wp := upload(t, d, asBytes(f32s(rg.vals(T*K))))
	gp := upload(t, d, asBytes([]float32{-1.5, 0, 2.25}))
	for _, bf := range []int32{0, 1} {
		eb := 4 - 2*int(bf)
		put := func(v []float64) Ptr {
			if bf == 0 {
				return upload(t, d, asBytes(f32s(v)))
			}
			return upload(t, d, asBytes(bf16Bits(v)))
		}
		op, sp := put(rg.vals(T*K*H)), put(rg.vals(T*H))
		for _, fl := range [][3]int32{{1, 1, 1}, {1, 1, 0}, {1, 0, 0}, {0, 1, 1}, {0, 1, 0}, {0, 0, 0}, {1, 0, 1}} {
			t.Run(fmt.Sprintf("bf16=%d/routed=%d/shared=%d/gate=%d", bf, fl[0], fl[1], fl[2]), func(t *testing.T) {
				// Absent parts get null pointers: neither kernel may read them.
				o, w, p, s, g := op, wp, pp, sp, gp
				if fl[0] == 0 {
					o, w, p = 0, 0, 0
				}
				if fl[1] == 0 {
					s = 0
				}
				if fl[1] == 0 || fl[2] == 0 {
					g = 0
				}
				y1 := upload(t, d, filled(T*H*eb, byte(0x7f)))
				y2 := upload(t, d, filled(T*H*eb, byte(0x7f)))
				if err := launchSync(t, d, "gpuctx_moe_combine", o, p, w, s, g, y1,
					int32(T), int32(K), int32(H), fl[0], fl[1], fl[2], bf); err != nil {
					t.Fatal(err)
				}
				if err := launchSync(t, d, "gpuctx_moe_combine_rows", o, w, s, g, y2,
					int32(T), int32(K), int32(H), fl[0], fl[1], fl[2], bf); err != nil {
					t.Fatal(err)
				}
				b1, b2 := download(t, d, y1, T*H*eb), download(t, d, y2, T*H*eb)
				if !slices.Equal(b1, b2) {
					t.Fatalf("combine_rows %v\ncombine      %v", b2, b1)
				}
				if fl[0]+fl[1] > 0 && slices.Equal(b1, make([]byte, len(b1))) {
					t.Fatal("y is all zeros: the comparison is vacuous")
				}
			})
		}
	}
}

func f32s(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// TestMoEFusedKernelErrors checks that bad sizes, pointers and plan entries of
// the fused kernels become stream errors naming the kernel.
func TestMoEFusedKernelErrors(t *testing.T) {
	// A failed kernel loses the device (as a sticky CUDA error does): each
	// case runs on a device of its own, with fixtures made by fixtures.
	type fixture int
	const (
		buf fixture = iota
		small
		sorted    // a valid plan for TK=2, BM=16: one block of expert 1, npost 16
		be        //
		np        //
		negSorted // sorted with a negative row
		bigNpost  // npost past the sorted rows
	)
	fixtures := func(d *device, f fixture) any {
		switch f {
		case buf:
			return alloc(t, d, 4096)
		case small:
			return alloc(t, d, 64)
		case sorted:
			return upload(t, d, asBytes(append([]int32{0, 1}, filled(14, int32(2))...)))
		case be:
			return upload(t, d, asBytes([]int32{1}))
		case np:
			return upload(t, d, asBytes([]int32{16}))
		case negSorted:
			return upload(t, d, asBytes(append([]int32{0, -3}, filled(14, int32(2))...)))
		default:
			return upload(t, d, asBytes([]int32{1 << 20}))
		}
	}
	c := MoEGemms[0] // BM 16
	if c.BM != 16 {
		t.Fatalf("MoEGemms[0].BM = %d: update this test", c.BM)
	}
	up, down := c.UpName(), c.DownName()
	i32 := func(v ...int) []any {
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = int32(x)
		}
		return out
	}
	args := func(p []any, v ...int) []any { return append(p, i32(v...)...) }
	tests := []struct {
		name, kernel string
		args         []any
		want         string
	}{
		{"align without experts", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 0, 4, 16, 0), "E=0"},
		{"align too many experts", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 513, 4, 16, 0), "E=513"},
		{"align zero BM", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 2, 0, 16, 0), "BM=0"},
		{"align cap not a multiple of BM", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 2, 4, 18, 0), "cap=18"},
		{"align negative TK", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, -1, 2, 4, 16, 0), "TK=-1"},
		// buf is zeroed: 4 assignments of expert 0 need 8 rows at BM 8.
		{"align cap too small", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 2, 8, 0, 0), "cap=0 < 8"},
		{"align first past the experts", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 2, 4, 16, 2), "first=2"},
		{"align negative first", "gpuctx_moe_align", args([]any{buf, buf, buf, buf}, 4, 2, 4, 16, -1), "first=-1"},
		{"align sorted outside its buffer", "gpuctx_moe_align", args([]any{buf, small, buf, buf}, 4, 2, 4, 64, 0), "sorted"},
		{"up negative TK", up, args([]any{buf, buf, sorted, be, np, buf}, -2, 1, 8, 8, 1, 0), "TK=-2"},
		{"up H not a multiple of 8", up, args([]any{buf, buf, sorted, be, np, buf}, 2, 1, 12, 8, 1, 0), "H=12"},
		{"up zero K", up, args([]any{buf, buf, sorted, be, np, buf}, 2, 0, 8, 8, 1, 0), "K=0"},
		{"up gu outside its buffer", up, args([]any{buf, small, sorted, be, np, buf}, 2, 1, 8, 8, 1, 0), "gu"},
		{"up x outside its buffer", up, args([]any{small, buf, sorted, be, np, buf}, 2, 1, 64, 8, 1, 0), "x"},
		{"up act outside its buffer", up, args([]any{buf, buf, sorted, be, np, small}, 2, 1, 8, 8, 1, 0), "act"},
		{"up negative sorted row", up, args([]any{buf, buf, negSorted, be, np, buf}, 2, 1, 8, 8, 1, 0), "sorted[1] = -3"},
		{"up npost beyond sorted", up, args([]any{buf, buf, sorted, be, bigNpost, buf}, 2, 1, 8, 8, 1, 0), "sorted"},
		// The fused shared chunks must sort first (moe_shared_rows): block 0
		// is expert 1, not 0; with two slots a token, row 1 is past T = 1.
		{"up shared chunk not first", up, args([]any{buf, buf, sorted, be, np, buf}, 2, 1, 8, 8, 0, 1), "block 0 is expert 1"},
		{"up shared chunk rows", up, args([]any{buf, buf, sorted, be, np, buf}, 2, 2, 8, 8, 1, 1), "sorted[1] = 1, want padding"},
		{"up negative ns", up, args([]any{buf, buf, sorted, be, np, buf}, 2, 1, 8, 8, 1, -1), "ns=-1"},
		{"down negative I", down, args([]any{buf, buf, sorted, be, np, buf}, 2, 8, -8), "I=-8"},
		{"down out outside its buffer", down, args([]any{buf, buf, sorted, be, np, small}, 2, 64, 8), "out"},
		{"down weights outside their buffer", down, args([]any{buf, small, sorted, be, np, buf}, 2, 8, 8), "down"},
		{"combine_rows routed without K", "gpuctx_moe_combine_rows", args([]any{buf, buf, buf, buf, buf}, 2, 0, 4, 1, 0, 0, 0), "K=0"},
		{"combine_rows out outside its buffer", "gpuctx_moe_combine_rows", args([]any{small, buf, buf, buf, buf}, 4, 4, 8, 1, 0, 0, 0), "out"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDevice(t)
			args := append([]any(nil), tc.args...)
			for i, a := range args {
				if f, ok := a.(fixture); ok {
					args[i] = fixtures(d, f)
				}
			}
			err := launchSync(t, d, tc.kernel, args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.kernel) {
				t.Fatalf("got %v, want an error naming %s and containing %q", err, tc.kernel, tc.want)
			}
		})
	}
}

// TestMoEFusedUpRounding checks the bf16 rounding of gate and up before SwiGLU
// exactly: the dot products are exact in f32 (dyadic values, two terms) but
// not in bf16, and the test checks that its expected values differ from those
// without either rounding, so dropping one changes the result.
func TestMoEFusedUpRounding(t *testing.T) {
	d := newTestDevice(t)
	const H, I = 8, 8
	p := math.Ldexp
	// Two-term gate and up rows (g = a + b, u = c + e with x = [1, 1, 0...]).
	g := [I][2]float64{{-8, -p(1, -5)}, {-6, -p(1, -6)}, {3, p(1, -7)}, {-8, 0}, {-8, 0}, {-8, 0}, {1, 0}, {-1, 0}}
	u := [I][2]float64{{1, 0}, {1, 0}, {1, 0}, {1, p(1, -8)}, {1, 3 * p(1, -9)}, {4, p(3, -6)}, {1, p(5, -10)}, {3, p(5, -9)}}
	x := make([]float64, H)
	x[0], x[1] = 1, 1
	gu := make([]float64, 2*I*H)
	for i := range I {
		gu[i*H], gu[i*H+1] = g[i][0], g[i][1]
		gu[(I+i)*H], gu[(I+i)*H+1] = u[i][0], u[i][1]
	}
	rnd := func(v float32) float32 { return bf16ToF32(f32ToBF16(v)) }
	swiglu := func(gv, uv float32) uint16 { return f32ToBF16((gv / (1 + expf(-gv))) * uv) }
	var want [I]uint16
	gDiff, uDiff := false, false
	for i := range I {
		gv, uv := float32(g[i][0]+g[i][1]), float32(u[i][0]+u[i][1])
		want[i] = swiglu(rnd(gv), rnd(uv))
		gDiff = gDiff || swiglu(gv, rnd(uv)) != want[i]
		uDiff = uDiff || swiglu(rnd(gv), uv) != want[i]
	}
	if !gDiff || !uDiff {
		t.Fatalf("test values insensitive to the rounding of gate (%v) or up (%v)", gDiff, uDiff)
	}
	c := MoEGemms[0]
	_, _, _, pl := runAlign(t, d, []int32{0}, 1, c.BM, alignCap(1, 1, c.BM), 0)
	ap := upload(t, d, asBytes(filled(c.BM*I, poisonBF16)))
	if err := launchSync(t, d, c.UpName(), upload(t, d, asBytes(bf16Bits(x))), upload(t, d, asBytes(bf16Bits(gu))),
		pl[0], pl[1], pl[2], ap, int32(1), int32(1), int32(H), int32(I), int32(1), int32(0)); err != nil {
		t.Fatal(err)
	}
	act := fromBytes[uint16](download(t, d, ap, 2*c.BM*I))
	if !slices.Equal(act[:I], want[:]) {
		t.Errorf("act row 0 %#x, want %#x", act[:I], want)
	}
	if !slices.Equal(act[I:], make([]uint16, (c.BM-1)*I)) {
		t.Errorf("padding rows %#x, want zeros", act[I:])
	}
}

// upTileOf returns the first tile with an up kernel and the BM of c.
func upTileOf(t *testing.T, c MoEGemm) MoEGemm {
	t.Helper()
	for _, u := range MoEGemms {
		if u.HasUp() && u.BM == c.BM {
			return u
		}
	}
	t.Fatalf("no tile with an up kernel has BM %d (tile %s)", c.BM, c.Tag())
	return MoEGemm{}
}

// runAlign3 runs the three-launch align (count, scan, scatter) and returns
// what runAlign returns for gpuctx_moe_align.
func runAlign3(t *testing.T, d *device, idx []int32, E, BM, cp, first int) (sorted, blockExpert []int32, npost int32) {
	t.Helper()
	TK, nb := len(idx), AlignBlocks(len(idx))
	ip := uploadOrAlloc(t, d, asBytes(idx))
	sp := uploadOrAlloc(t, d, asBytes(filled(cp, poison32)))
	bp := uploadOrAlloc(t, d, asBytes(filled(cp/BM, poison32)))
	np := upload(t, d, asBytes([]int32{poison32}))
	cnt := upload(t, d, asBytes(filled(nb*E, poison32)))
	off := upload(t, d, asBytes(filled(nb*E, poison32)))
	for _, l := range []struct {
		name string
		args []any
	}{
		{"gpuctx_moe_align_count", []any{ip, cnt, int32(TK), int32(E)}},
		{"gpuctx_moe_align_scan", []any{cnt, off, sp, bp, np, int32(TK), int32(E), int32(BM), int32(cp), int32(nb), int32(first)}},
		{"gpuctx_moe_align_scatter", []any{ip, off, np, sp, int32(TK), int32(E)}},
	} {
		if err := launchSync(t, d, l.name, l.args...); err != nil {
			t.Fatalf("%s: %v", l.name, err)
		}
	}
	return fromBytes[int32](download(t, d, sp, 4*cp)), fromBytes[int32](download(t, d, bp, 4*(cp/BM))), fromBytes[int32](download(t, d, np, 4))[0]
}

// TestMoEAlign3 checks the three-launch align against gpuctx_moe_align:
// the same sorted rows, block experts and npost, for assignment counts below,
// at and across chunk boundaries, skewed and out-of-range experts, segments
// from expert 0 and from another, and a cap too small (npost -1, nothing
// else written).
func TestMoEAlign3(t *testing.T) {
	d := newTestDevice(t)
	for _, tc := range []struct{ TK, E, BM, first int }{
		{1, 4, 16, 0}, {100, 7, 16, 5}, {AlignChunk, 64, 64, 0}, {AlignChunk + 1, 64, 128, 62}, {3*AlignChunk + 77, 160, 192, 158},
		{9000, 512, 64, 0}, {9000, 512, 64, 500},
	} {
		t.Run(fmt.Sprintf("TK%d_E%d_BM%d_first%d", tc.TK, tc.E, tc.BM, tc.first), func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(tc.TK), uint64(tc.E)))
			idx := make([]int32, tc.TK)
			for i := range idx {
				switch v := r.IntN(10); {
				case v == 0:
					idx[i] = int32(tc.E + r.IntN(3)) // out of range: skipped
				case v < 4:
					idx[i] = 0 // a hot expert over several chunks
				default:
					idx[i] = int32(r.IntN(tc.E))
				}
			}
			idx[0] = -1
			cp := alignCap(tc.TK, tc.E, tc.BM)
			ws, wb, wn, _ := runAlign(t, d, idx, tc.E, tc.BM, cp, tc.first)
			gs, gb, gn := runAlign3(t, d, idx, tc.E, tc.BM, cp, tc.first)
			if gn != wn || !slices.Equal(gs, ws) || !slices.Equal(gb, wb) {
				t.Fatalf("three-launch align differs: npost %d vs %d, sorted equal %v, block experts equal %v", gn, wn, slices.Equal(gs, ws), slices.Equal(gb, wb))
			}
			// A cap below the padded total: npost -1, sorted untouched.
			small := (int(wn)/tc.BM - 1) * tc.BM
			if small < 0 {
				return
			}
			gs, _, gn = runAlign3(t, d, idx, tc.E, tc.BM, small, tc.first)
			if gn != -1 || !slices.Equal(gs, filled(small, poison32)) {
				t.Errorf("cap %d < npost %d: npost %d, sorted written %v", small, wn, gn, !slices.Equal(gs, filled(small, poison32)))
			}
		})
	}
}

package moekernels

import (
	"bytes"
	"errors"
	"reflect"
	"slices"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/kernels"
)

// launchKinds returns the parameter kinds of the launch argument type typ:
// its leaf fields, *gpuctx.Buffer standing for a pointer.
func launchKinds(t *testing.T, typ reflect.Type) []kernels.ArgKind {
	t.Helper()
	var out []kernels.ArgKind
	for _, f := range kernels.Leaves(typ) {
		if f.Type == reflect.TypeFor[*gpuctx.Buffer]() {
			out = append(out, kernels.ArgPtr)
			continue
		}
		k, ok := kernels.KindOf(f.Type)
		if !ok {
			t.Fatalf("%v: field %s has type %v, no kernel argument type", typ, f.Name, f.Type)
		}
		out = append(out, k)
	}
	return out
}

// launcherCase is a launcher constructor and its argument type.
type launcherCase struct {
	typ reflect.Type
	mk  func(d *gpuctx.Device) (*gpuctx.Kernel, error)
}

func fixedCase[A LaunchArgs]() launcherCase {
	return launcherCase{reflect.TypeFor[A](), func(d *gpuctx.Device) (*gpuctx.Kernel, error) {
		l, err := NewLauncher[A](d)
		return l.Kernel(), err
	}}
}

// TestLaunchArgsMatchKernels checks that every kernel of the MoE sources has
// a launcher, whose argument type has the kinds of the kernel's registered
// parameters (those of its C parameter list: CheckSignatures).
func TestLaunchArgsMatchKernels(t *testing.T) {
	d := newTestDevice(t)
	cases := []launcherCase{
		fixedCase[Route](), fixedCase[Plan](), fixedCase[Gather](), fixedCase[Swiglu](), fixedCase[Combine](),
		fixedCase[ExpertUp](), fixedCase[ExpertDown](), fixedCase[Align](), fixedCase[AlignCount](),
		fixedCase[AlignScan](), fixedCase[AlignScatter](), fixedCase[RouteAlign](), fixedCase[CombineRows](),
	}
	for _, c := range MoEGemms {
		if c.HasUp() {
			cases = append(cases, launcherCase{reflect.TypeFor[Up](), func(d *gpuctx.Device) (*gpuctx.Kernel, error) {
				l, err := NewUp(d, c)
				return l.Kernel(), err
			}})
		}
		cases = append(cases, launcherCase{reflect.TypeFor[Down](), func(d *gpuctx.Device) (*gpuctx.Kernel, error) {
			l, err := NewDown(d, c)
			return l.Kernel(), err
		}})
	}
	seen := map[string]bool{}
	for _, c := range cases {
		k, err := c.mk(d.dev)
		if err != nil {
			t.Fatalf("launcher of %v: %v", c.typ, err)
		}
		name := k.Name()
		if seen[name] {
			t.Errorf("%s: two launchers", name)
		}
		seen[name] = true
		reg, _, ok := kernels.Lookup(name)
		if !ok {
			t.Fatalf("%s is not registered", name)
		}
		if got := launchKinds(t, c.typ); !slices.Equal(got, reg.Params) {
			t.Errorf("%s: launch arguments %v have kinds %v, the kernel's parameters %v", name, c.typ, got, reg.Params)
		}
	}
	ks, err := LoadKernels(d.dev)
	if err != nil {
		t.Fatal(err)
	}
	loaded := map[string]bool{}
	v := reflect.ValueOf(*ks)
	for i := range v.NumField() {
		k := v.Field(i).MethodByName("Kernel").Call(nil)[0].Interface().(*gpuctx.Kernel)
		if k == nil || !seen[k.Name()] || loaded[k.Name()] {
			t.Errorf("LoadKernels: Kernels.%s is %v (loaded before: %v)", v.Type().Field(i).Name, k, k != nil && loaded[k.Name()])
			continue
		}
		loaded[k.Name()] = true
	}
	for _, name := range kernels.Index(RouteSource() + GemmSource() + WgmmaSource()) {
		if !seen[name] {
			t.Errorf("%s has no launcher", name)
		}
	}
}

// TestLauncherErrors checks the launchers that cannot launch.
func TestLauncherErrors(t *testing.T) {
	d := newTestDevice(t)
	s, err := d.dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var downOnly MoEGemm
	for _, c := range MoEGemms {
		if !c.HasUp() {
			downOnly = c
		}
	}
	for name, fn := range map[string]func() error{
		"NewLauncher[Up]": func() error { _, err := NewLauncher[Up](d.dev); return err },
		"NewUp down-only": func() error { _, err := NewUp(d.dev, downOnly); return err },
		"nil device":      func() error { _, err := NewLauncher[Route](nil); return err },
		"zero Launch": func() error {
			return Launcher[Route]{}.Launch(s, one, one, 0, Route{})
		},
		"zero LaunchEarly": func() error {
			return Launcher[Down]{}.LaunchEarly(s, one, one, 0, Down{})
		},
	} {
		t.Run(name, func(t *testing.T) {
			if err := fn(); !errors.Is(err, gpuctx.ErrInvalid) {
				t.Errorf("error %v, want one wrapping gpuctx.ErrInvalid", err)
			}
		})
	}
}

// TestLauncherBits checks that a typed launch passes the arguments of the
// positional launch package moe made before the launchers (same order: the
// same output bits), for the kernels whose arguments are grouped (RouteRule).
func TestLauncherBits(t *testing.T) {
	const T, H, E, K, BM = 3, 16, 8, 2, 16
	cp := roundUp(T*K+min(E, T*K)*(BM-1), BM)
	var r lcg = 7
	xs, rs := make([]uint16, T*H), make([]uint16, E*H)
	for i := range xs {
		xs[i] = f32ToBF16(float32(r.next()))
	}
	for i := range rs {
		rs[i] = f32ToBF16(float32(r.next()))
	}
	bias := []float32{0, 0.1, 0, 0, 0.2, 0, 0, 0.05}
	rule := RouteRule{Scoring: 1, Method: 2, Groups: 4, TopkGroups: 2, HasBias: 1, Norm: 1, NormEps: 1e-20, Scale: 2.5}
	// run launches on a fresh device with typed or positional arguments and
	// returns every output's bytes.
	run := func(typed bool) [][]byte {
		d := newTestDevice(t)
		s, err := d.dev.NewStream(gpuctx.StreamOptions{})
		if err != nil {
			t.Fatal(err)
		}
		b := func(p Ptr) *gpuctx.Buffer { return d.bufs[p] }
		x, router, bp := upload(t, d, asBytes(xs)), upload(t, d, asBytes(rs)), upload(t, d, asBytes(bias))
		outs := []Ptr{alloc(t, d, 4*T*E), alloc(t, d, 4*T*K), alloc(t, d, 4*T*K), alloc(t, d, 4*cp), alloc(t, d, 4*cp/BM), alloc(t, d, 4),
			alloc(t, d, 4*T*K), alloc(t, d, 4*T*K), alloc(t, d, T*H), alloc(t, d, 4*T*((H+127)/128))}
		ticket := upload(t, d, make([]byte, 4))
		logits, idx, w, sorted, bexp, npost, idx2, w2 := outs[0], outs[1], outs[2], outs[3], outs[4], outs[5], outs[6], outs[7]
		xq, xsc := outs[8], outs[9]
		grid, blk := gpuctx.Dim3{X: RouteAlignBlocks(T * E), Y: 1, Z: 1}, gpuctx.Dim3{X: 512, Y: 1, Z: 1}
		if typed {
			ra, err := NewLauncher[RouteAlign](d.dev)
			if err != nil {
				t.Fatal(err)
			}
			if err := ra.LaunchEarly(s, grid, blk, RouteAlignSmem(T, E), RouteAlign{X: b(x), Router: b(router), Bias: b(bp),
				Logits: b(logits), TopkIdx: b(idx), TopkW: b(w), Sorted: b(sorted), BlockExpert: b(bexp), Npost: b(npost),
				Ticket: b(ticket), T: T, H: H, E: E, K: K, Rule: rule, Ks: K, Ns: 0, BM: BM, Cap: int32(cp),
				Xq: b(xq), Xs: b(xsc), QuantX: 1}); err != nil {
				t.Fatal(err)
			}
			rt, err := NewLauncher[Route](d.dev)
			if err != nil {
				t.Fatal(err)
			}
			if err := rt.Launch(s, one, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0, Route{Logits: b(logits), Bias: b(bp),
				TopkIdx: b(idx2), TopkW: b(w2), T: T, E: E, K: K, Rule: rule, Ks: K, Ns: 0}); err != nil {
				t.Fatal(err)
			}
		} else {
			if err := s.LaunchEarly(mustKernel(t, d, "gpuctx_moe_route_align"), grid, blk, RouteAlignSmem(T, E),
				b(x), b(router), b(bp), b(logits), b(idx), b(w), b(sorted), b(bexp), b(npost), b(ticket),
				int32(T), int32(H), int32(E), int32(K), rule.Scoring, rule.Method, rule.Groups, rule.TopkGroups,
				rule.HasBias, rule.Norm, rule.NormEps, rule.Scale, int32(K), int32(0), int32(BM), int32(cp),
				b(xq), b(xsc), int32(1)); err != nil {
				t.Fatal(err)
			}
			if err := s.Launch(mustKernel(t, d, "gpuctx_moe_route"), one, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0,
				b(logits), b(bp), b(idx2), b(w2), int32(T), int32(E), int32(K), rule.Scoring, rule.Method,
				rule.Groups, rule.TopkGroups, rule.HasBias, rule.Norm, rule.NormEps, rule.Scale, int32(K), int32(0)); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		var got [][]byte
		for _, p := range outs {
			got = append(got, download(t, d, p, d.bufs[p].Size()))
		}
		return got
	}
	typed, positional := run(true), run(false)
	for i := range typed {
		if !bytes.Equal(typed[i], positional[i]) {
			t.Errorf("output %d: typed launch %x, positional %x", i, typed[i], positional[i])
		}
	}
	if !bytes.Equal(typed[1], typed[6]) || !bytes.Equal(typed[2], typed[7]) {
		t.Errorf("route_align and route chose differently: %x %x, %x %x", typed[1], typed[6], typed[2], typed[7])
	}
}

// TestLaunchArgsList checks each launch argument type's args against
// kernels.Flatten, with every leaf field set to a value of its own.
func TestLaunchArgsList(t *testing.T) {
	d := newTestDevice(t)
	for _, a := range []any{Route{}, Plan{}, Gather{}, Swiglu{}, Combine{}, ExpertUp{}, ExpertDown{}, Align{},
		AlignCount{}, AlignScan{}, AlignScatter{}, RouteAlign{}, CombineRows{}, Up{}, Down{}, FP8Up{}, FP8Down{},
		FP8Quant{}, W8A8Up{}, W8A8Down{}, routeArgs{}, routeAlignArgs{}, upArgs{}, fp8UpArgs{}, fp8DownArgs{},
		fp8QuantArgs{}, w8a8UpArgs{}, w8a8DownArgs{}} {
		v := reflect.New(reflect.TypeOf(a)).Elem()
		for i, f := range kernels.Leaves(v.Type()) {
			fv := v.FieldByIndex(f.Index)
			switch f.Type {
			case reflect.TypeFor[*gpuctx.Buffer]():
				buf, err := d.dev.Alloc(4)
				if err != nil {
					t.Fatal(err)
				}
				fv.Set(reflect.ValueOf(buf))
			case reflect.TypeFor[Ptr]():
				fv.SetUint(uint64(16 * (i + 1)))
			case reflect.TypeFor[float32]():
				fv.SetFloat(float64(i) + 0.5)
			default:
				fv.SetInt(int64(i + 1))
			}
		}
		got := v.Interface().(interface{ args() []any }).args()
		if want := kernels.Flatten(v.Interface()); !slices.Equal(got, want) {
			t.Errorf("%T.args() = %v, want %v", a, got, want)
		}
	}
}

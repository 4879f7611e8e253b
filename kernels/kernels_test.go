package kernels

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unsafe"
)

func TestKernelsPresent(t *testing.T) {
	files := Files()
	tests := []struct {
		name   string
		params string // parameter list as written in the source, whitespace-normalised
	}{
		{"gpuctx_empty", ""},
		{"gpuctx_fill_f32", "float* __restrict__ y, float v, long long n"},
		{"gpuctx_axpby_f32", "float* __restrict__ y, const float* __restrict__ x, float a, float b, long long n"},
		{"gpuctx_add_i32", "int* __restrict__ y, int v, long long n"},
	}
	srcs := Sources()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			file, ok := files[tc.name]
			if !ok {
				t.Fatalf("kernel %s not defined in any .cu file (have %v)", tc.name, Names())
			}
			re := regexp.MustCompile(`void\s+` + tc.name + `\s*\(([^)]*)\)`)
			m := re.FindStringSubmatch(srcs[file])
			if m == nil {
				t.Fatalf("cannot find the parameter list of %s in %s", tc.name, file)
			}
			if got := strings.Join(strings.Fields(m[1]), " "); got != tc.params {
				t.Errorf("%s parameters = %q, want %q (update the doc table in kernels.go too)", tc.name, got, tc.params)
			}
		})
	}
}

func TestNamesPrefixedAndUnique(t *testing.T) {
	seen := map[string]string{}
	for file, src := range Sources() {
		for _, n := range Index(src) {
			if !strings.HasPrefix(n, Prefix) {
				t.Errorf("%s: kernel %q lacks the %q prefix", file, n, Prefix)
			}
			if prev, dup := seen[n]; dup {
				t.Errorf("kernel %q defined in both %s and %s", n, prev, file)
			}
			seen[n] = file
		}
	}
	if len(seen) == 0 {
		t.Fatal("no kernels found in the embedded sources")
	}
}

func TestIndex(t *testing.T) {
	tests := []struct {
		src  string
		want string
	}{
		{`extern "C" __global__ void a(int x) {}`, "a"},
		{"extern \"C\"\n__global__ __launch_bounds__(256, 2) void b_c(float* y)", "b_c"},
		{`__global__ void notexported(int x) {}`, ""},
		{`extern "C" __device__ float helper(float x)`, ""},
	}
	for _, tc := range tests {
		if got := strings.Join(Index(tc.src), ","); got != tc.want {
			t.Errorf("Index(%q) = %q, want %q", tc.src, got, tc.want)
		}
	}
}

// TestParamCounts checks the parameter counts the CUDA backend asks the
// driver for (it must not probe past the last one).
func TestParamCounts(t *testing.T) {
	got := ParamCounts()
	for name, want := range map[string]int{
		"gpuctx_empty": 0, "gpuctx_fill_f32": 3, "gpuctx_axpby_f32": 5, "gpuctx_add_i32": 3,
	} {
		if got[name] != want {
			t.Errorf("%s: %d parameters, want %d", name, got[name], want)
		}
	}
	if len(got) != len(Names()) {
		t.Errorf("%d counts for %d kernels", len(got), len(Names()))
	}
}

// TestKernelSignaturesMatchCUDA checks that every kernel of the registered
// CUDA sources has a Go body with the parameter kinds of its C parameter
// list, so that a launch that works on the CPU backend passes the same
// arguments on CUDA (package moe's kernels run the same check).
func TestKernelSignaturesMatchCUDA(t *testing.T) {
	if err := CheckSignatures(); err != nil {
		t.Fatal(err)
	}
	for _, name := range Names() {
		if _, _, ok := Lookup(name); !ok {
			t.Errorf("%s has no Go body", name)
		}
	}
}

// TestCheckSignatures checks that the signature check finds each kind of
// mismatch.
func TestCheckSignatures(t *testing.T) {
	body := func(Memory, []any) error { return nil }
	src := `extern "C" __global__ void gpuctx_a(float* y, int n, long long m) {}
extern "C" __global__ __launch_bounds__(64) void gpuctx_b(const unsigned short* __restrict__ x, float v) {}
extern "C" __global__ void gpuctx_c() {}`
	tests := []struct {
		name string
		ks   []Kernel
		want []string // substrings of the error; none: no error
	}{
		{"all match", []Kernel{
			{Name: "gpuctx_a", Params: []ArgKind{ArgPtr, ArgI32, ArgI64}, CPU: body},
			{Name: "gpuctx_b", Params: []ArgKind{ArgPtr, ArgF32}, CPU: body},
			{Name: "gpuctx_c", CPU: body},
		}, nil},
		{"missing body, wrong kinds, extra body", []Kernel{
			{Name: "gpuctx_a", Params: []ArgKind{ArgPtr, ArgI64, ArgI64}, CPU: body},
			{Name: "gpuctx_c", CPU: body},
			{Name: "gpuctx_d", CPU: body},
		}, []string{"gpuctx_b (t.cu) has no Go body", "gpuctx_a: Go parameters [hal.Ptr int64 int64], CUDA source [hal.Ptr int32 int64]", "gpuctx_d is registered with t.cu, which does not define it"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var r registry
			r.register(Source{File: "t.cu", Text: src, Kernels: tc.ks})
			err := checkSignatures(r.snapshot())
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			for _, w := range tc.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("got %v, want an error containing %q", err, w)
				}
			}
		})
	}
}

// TestRegisterPanics checks that registration mistakes panic at init.
func TestRegisterPanics(t *testing.T) {
	body := func(Memory, []any) error { return nil }
	tests := []struct {
		name string
		run  func(r *registry)
		want string
	}{
		{"repeated file", func(r *registry) {
			r.register(Source{File: "a.cu"})
			r.register(Source{File: "a.cu"})
		}, "registered twice"},
		{"repeated kernel", func(r *registry) {
			r.register(Source{File: "a.cu", Kernels: []Kernel{{Name: "gpuctx_x", CPU: body}}})
			r.register(Source{File: "b.cu", Kernels: []Kernel{{Name: "gpuctx_x", CPU: body}}})
		}, "registered by both a.cu and b.cu"},
		{"no prefix", func(r *registry) { r.register(Source{File: "a.cu", Kernels: []Kernel{{Name: "x", CPU: body}}}) }, "prefix"},
		{"no body", func(r *registry) { r.register(Source{File: "a.cu", Kernels: []Kernel{{Name: "gpuctx_x"}}}) }, "no Go body"},
		{"after read", func(r *registry) {
			r.snapshot()
			r.register(Source{File: "a.cu"})
		}, "after the registry was read"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), tc.want) {
					t.Fatalf("panic %v, want one containing %q", p, tc.want)
				}
			}()
			tc.run(new(registry))
		})
	}
}

// sliceMem is a Memory over one Go byte slice starting at address base.
type sliceMem struct {
	base Ptr
	buf  []byte
}

func (m sliceMem) Bytes(what string, p Ptr, n, align int) ([]byte, error) {
	off := int(p - m.base)
	if p < m.base || off+n > len(m.buf) || int(p)%align != 0 {
		return nil, fmt.Errorf("%s: [%#x, +%d) outside memory", what, p, n)
	}
	return m.buf[off : off+n], nil
}

// TestTwin checks the parameter kinds Twin derives from a struct, that the
// body gets the launch arguments as named fields, and Args.
func TestTwin(t *testing.T) {
	type args struct {
		P Ptr
		A int32
		B uint32
		C int64
		D uint64
		E float32
		F float64
	}
	var got args
	k := Twin("gpuctx_t", func(m Memory, a *args) error { got = *a; return nil })
	want := []ArgKind{ArgPtr, ArgI32, ArgU32, ArgI64, ArgU64, ArgF32, ArgF64}
	if !slices.Equal(k.Params, want) {
		t.Errorf("Params %v, want %v", k.Params, want)
	}
	in := args{P: 8, A: -1, B: 2, C: -3, D: 4, E: 5.5, F: 6.25}
	if err := k.CPU(sliceMem{}, Args(in)); err != nil || got != in {
		t.Errorf("body got %+v (%v), want %+v", got, err, in)
	}
	if a := Args(&in); len(a) != 7 || a[0] != Ptr(8) || a[6] != 6.25 {
		t.Errorf("Args(&in) = %v", a)
	}
	for name, fn := range map[string]func(){
		"unexported group": func() {
			Twin("gpuctx_t", func(Memory, *struct {
				P Ptr
				g struct{ A int32 }
			}) error {
				return nil
			})
		},
		"int field":        func() { Twin("gpuctx_t", func(Memory, *struct{ N int }) error { return nil }) },
		"unexported field": func() { Twin("gpuctx_t", func(Memory, *struct{ n int32 }) error { return nil }) },
		"not a struct":     func() { Twin("gpuctx_t", func(Memory, *int32) error { return nil }) },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			fn()
		})
	}
}

// TestTwinGroups checks that a field of struct type (named or embedded)
// stands for its own fields, in order, for Twin, Args, Flatten and Leaves.
func TestTwinGroups(t *testing.T) {
	type Rule struct {
		A int32
		B float32
	}
	type Inner struct{ C int64 }
	type args struct {
		P    Ptr
		Rule Rule
		Inner
		Q Ptr
	}
	var got args
	k := Twin("gpuctx_t", func(m Memory, a *args) error { got = *a; return nil })
	if want := []ArgKind{ArgPtr, ArgI32, ArgF32, ArgI64, ArgPtr}; !slices.Equal(k.Params, want) {
		t.Errorf("Params %v, want %v", k.Params, want)
	}
	in := args{P: 8, Rule: Rule{A: -1, B: 2.5}, Inner: Inner{C: 7}, Q: 16}
	wantArgs := []any{Ptr(8), int32(-1), float32(2.5), int64(7), Ptr(16)}
	if a := Args(in); !slices.Equal(a, wantArgs) {
		t.Errorf("Args = %v, want %v", a, wantArgs)
	}
	if a := Flatten(&in); !slices.Equal(a, wantArgs) {
		t.Errorf("Flatten = %v, want %v", a, wantArgs)
	}
	if err := k.CPU(sliceMem{}, wantArgs); err != nil || got != in {
		t.Errorf("body got %+v (%v), want %+v", got, err, in)
	}
	var names []string
	for _, f := range Leaves(reflect.TypeFor[args]()) {
		names = append(names, fmt.Sprint(f.Name, f.Index))
	}
	if want := []string{"P[0]", "A[1 0]", "B[1 1]", "C[2 0]", "Q[3]"}; !slices.Equal(names, want) {
		t.Errorf("Leaves = %v, want %v", names, want)
	}
	// Flatten takes pointer fields of any type (a launch converts them).
	type bufArgs struct {
		X *int
		N int32
	}
	x := new(int)
	if a := Flatten(bufArgs{X: x, N: 3}); len(a) != 2 || a[0] != any(x) || a[1] != int32(3) {
		t.Errorf("Flatten(bufArgs) = %v", a)
	}
}

// TestBasicTwins runs the Go bodies of the basic kernels on Go memory.
func TestBasicTwins(t *testing.T) {
	f32 := func(b []byte) []float32 { return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4) }
	buf := make([]float32, 8)
	mem := sliceMem{base: 4096, buf: unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), 32)}
	run := func(name string, a any) error {
		k, _, ok := Lookup(name)
		if !ok {
			t.Fatalf("%s not registered", name)
		}
		return k.CPU(mem, Args(a))
	}
	if err := run("gpuctx_fill_f32", fillArgs{Y: 4096, V: 2, N: 4}); err != nil {
		t.Fatal(err)
	}
	if err := run("gpuctx_fill_f32", fillArgs{Y: 4096 + 16, V: 3, N: 4}); err != nil {
		t.Fatal(err)
	}
	if err := run("gpuctx_axpby_f32", axpbyArgs{Y: 4096, X: 4096 + 16, A: 2, B: -1, N: 4}); err != nil {
		t.Fatal(err)
	}
	if got, want := f32(mem.buf), []float32{4, 4, 4, 4, 3, 3, 3, 3}; !slices.Equal(got, want) {
		t.Errorf("memory %v, want %v", got, want)
	}
	if err := run("gpuctx_fill_f32", fillArgs{Y: 4096, V: 2, N: 9}); err == nil || !strings.Contains(err.Error(), "y") {
		t.Errorf("fill past the end: %v", err)
	}
}

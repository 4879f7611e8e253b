package kernels

import (
	"regexp"
	"strings"
	"testing"
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
			if !valid(n) {
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

// TestMoEGemmConfigs checks every tile against moe_gemm.cu's static
// assertions and the shared-memory limit (NVRTC would refuse the whole file on
// the GPU), and that tags are unique.
func TestMoEGemmConfigs(t *testing.T) {
	seen := map[string]bool{}
	for _, c := range MoEGemms {
		if err := c.Check(); err != nil {
			t.Error(err)
		}
		if seen[c.Tag()] {
			t.Errorf("tile %s listed twice", c.Tag())
		}
		seen[c.Tag()] = true
	}
	bad := MoEGemm{BM: 16, BN: 128, BK: 64, WarpsM: 1, WarpsN: 8, Stages: 4} // 128 A chunks, 256 threads
	if bad.Check() == nil {
		t.Errorf("tile %s passes Check, but its A tile cannot split over its threads", bad.Tag())
	}
}

// TestParamCounts checks the parameter counts the CUDA backend asks the
// driver for (it must not probe past the last one).
func TestParamCounts(t *testing.T) {
	got := ParamCounts()
	for name, want := range map[string]int{
		"gpuctx_empty": 0, "gpuctx_fill_f32": 3, "gpuctx_moe_route": 17, "gpuctx_moe_align": 8,
		"gpuctx_moe_route_align": 25, "gpuctx_moe_combine_rows": 12, MoEGemms[0].UpName(): 10, MoEGemms[0].DownName(): 9,
	} {
		if got[name] != want {
			t.Errorf("%s: %d parameters, want %d", name, got[name], want)
		}
	}
	if len(got) != len(Names()) {
		t.Errorf("%d counts for %d kernels", len(got), len(Names()))
	}
}

package cuda

import (
	"errors"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// These tests need neither a GPU nor any CUDA library.

func TestCheckFormatsStatus(t *testing.T) {
	tests := []struct {
		call string
		code int32
		want string
		is   []error
		not  []error
	}{
		{"cuMemAlloc_v2", 2, "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)", []error{ErrOutOfMemory, hal.ErrOutOfMemory}, []error{ErrInvalidValue, hal.ErrUnavailable}},
		{"cuInit", 100, "cuInit: CUDA_ERROR_NO_DEVICE (100)", []error{ErrNoDevice, hal.ErrUnavailable}, []error{ErrOutOfMemory}},
		{"cuModuleGetFunction", 500, "cuModuleGetFunction: CUDA_ERROR_NOT_FOUND (500)", []error{hal.ErrNoKernel}, nil},
		{"cuLaunchKernel", 999, "cuLaunchKernel: CUDA_ERROR_UNKNOWN_STATUS (999)", nil, []error{hal.ErrNoKernel, ErrLaunchFailed}},
	}
	if err := check(nil, "cuInit", 0); err != nil {
		t.Fatalf("check(success) = %v, want nil", err)
	}
	for _, tc := range tests {
		t.Run(tc.want, func(t *testing.T) {
			err := check(nil, tc.call, tc.code)
			if err == nil || err.Error() != tc.want {
				t.Fatalf("check = %v, want %q", err, tc.want)
			}
			var ce *Error
			if !errors.As(err, &ce) || ce.Code != tc.code || ce.Call != tc.call {
				t.Fatalf("error %#v lacks call/code", err)
			}
			for _, target := range tc.is {
				if !errors.Is(err, target) {
					t.Errorf("errors.Is(%v, %v) = false, want true", err, target)
				}
			}
			for _, target := range tc.not {
				if errors.Is(err, target) {
					t.Errorf("errors.Is(%v, %v) = true, want false", err, target)
				}
			}
		})
	}
}

func TestVersionString(t *testing.T) {
	for v, want := range map[int]string{13000: "13.0", 12080: "12.8", 12040: "12.4", 11020: "11.2"} {
		if got := versionString(v); got != want {
			t.Errorf("versionString(%d) = %q, want %q", v, got, want)
		}
	}
}

func TestPackArgs(t *testing.T) {
	tests := []struct {
		name      string
		args      []any
		wantSizes []uintptr
		wantVals  []uint64
		wantErr   string
	}{
		{"none", nil, []uintptr{}, nil, ""},
		{"every type", []any{hal.Ptr(0x1000), int32(-1), uint32(7), int64(-2), uint64(9), float32(1.5), float64(-0.25)},
			[]uintptr{8, 4, 4, 8, 8, 4, 8},
			[]uint64{0x1000, 0xffffffff, 7, 0xfffffffffffffffe, 9, 0x3fc00000, 0xbfd0000000000000}, ""},
		{"int is rejected", []any{hal.Ptr(1), 3}, nil, nil, "gpuctx_k: argument 1 has type int"},
		{"slice is rejected", []any{[]float32{1}}, nil, nil, "argument 0 has type []float32"},
		{"too many", make([]any, maxKernelArgs+1), nil, nil, "at most 32"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pb := new(paramBlock)
			for i := range pb.vals {
				pb.vals[i] = 0xdeadbeefdeadbeef // stale data from an earlier launch
			}
			sizes, err := pack("gpuctx_k", pb, tc.args)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("pack error = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(sizes) != len(tc.wantSizes) {
				t.Fatalf("sizes = %v, want %v", sizes, tc.wantSizes)
			}
			for i := range sizes {
				if sizes[i] != tc.wantSizes[i] || pb.vals[i] != tc.wantVals[i] {
					t.Errorf("arg %d: size %d val %#x, want size %d val %#x", i, sizes[i], pb.vals[i], tc.wantSizes[i], tc.wantVals[i])
				}
				if pb.ptrs[i] == nil || *(*uint64)(pb.ptrs[i]) != pb.vals[i] {
					t.Errorf("arg %d: pointer does not point at its value", i)
				}
			}
		})
	}
}

func TestCheckParams(t *testing.T) {
	tests := []struct {
		want, got []uintptr
		err       string
	}{
		{nil, []uintptr{4}, ""}, // driver cannot tell: accept
		{[]uintptr{8, 4, 8}, []uintptr{8, 4, 8}, ""},
		{[]uintptr{8, 4, 8}, []uintptr{8, 4}, "2 arguments given, the kernel takes 3"},
		{[]uintptr{8, 4, 8}, []uintptr{8, 4, 4}, "argument 2 is 4 bytes, the kernel's parameter 2 is 8 bytes"},
	}
	for _, tc := range tests {
		err := checkParams("k", tc.want, tc.got)
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("checkParams(%v, %v) = %v, want %q", tc.want, tc.got, err, tc.err)
		}
	}
}

func TestDim(t *testing.T) {
	for _, v := range []int{0, -1, 1 << 31} {
		if _, err := dim("grid.X", v); err == nil {
			t.Errorf("dim(%d) accepted", v)
		}
	}
	if u, err := dim("grid.X", 65535); err != nil || u != 65535 {
		t.Errorf("dim(65535) = %d, %v", u, err)
	}
}

func TestCompileErrorFormat(t *testing.T) {
	tests := []struct {
		e    CompileError
		want []string
	}{
		{
			CompileError{File: "basic.cu", Arch: "sm_90", Options: compileOptions("sm_90"), Call: "nvrtcCompileProgram", Code: 6,
				Status: (*nvrtcLib)(nil).status(6), Log: "basic.cu(3): error: identifier \"x\" is undefined\n\n1 error detected in the compilation of \"basic.cu\".\n"},
			[]string{
				"cuda: NVRTC compiling basic.cu for sm_90: nvrtcCompileProgram: NVRTC_ERROR_COMPILATION (6)",
				"options: --gpu-architecture=sm_90 -default-device --std=c++17",
				"compiler log:\nbasic.cu(3): error: identifier \"x\" is undefined\n\n1 error detected",
			},
		},
		{
			CompileError{File: "a.cu", Arch: "compute_120", Call: "nvrtcCreateProgram", Code: 1, Status: (*nvrtcLib)(nil).status(1)},
			[]string{"a.cu for compute_120: nvrtcCreateProgram: NVRTC_ERROR_OUT_OF_MEMORY (1)", "compiler log: (empty)"},
		},
	}
	for _, tc := range tests {
		msg := tc.e.Error()
		for _, w := range tc.want {
			if !strings.Contains(msg, w) {
				t.Errorf("CompileError message lacks %q:\n%s", w, msg)
			}
		}
	}
}

func TestKernelIndexMatchesSources(t *testing.T) {
	for name, file := range kernelFiles() {
		if _, ok := kernelSources()[file]; !ok {
			t.Errorf("kernel %s maps to %s, which is not an embedded source", name, file)
		}
	}
	for _, want := range []string{"gpuctx_empty", "gpuctx_fill_f32", "gpuctx_axpby_f32", "gpuctx_add_i32"} {
		if _, ok := kernelFiles()[want]; !ok {
			t.Errorf("kernel %s missing from package kernels", want)
		}
	}
}

// TestStickyClassification: the statuses after which a CUDA context is unusable
// are recognised (and named without cuGetErrorName); others are not.
func TestStickyClassification(t *testing.T) {
	sticky := map[int32]string{
		214: "CUDA_ERROR_ECC_UNCORRECTABLE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS", 702: "CUDA_ERROR_LAUNCH_TIMEOUT",
		710: "CUDA_ERROR_ASSERT", 714: "CUDA_ERROR_HARDWARE_STACK_ERROR", 715: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
		716: "CUDA_ERROR_MISALIGNED_ADDRESS", 717: "CUDA_ERROR_INVALID_ADDRESS_SPACE", 718: "CUDA_ERROR_INVALID_PC",
		719: "CUDA_ERROR_LAUNCH_FAILED",
	}
	for code, name := range sticky {
		if !stickyCode(code) {
			t.Errorf("%s (%d) is not classified sticky", name, code)
		}
		if got := check(nil, "cuStreamSynchronize", code).Error(); !strings.Contains(got, name) {
			t.Errorf("check(%d) = %q, want it to name %s", code, got, name)
		}
	}
	for _, code := range []int32{0, 1, 2, 4, 100, 201, 400, 500, 600, 701, 999} {
		if stickyCode(code) {
			t.Errorf("status %d classified sticky", code)
		}
	}
	if !errors.Is(check(nil, "cuLaunchKernel", 719), ErrLaunchFailed) || errors.Is(check(nil, "cuLaunchKernel", 700), ErrLaunchFailed) {
		t.Error("ErrLaunchFailed must match CUDA_ERROR_LAUNCH_FAILED (719) only, not CUDA_ERROR_ILLEGAL_ADDRESS (700)")
	}
}

// TestStickyStateLosesDevice: after the first sticky status every later call
// fails with a device-lost error naming that first failure, matching
// hal.ErrDeviceLost; non-sticky errors pass through untouched.
func TestStickyStateLosesDevice(t *testing.T) {
	var s stickyState
	oom := check(nil, "cuMemAlloc_v2", 2)
	if got := s.note(0, oom); got != oom || s.err() != nil {
		t.Fatalf("a non-sticky error changed state: %v, %v", got, s.err())
	}
	if s.note(0, nil) != nil {
		t.Fatal("note(nil) != nil")
	}
	first := s.note(3, check(nil, "cuStreamSynchronize", 700))
	if !errors.Is(first, hal.ErrDeviceLost) || !errors.Is(first, ErrIllegalAddr) {
		t.Fatalf("first sticky error: %v; want hal.ErrDeviceLost wrapping CUDA_ERROR_ILLEGAL_ADDRESS", first)
	}
	second := s.note(3, check(nil, "cuCtxSynchronize", 719))
	later := s.err()
	for _, err := range []error{second, later} {
		if !errors.Is(err, hal.ErrDeviceLost) || !errors.Is(err, ErrIllegalAddr) ||
			!strings.Contains(err.Error(), "cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS (700)") || !strings.Contains(err.Error(), "device 3") {
			t.Errorf("later error %q must be device-lost and name the first failure", err)
		}
	}
	var dl *DeviceLostError
	if !errors.As(later, &dl) || dl.Device != 3 {
		t.Errorf("errors.As(*DeviceLostError): %#v", later)
	}
}

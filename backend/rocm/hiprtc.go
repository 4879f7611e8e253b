package rocm

import (
	"fmt"
	"strings"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/kernels"
)

// hipHeader is prepended to every kernel source before hipRTC compiles it:
// the vendor differences between the CUDA C in package kernels and HIP, so
// that the .cu files keep their CUDA semantics unchanged. The kernels are
// written for 32-lane warps (lane = threadIdx.x & 31, masks 0xffffffff). On
// CDNA a wavefront has 64 lanes, so every warp-level intrinsic is given an
// explicit width of 32: each half of a wavefront then behaves as one CUDA
// warp. HIP's *_sync intrinsics take 64-bit masks and are only declared with
// HIP_ENABLE_WARP_SYNC_BUILTINS, so the CUDA spellings are mapped to the
// width-taking HIP intrinsics instead (the mask is ignored: every kernel here
// passes the full mask).
const hipHeader = `// gpuctx vendor header (HIP): CUDA warp intrinsics on 32-lane halves of a wavefront.
#define GPUCTX_HIP 1
#define __shfl_sync(mask, v, src) __shfl((v), (src), 32)
#define __shfl_xor_sync(mask, v, off) __shfl_xor((v), (off), 32)
#define __shfl_up_sync(mask, v, d) __shfl_up((v), (d), 32)
#define __shfl_down_sync(mask, v, d) __shfl_down((v), (d), 32)
#define __ballot_sync(mask, p) ((unsigned)(__ballot(p) >> (__lane_id() & 32)))
#define __match_any_sync(mask, v) ((unsigned)(__match_any(v) >> (__lane_id() & 32)))
#define __syncwarp(...) do { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront"); __builtin_amdgcn_wave_barrier(); __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront"); } while (0)
#line 1
`

// hipUnsupported lists the kernel files the header cannot port and why; their
// kernels report hal.ErrUnavailable on ROCm until they have a HIP version.
var hipUnsupported = map[string]string{
	"moe_gemm.cu":    "inline PTX (cp.async, ldmatrix, mma.sync for sm_80+ tensor cores) has no HIP equivalent; it needs an MFMA (__builtin_amdgcn_mfma_*) version",
	"moe_fp8_mma.cu": "inline PTX (cp.async, mma.sync, the sm_89 E4M3 conversion) has no HIP equivalent; it needs an MFMA (__builtin_amdgcn_mfma_*) version",
}

// hipFamily returns the source file a compilation unit comes from: package
// moekernels registers moe_gemm.cu once per tile, as moe_gemm_<tag>.cu (tags
// start with "m").
func hipFamily(file string) string {
	if strings.HasPrefix(file, "moe_gemm_m") {
		return "moe_gemm.cu"
	}
	return file
}

// module is one compiled kernel file on one device.
type module struct {
	once sync.Once
	h    uintptr // hipModule_t
	err  error
}

// CompileError is a hipRTC compilation failure with the compiler's log.
type CompileError struct {
	File string
	Log  string
	Err  error
}

// Error names the file, the failed call and the log.
func (e *CompileError) Error() string {
	return fmt.Sprintf("rocm: compiling %s with hipRTC: %v\n%s", e.File, e.Err, e.Log)
}

// Unwrap returns the hipRTC status error (an *RTCError), which matches
// hal.ErrInvalid for a refused source or option.
func (e *CompileError) Unwrap() error { return e.Err }

// RTCError is a failed hipRTC call: the call, the hiprtcResult and its text.
type RTCError struct {
	Call string
	Code int32
	Text string // hiprtcGetErrorString, may be empty
}

// Error reads "hiprtcCompileProgram: HIPRTC_ERROR_COMPILATION (6)".
func (e *RTCError) Error() string { return fmt.Sprintf("%s: %s (%d)", e.Call, e.Text, e.Code) }

// Is matches hal.ErrInvalid (and so gpuctx.ErrInvalid) when the source or the
// options were refused: HIPRTC_ERROR_INVALID_INPUT, INVALID_PROGRAM,
// INVALID_OPTION and COMPILATION.
func (e *RTCError) Is(target error) bool {
	return target == hal.ErrInvalid && e.Code >= 3 && e.Code <= 6
}

func rtcCheck(a *hiprtcAPI, call string, r int32) error {
	if r == 0 {
		return nil
	}
	e := &RTCError{Call: call, Code: r}
	if a.getErrorString != nil {
		e.Text = a.getErrorString(r)
	}
	if e.Text == "" {
		e.Text = "hiprtcResult?"
	}
	return e
}

func cstr(s string) []byte { return append([]byte(s), 0) }

// compile compiles src (with hipHeader prepended) to a code object for the
// current device's architecture (hipRTC's default when no --offload-arch is
// given).
func compile(a *hiprtcAPI, file, src string) ([]byte, error) {
	full := cstr(hipHeader + src)
	name := cstr(file)
	var prog uintptr
	if err := rtcCheck(a, "hiprtcCreateProgram", a.createProgram(&prog, &full[0], &name[0], 0, nil, nil)); err != nil {
		return nil, &CompileError{File: file, Err: err}
	}
	defer a.destroyProgram(&prog)
	opts := [][]byte{cstr("-O3"), cstr("-std=c++17")}
	ptrs := make([]*byte, len(opts))
	for i := range opts {
		ptrs[i] = &opts[i][0]
	}
	if err := rtcCheck(a, "hiprtcCompileProgram", a.compileProgram(prog, int32(len(ptrs)), &ptrs[0])); err != nil {
		var n uintptr
		log := ""
		if a.getLogSize(prog, &n) == 0 && n > 1 {
			buf := make([]byte, n)
			if a.getLog(prog, &buf[0]) == 0 {
				log = cString(buf)
			}
		}
		return nil, &CompileError{File: file, Log: log, Err: err}
	}
	var n uintptr
	if err := rtcCheck(a, "hiprtcGetCodeSize", a.getCodeSize(prog, &n)); err != nil {
		return nil, &CompileError{File: file, Err: err}
	}
	code := make([]byte, n)
	if n > 0 {
		if err := rtcCheck(a, "hiprtcGetCode", a.getCode(prog, &code[0])); err != nil {
			return nil, &CompileError{File: file, Err: err}
		}
	}
	return code, nil
}

var (
	kernelFiles  = sync.OnceValue(kernels.Files)
	kernelParams = sync.OnceValue(kernels.ParamCounts)
	kernelSrcs   = sync.OnceValue(kernels.Sources)
)

// Kernel returns the named kernel: its file is compiled by hipRTC on first
// use and loaded as a module on this device (hipModuleLoadData,
// hipModuleGetFunction).
func (d *device) Kernel(name string) (hal.Kernel, error) {
	file, ok := kernelFiles()[name]
	if !ok {
		return nil, fmt.Errorf("rocm: Kernel(%q): %w", name, hal.ErrNoKernel)
	}
	if why, bad := hipUnsupported[hipFamily(file)]; bad {
		return nil, fmt.Errorf("rocm: Kernel(%q): %s is not ported to HIP: %s: %w", name, file, why, hal.ErrUnavailable)
	}
	if archs := kernels.Archs(file); len(archs) > 0 {
		return nil, fmt.Errorf("rocm: Kernel(%q): %s is written for NVIDIA compute capabilities %v only (architecture-specific PTX): %w", name, file, archs, hal.ErrUnavailable)
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, fmt.Errorf("rocm: Kernel(%q): %w", name, hal.ErrClosed)
	}
	m := d.modules[file]
	if m == nil {
		m = &module{}
		d.modules[file] = m
	}
	d.mu.Unlock()
	m.once.Do(func() {
		a, err := d.b.l.hiprtcLib()
		if err != nil {
			m.err = err
			return
		}
		code, err := compile(a, file, kernelSrcs()[file])
		if err != nil {
			m.err = err
			return
		}
		m.err = d.run("Kernel "+file, func() error {
			return check(d.api, "hipModuleLoadData", d.api.moduleLoadData(&m.h, unsafe.Pointer(&code[0])))
		})
	})
	if m.err != nil {
		return nil, m.err
	}
	k := &kernel{d: d, name: name, params: -1}
	if n, ok := kernelParams()[name]; ok {
		k.params = n
	}
	cname := cstr(name)
	err := d.run("Kernel "+name, func() error {
		return check(d.api, "hipModuleGetFunction", d.api.moduleGetFunction(&k.fn, m.h, &cname[0]))
	})
	if err != nil {
		return nil, err
	}
	return k, nil
}

// hipPortNotes says, per kernel file, what the vendor header does for it; for
// `gpuctx info` and the tests.
func hipPortNotes() []string {
	var out []string
	for file, src := range kernelSrcs() {
		switch {
		case hipUnsupported[hipFamily(file)] != "":
			out = append(out, file+": not ported ("+hipUnsupported[hipFamily(file)]+")")
		case strings.Contains(src, "_sync("):
			out = append(out, file+": warp intrinsics mapped by the vendor header to 32-lane halves of a wavefront")
		default:
			out = append(out, file+": compiles unchanged")
		}
	}
	return out
}

package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/kernels"
)

// nvrtcAPI is the raw NVRTC function table (nvrtc.h, CUDA 12/13).
// nvrtcProgram is an opaque pointer (uintptr), nvrtcResult an int32, size_t
// uintptr, const char* arguments are NUL-terminated *byte.
type nvrtcAPI struct {
	createProgram  func(prog *uintptr, src *byte, name *byte, numHeaders int32, headers unsafe.Pointer, includeNames unsafe.Pointer) int32
	compileProgram func(prog uintptr, numOptions int32, options unsafe.Pointer) int32
	logSize        func(prog uintptr, size *uintptr) int32
	log            func(prog uintptr, buf *byte) int32
	cubinSize      func(prog uintptr, size *uintptr) int32 // optional: NVRTC >= 11.1
	cubin          func(prog uintptr, buf *byte) int32     // optional
	ptxSize        func(prog uintptr, size *uintptr) int32
	ptx            func(prog uintptr, buf *byte) int32
	destroyProgram func(prog *uintptr) int32
	version        func(major, minor *int32) int32
	errorString    func(r int32) string
}

func (a *nvrtcAPI) symbols() []dynload.Symbol {
	return []dynload.Symbol{
		{Name: "nvrtcCreateProgram", Fn: &a.createProgram},
		{Name: "nvrtcCompileProgram", Fn: &a.compileProgram},
		{Name: "nvrtcGetProgramLogSize", Fn: &a.logSize},
		{Name: "nvrtcGetProgramLog", Fn: &a.log},
		{Name: "nvrtcGetCUBINSize", Fn: &a.cubinSize, Optional: true},
		{Name: "nvrtcGetCUBIN", Fn: &a.cubin, Optional: true},
		{Name: "nvrtcGetPTXSize", Fn: &a.ptxSize},
		{Name: "nvrtcGetPTX", Fn: &a.ptx},
		{Name: "nvrtcDestroyProgram", Fn: &a.destroyProgram},
		{Name: "nvrtcVersion", Fn: &a.version},
		{Name: "nvrtcGetErrorString", Fn: &a.errorString},
	}
}

// nvrtcResult values (nvrtc.h).
const (
	nvrtcSuccess       = 0
	nvrtcInvalidOption = 5
	nvrtcCompilation   = 6
)

var nvrtcNames = map[int32]string{
	0: "NVRTC_SUCCESS", 1: "NVRTC_ERROR_OUT_OF_MEMORY", 2: "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	3: "NVRTC_ERROR_INVALID_INPUT", 4: "NVRTC_ERROR_INVALID_PROGRAM", 5: "NVRTC_ERROR_INVALID_OPTION",
	6: "NVRTC_ERROR_COMPILATION", 7: "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
}

var nvrtcSpec = dynload.Spec{
	Name:    "NVRTC",
	Sonames: []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"},
	Pip:     []string{"nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/*/lib"},
	Install: "NVRTC: pip install nvidia-cuda-nvrtc (CUDA 13: nvidia-cuda-nvrtc-cu13), or the CUDA toolkit",
}

// nvrtcLib is the process-wide NVRTC binding.
type nvrtcLib struct {
	lib     *dynload.Library
	api     nvrtcAPI
	version string // e.g. "13.0"
}

var nvrtcState struct {
	mu  sync.Mutex
	lib *nvrtcLib
}

// loadNVRTC loads NVRTC once per process. A failure is not remembered, so a
// later call retries (and returns the loader's diagnosis again).
func loadNVRTC() (*nvrtcLib, error) {
	nvrtcState.mu.Lock()
	defer nvrtcState.mu.Unlock()
	if nvrtcState.lib != nil {
		return nvrtcState.lib, nil
	}
	lib, err := dynload.Open(nvrtcSpec)
	if err != nil {
		return nil, fmt.Errorf("cuda: kernels need NVRTC: %w", err)
	}
	nv := &nvrtcLib{lib: lib}
	if err := lib.Bind(nv.api.symbols()); err != nil {
		lib.Close()
		return nil, fmt.Errorf("cuda: %w", err)
	}
	var major, minor int32
	if r := nv.api.version(&major, &minor); r != nvrtcSuccess {
		lib.Close()
		return nil, fmt.Errorf("cuda: nvrtcVersion: %s", nv.status(r))
	}
	nv.version = fmt.Sprintf("%d.%d", major, minor)
	nvrtcState.lib = nv
	return nv, nil
}

// loadedNVRTC returns NVRTC if it has been loaded, else nil.
func loadedNVRTC() *nvrtcLib {
	nvrtcState.mu.Lock()
	defer nvrtcState.mu.Unlock()
	return nvrtcState.lib
}

// status formats an nvrtcResult as "NVRTC_ERROR_COMPILATION (6)".
func (nv *nvrtcLib) status(r int32) string {
	name := ""
	if nv != nil && nv.api.errorString != nil {
		name = nv.api.errorString(r)
	}
	if name == "" {
		name = nvrtcNames[r]
	}
	if name == "" {
		name = "NVRTC_ERROR_UNKNOWN_STATUS"
	}
	return fmt.Sprintf("%s (%d)", name, r)
}

// CompileError is a failed NVRTC compilation. Its message holds the complete
// compiler log.
type CompileError struct {
	File    string   // source file name, e.g. "basic.cu"
	Arch    string   // e.g. "sm_90" or "compute_90"
	Options []string // every option passed to nvrtcCompileProgram
	Call    string   // the NVRTC call that failed
	Code    int32    // the nvrtcResult
	Status  string   // e.g. "NVRTC_ERROR_COMPILATION (6)"
	Log     string   // the full compiler log (may be empty)
}

// Error names the file, the architecture, the call and its status, the
// options, and then the full compiler log.
func (e *CompileError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "cuda: NVRTC compiling %s for %s: %s: %s", e.File, e.Arch, e.Call, e.Status)
	if len(e.Options) > 0 {
		fmt.Fprintf(&b, "\noptions: %s", strings.Join(e.Options, " "))
	}
	if log := strings.TrimSpace(e.Log); log != "" {
		fmt.Fprintf(&b, "\ncompiler log:\n%s", log)
	} else {
		b.WriteString("\ncompiler log: (empty)")
	}
	return b.String()
}

// Is matches hal.ErrInvalid (and so gpuctx.ErrInvalid) when the source or the
// options were refused: NVRTC_ERROR_INVALID_INPUT, INVALID_PROGRAM,
// INVALID_OPTION and COMPILATION.
func (e *CompileError) Is(target error) bool {
	return target == hal.ErrInvalid && e.Code >= 3 && e.Code <= 6
}

// cstr returns s as a NUL-terminated byte slice.
func cstr(s string) []byte { return append([]byte(s), 0) }

// compileOptions are the NVRTC options for arch. NVRTC optimises fully by
// default (the equivalent of nvcc -O3); there is no -O flag to pass.
func compileOptions(arch string) []string {
	return []string{"--gpu-architecture=" + arch, "-default-device", "--std=c++17"}
}

// compileOnce runs one NVRTC compilation of src for arch and returns CUBIN
// (cubin=true) or NUL-terminated PTX.
func (nv *nvrtcLib) compileOnce(file, src, arch string, cubin bool) ([]byte, error) {
	a := &nv.api
	opts := compileOptions(arch)
	fail := func(call string, r int32, log string) error {
		return &CompileError{File: file, Arch: arch, Options: opts, Call: call, Code: r, Status: nv.status(r), Log: log}
	}
	srcC, nameC := cstr(src), cstr(file)
	var prog uintptr
	if r := a.createProgram(&prog, &srcC[0], &nameC[0], 0, nil, nil); r != nvrtcSuccess {
		return nil, fail("nvrtcCreateProgram", r, "")
	}
	defer a.destroyProgram(&prog)

	optBytes := make([][]byte, len(opts))
	optPtrs := make([]*byte, len(opts))
	for i, o := range opts {
		optBytes[i] = cstr(o)
		optPtrs[i] = &optBytes[i][0]
	}
	r := a.compileProgram(prog, int32(len(optPtrs)), unsafe.Pointer(&optPtrs[0]))
	runtime.KeepAlive(optBytes)
	runtime.KeepAlive(optPtrs)
	runtime.KeepAlive(srcC)
	runtime.KeepAlive(nameC)
	if r != nvrtcSuccess {
		return nil, fail("nvrtcCompileProgram", r, nv.programLog(prog))
	}

	sizeFn, getFn, sizeName, getName := a.ptxSize, a.ptx, "nvrtcGetPTXSize", "nvrtcGetPTX"
	if cubin {
		sizeFn, getFn, sizeName, getName = a.cubinSize, a.cubin, "nvrtcGetCUBINSize", "nvrtcGetCUBIN"
	}
	var n uintptr
	if r := sizeFn(prog, &n); r != nvrtcSuccess {
		return nil, fail(sizeName, r, nv.programLog(prog))
	}
	if n == 0 {
		return nil, nil
	}
	img := make([]byte, n)
	if r := getFn(prog, &img[0]); r != nvrtcSuccess {
		return nil, fail(getName, r, nv.programLog(prog))
	}
	return img, nil
}

// programLog returns the compiler log of prog, or a note why it is missing.
func (nv *nvrtcLib) programLog(prog uintptr) string {
	var n uintptr
	if r := nv.api.logSize(prog, &n); r != nvrtcSuccess {
		return "(nvrtcGetProgramLogSize failed: " + nv.status(r) + ")"
	}
	if n <= 1 {
		return ""
	}
	buf := make([]byte, n)
	if r := nv.api.log(prog, &buf[0]); r != nvrtcSuccess {
		return "(nvrtcGetProgramLog failed: " + nv.status(r) + ")"
	}
	return strings.TrimRight(string(buf), "\x00")
}

// compileSource compiles src for compute capability major.minor: to CUBIN for
// sm_XY (sm_XYa when specific, for files that use architecture-specific
// features), falling back to PTX for compute_XY(a) when this NVRTC cannot emit
// CUBIN or does not know sm_XY. It reports whether the image is PTX.
func (nv *nvrtcLib) compileSource(file, src string, major, minor int, specific bool) (img []byte, isPTX bool, err error) {
	suffix := ""
	if specific {
		suffix = "a"
	}
	if nv.api.cubin != nil && nv.api.cubinSize != nil {
		img, err = nv.compileOnce(file, src, fmt.Sprintf("sm_%d%d%s", major, minor, suffix), true)
		var ce *CompileError
		switch {
		case err == nil && len(img) > 0:
			return img, false, nil
		case err != nil && !(errors.As(err, &ce) && ce.Code == nvrtcInvalidOption):
			return nil, false, err
		}
	}
	img, err = nv.compileOnce(file, src, fmt.Sprintf("compute_%d%d%s", major, minor, suffix), false)
	if err != nil {
		return nil, false, err
	}
	if len(img) == 0 {
		return nil, false, fmt.Errorf("cuda: NVRTC compiling %s for compute_%d%d%s produced no PTX", file, major, minor, suffix)
	}
	return img, true, nil
}

// compiled is one cached compilation (per source file and architecture).
type compiled struct {
	once     sync.Once
	img      []byte
	isPTX    bool
	fromDisk bool // read from the disk cache (kernelcache.go), not compiled
	err      error
}

type compileKey struct {
	file         string
	major, minor int
}

// compileCache holds every compilation of this process: compileKey -> *compiled.
var compileCache sync.Map

// kernelFiles maps kernel names to their source files (package kernels).
var kernelFiles = sync.OnceValue(kernels.Files)

// kernelParams maps kernel names to their declared parameter counts.
var kernelParams = sync.OnceValue(kernels.ParamCounts)

// capList formats compute capabilities (major*10+minor) as "9.0 or 10.0".
func capList(archs []int) string {
	var s []string
	for _, a := range archs {
		s = append(s, fmt.Sprintf("%d.%d", a/10, a%10))
	}
	return strings.Join(s, " or ")
}

// kernelSources maps source files to their text (package kernels).
var kernelSources = sync.OnceValue(kernels.Sources)

// image returns the compiled image of file for major.minor, compiling it at
// most once per process; concurrent callers wait for the one compilation. The
// disk cache (kernelcache.go) is consulted first and filled after compiling.
func image(file string, major, minor int) (*compiled, error) {
	nv, err := loadNVRTC()
	if err != nil {
		return nil, err
	}
	v, _ := compileCache.LoadOrStore(compileKey{file, major, minor}, &compiled{})
	c := v.(*compiled)
	c.once.Do(func() {
		specific := len(kernels.Archs(file)) > 0
		src, arch := kernelSources()[file], fmt.Sprintf("sm_%d%d", major, minor)
		if specific {
			arch += "a"
		}
		key := kernelCacheKey(file, src, compileOptions(arch), arch, nv.version)
		c.img, c.isPTX, c.fromDisk, c.err = processKernelCache().compileCached(key, func() ([]byte, bool, error) {
			return nv.compileSource(file, src, major, minor, specific)
		})
	})
	return c, c.err
}

// Kernel returns the named kernel of package kernels on this device. The
// first call for a source file compiles it with NVRTC for the device's compute
// capability (once per process per architecture) and loads the module on this
// device (once per device); later calls return the cached kernel. Safe for
// concurrent callers. An unknown name wraps hal.ErrNoKernel; a compilation
// failure is a *CompileError with the full compiler log.
func (d *device) Kernel(name string) (hal.Kernel, error) {
	if d.closed.Load() {
		return nil, fmt.Errorf("cuda: Kernel(%q): %w", name, hal.ErrClosed)
	}
	d.modMu.Lock()
	k, ok := d.kernels[name]
	d.modMu.Unlock()
	if ok {
		return k, nil
	}
	file, ok := kernelFiles()[name]
	if !ok {
		var names []string
		for n := range kernelFiles() {
			names = append(names, n)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("cuda: Kernel(%q): %w; known kernels: %s", name, hal.ErrNoKernel, joinNames(names))
	}
	if archs := kernels.Archs(file); len(archs) > 0 && !slices.Contains(archs, 10*d.info.ComputeMajor+d.info.ComputeMinor) {
		return nil, fmt.Errorf("cuda: Kernel(%q): %s is written for compute capability %s (architecture-specific features), this device is %d.%d: %w",
			name, file, capList(archs), d.info.ComputeMajor, d.info.ComputeMinor, hal.ErrUnavailable)
	}
	c, err := image(file, d.info.ComputeMajor, d.info.ComputeMinor)
	if err != nil {
		return nil, err
	}

	d.modMu.Lock()
	defer d.modMu.Unlock()
	if k, ok := d.kernels[name]; ok {
		return k, nil
	}
	err = d.Do(func() error {
		mod, ok := d.modules[file]
		if !ok {
			if err := check(d.api, "cuModuleLoadData", d.api.cuModuleLoadData(&mod, unsafe.Pointer(&c.img[0]))); err != nil {
				kind := "CUBIN"
				if c.isPTX {
					kind = "PTX (a driver older than NVRTC " + loadedNVRTC().version + " cannot load its PTX; update the driver)"
				}
				return fmt.Errorf("loading %s compiled as %s: %w", file, kind, err)
			}
			d.modules[file] = mod
		}
		var fn uintptr
		if err := check(d.api, "cuModuleGetFunction", d.api.cuModuleGetFunction(&fn, mod, name)); err != nil {
			return err
		}
		n, ok := kernelParams()[name]
		if !ok {
			n = -1
		}
		k = &kernel{d: d, name: name, fn: fn, params: d.paramSizes(fn, n)}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: Kernel(%q) on device %d: %w", name, d.info.Index, err)
	}
	d.kernels[name] = k
	return k, nil
}

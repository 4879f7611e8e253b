// Package dynload finds and loads vendor shared libraries (libcuda, libcublas,
// libnvrtc, ...) at run time with purego, so that gpuctx builds with
// CGO_ENABLED=0 and one binary runs whether or not a GPU stack is installed.
//
// Open tries a fixed list of places (see Open) and, when none works, returns a
// *LoadError that lists every path tried with the loader's message, the
// environment variable to set and what to install. Bind looks up a whole
// symbol table at once and reports every missing symbol in one error.
//
// Loading is reference-counted: opening the same library twice returns the same
// *Library, and the library is unloaded when the last Close happens. Every
// function in this package is safe to call from any goroutine.
package dynload

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strings"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// EnvLibraryPath names the environment variable holding extra directories
// (colon separated) that Open searches first.
const EnvLibraryPath = "GPUCTX_LIBRARY_PATH"

// ErrNotFound is wrapped by every *LoadError, so callers can test
// errors.Is(err, dynload.ErrNotFound).
var ErrNotFound = errors.New("shared library not found")

// Spec says what library to look for and where.
type Spec struct {
	// Name is a human name for messages, e.g. "CUDA driver".
	Name string
	// Sonames are the file names to try, preferred first, e.g.
	// {"libcublas.so.13", "libcublas.so.12"}.
	Sonames []string
	// Pip are folders below a Python site-packages directory where NVIDIA's
	// wheels put the library, e.g. "nvidia/cublas/lib", "nvidia/cu13/lib".
	// Entries may be glob patterns ("nvidia/*/lib").
	Pip []string
	// Dirs, when set, are the vendor directories tried after the loader's own
	// search instead of the CUDA ones (e.g. /opt/rocm/lib for ROCm).
	Dirs []string
	// Install tells the user what to install when nothing is found, e.g.
	// "the NVIDIA driver" or "pip install nvidia-cublas".
	Install string
}

// Attempt is one place Open tried.
type Attempt struct {
	Path string // the path or bare soname passed to dlopen
	Err  string // the loader's message, or "no such file"
}

// LoadError is returned by Open when no candidate could be loaded.
type LoadError struct {
	Spec     Spec
	Attempts []Attempt
	// Sites are the Python site-packages directories searched for Spec.Pip.
	Sites []string
}

// Error says what failed and what to do on its first line, then lists every
// path tried, one per line:
//
//	dynload: cannot load CUDA driver (libcuda.so.1, libcuda.so): set GPUCTX_LIBRARY_PATH to ..., or install ...
//	paths tried:
//	  libcuda.so.1: cannot open shared object file: No such file or directory
//	  /usr/local/cuda/lib64/libcuda.so.1: no such file
//
// Summary, Fix and Tried return the parts, for callers that lay them out
// themselves.
func (e *LoadError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "dynload: %s: %s\npaths tried:", e.Summary(), e.Fix())
	for _, t := range e.Tried() {
		b.WriteString("\n  " + t)
	}
	return b.String()
}

// Summary is what failed, e.g. "cannot load CUDA driver (libcuda.so.1,
// libcuda.so)", without the "dynload: " prefix.
func (e *LoadError) Summary() string {
	name := e.Spec.Name
	if name == "" {
		name = strings.Join(e.Spec.Sonames, "/")
	}
	return fmt.Sprintf("cannot load %s (%s)", name, strings.Join(e.Spec.Sonames, ", "))
}

// Fix says what to do: the directory to put in GPUCTX_LIBRARY_PATH and, when
// the Spec says, what to install.
func (e *LoadError) Fix() string {
	s := fmt.Sprintf("set %s to the directory (or colon-separated directories) holding %s",
		EnvLibraryPath, firstOr(e.Spec.Sonames, "the library"))
	if e.Spec.Install != "" {
		s += ", or install " + e.Spec.Install
	}
	return s
}

// Tried lists every place Open tried, one entry each ("path: why"), the
// loader's message without the path repeated, and last the pip wheel folders
// searched when the Spec names any.
func (e *LoadError) Tried() []string {
	var out []string
	for _, a := range e.Attempts {
		msg := strings.TrimPrefix(a.Err, a.Path+": ")
		out = append(out, a.Path+": "+msg)
	}
	if len(e.Spec.Pip) > 0 {
		s := fmt.Sprintf("pip wheel folders %s: searched below %d site-packages dir(s)", strings.Join(e.Spec.Pip, ", "), len(e.Sites))
		if len(e.Sites) > 0 {
			s += " (" + strings.Join(e.Sites, ", ") + ")"
		}
		out = append(out, s)
	}
	return out
}

// Unwrap returns ErrNotFound.
func (e *LoadError) Unwrap() error { return ErrNotFound }

func firstOr(s []string, def string) string {
	if len(s) > 0 {
		return s[0]
	}
	return def
}

// Library is a loaded shared library. It is safe for concurrent use. Symbols
// bound from it stay valid until the last Close of the library.
type Library struct {
	handle uintptr
	path   string
	spec   Spec

	mu   sync.Mutex // guards refs
	refs int        // protected by registry.mu as well when it reaches zero
}

// registry maps dlopen handles to open Libraries (reference counting).
var registry = struct {
	sync.Mutex
	byHandle map[uintptr]*Library
}{byHandle: map[uintptr]*Library{}}

// Path is the file the library was loaded from (as the dynamic loader names
// it), or the soname if the loader did not say.
func (l *Library) Path() string { return l.path }

// Name is Spec.Name of the Open call that first loaded the library.
func (l *Library) Name() string { return l.spec.Name }

// Handle is the dlopen handle. It is valid until the last Close.
func (l *Library) Handle() uintptr { return l.handle }

// Open loads the library described by spec. It tries, in order and for each
// soname:
//  1. every directory in $GPUCTX_LIBRARY_PATH (colon separated);
//  2. the bare soname (the loader's own search: LD_LIBRARY_PATH, ld.so.cache,
//     the default directories);
//  3. $CUDA_HOME/lib64, /usr/local/cuda/lib64 and
//     /usr/local/cuda/targets/<arch>-linux/lib;
//  4. the NVIDIA pip wheel folders (spec.Pip) below the site-packages
//     directories of the system Python, ~/.local, $VIRTUAL_ENV, $CONDA_PREFIX
//     and the python3 interpreters on PATH.
//
// The first success wins. If the same shared object is already open, Open
// returns the same *Library and increments its reference count; every
// successful Open must be matched by one Close. On failure it returns a
// *LoadError listing every attempt.
func Open(spec Spec) (*Library, error) {
	if len(spec.Sonames) == 0 {
		return nil, fmt.Errorf("dynload: Open(%q): Spec.Sonames is empty; name at least one file such as libcuda.so.1", spec.Name)
	}
	le := &LoadError{Spec: spec}
	if len(spec.Pip) > 0 {
		le.Sites = sitePackages()
	}
	seen := map[string]bool{}
	for _, cand := range candidates(spec) {
		if seen[cand] {
			continue
		}
		seen[cand] = true
		if strings.ContainsRune(cand, '/') {
			if _, err := os.Stat(cand); err != nil {
				le.Attempts = append(le.Attempts, Attempt{Path: cand, Err: "no such file"})
				continue
			}
		}
		h, err := dlopen(cand)
		if err != nil {
			le.Attempts = append(le.Attempts, Attempt{Path: cand, Err: err.Error()})
			continue
		}
		return register(h, cand, spec), nil
	}
	return nil, le
}

// register returns the Library for handle h, creating it or adding a reference.
func register(h uintptr, cand string, spec Spec) *Library {
	registry.Lock()
	defer registry.Unlock()
	if l, ok := registry.byHandle[h]; ok {
		// dlopen counted this open too; keep exactly one loader reference per Library.
		_ = purego.Dlclose(h)
		l.mu.Lock()
		l.refs++
		l.mu.Unlock()
		return l
	}
	path := loadedPath(h)
	if path == "" {
		path = cand
	}
	l := &Library{handle: h, path: path, spec: spec, refs: 1}
	registry.byHandle[h] = l
	return l
}

// Close drops one reference; the library is unloaded (dlclose) when the last
// reference goes. Closing more often than opening returns an error. Functions
// bound from the library must not be called after its last Close.
func (l *Library) Close() error {
	registry.Lock()
	defer registry.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.refs <= 0 {
		return fmt.Errorf("dynload: Close of %s: library already closed", l.path)
	}
	l.refs--
	if l.refs > 0 {
		return nil
	}
	delete(registry.byHandle, l.handle)
	if err := purego.Dlclose(l.handle); err != nil {
		return fmt.Errorf("dynload: dlclose(%s): %w", l.path, err)
	}
	return nil
}

// Symbol is one function to bind: Fn must be a non-nil pointer to a func
// variable whose Go signature matches the C function (see purego.RegisterFunc).
type Symbol struct {
	Name     string
	Fn       any
	Optional bool // if missing, leave the func variable nil instead of failing
}

// MissingSymbolsError lists every required symbol Bind could not find.
type MissingSymbolsError struct {
	Library string
	Missing []string
}

// Error names the library and every missing symbol.
func (e *MissingSymbolsError) Error() string {
	return fmt.Sprintf("dynload: %s lacks %d required symbol(s): %s; the library is probably too old, install a newer version or point %s at one",
		e.Library, len(e.Missing), strings.Join(e.Missing, ", "), EnvLibraryPath)
}

// Bind looks up every symbol, and only if every required one exists binds each
// Fn with purego.RegisterFunc. Missing optional symbols leave their func
// variable nil. If any required symbol is missing it returns one
// *MissingSymbolsError naming all of them and binds nothing.
func (l *Library) Bind(syms []Symbol) error {
	l.mu.Lock()
	closed := l.refs <= 0
	l.mu.Unlock()
	if closed {
		return fmt.Errorf("dynload: Bind on %s after Close", l.path)
	}
	addrs := make([]uintptr, len(syms))
	var missing []string
	for i, s := range syms {
		v := reflect.ValueOf(s.Fn)
		if !v.IsValid() || v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Func {
			return fmt.Errorf("dynload: Bind %s: Symbol %q has Fn of type %T; want a non-nil pointer to a func variable", l.path, s.Name, s.Fn)
		}
		a, err := l.Lookup(s.Name)
		if err != nil {
			if !s.Optional {
				missing = append(missing, s.Name)
			}
			continue
		}
		addrs[i] = a
	}
	if len(missing) > 0 {
		return &MissingSymbolsError{Library: l.path, Missing: missing}
	}
	for i, s := range syms {
		if addrs[i] == 0 {
			reflect.ValueOf(s.Fn).Elem().SetZero()
			continue
		}
		if err := register1(s, addrs[i]); err != nil {
			return fmt.Errorf("dynload: Bind %s: %w", l.path, err)
		}
	}
	return nil
}

func register1(s Symbol, addr uintptr) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("symbol %q: Go signature %T not supported: %v", s.Name, s.Fn, r)
		}
	}()
	purego.RegisterFunc(s.Fn, addr)
	return nil
}

// Lookup returns the address of symbol name, or an error naming it.
func (l *Library) Lookup(name string) (uintptr, error) {
	runtime.LockOSThread() // dlerror is per thread
	defer runtime.UnlockOSThread()
	a, err := purego.Dlsym(l.handle, name)
	if err != nil {
		return 0, fmt.Errorf("dynload: %s: symbol %s: %w", l.path, name, err)
	}
	return a, nil
}

// dlopen loads path with RTLD_NOW|RTLD_LOCAL on one OS thread, so that the
// loader's per-thread error message belongs to this call.
func dlopen(path string) (uintptr, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
}

// candidates lists the paths to try, in order (see Open).
func candidates(spec Spec) []string {
	var out []string
	add := func(dirs []string) {
		for _, so := range spec.Sonames {
			for _, d := range dirs {
				out = append(out, filepath.Join(d, so))
			}
		}
	}
	add(splitList(os.Getenv(EnvLibraryPath)))
	out = append(out, spec.Sonames...)
	if spec.Dirs != nil {
		add(spec.Dirs)
		add(pipDirs(spec.Pip))
		return out
	}
	var cuda []string
	if h := os.Getenv("CUDA_HOME"); h != "" {
		cuda = append(cuda, filepath.Join(h, "lib64"))
	}
	if h := os.Getenv("CUDA_PATH"); h != "" {
		cuda = append(cuda, filepath.Join(h, "lib64"))
	}
	cuda = append(cuda, "/usr/local/cuda/lib64", "/usr/local/cuda/targets/"+targetArch()+"/lib")
	add(cuda)
	add(pipDirs(spec.Pip))
	return out
}

func targetArch() string {
	if runtime.GOARCH == "arm64" {
		return "sbsa-linux"
	}
	return "x86_64-linux"
}

func splitList(s string) []string {
	var out []string
	for _, d := range strings.Split(s, ":") {
		if d = strings.TrimSpace(d); d != "" {
			out = append(out, d)
		}
	}
	return out
}

// pipDirs returns the existing folders matching each pip pattern below every
// site-packages directory found.
func pipDirs(patterns []string) []string {
	if len(patterns) == 0 {
		return nil
	}
	var out []string
	seen := map[string]bool{}
	for _, site := range sitePackages() {
		for _, p := range patterns {
			ms, _ := filepath.Glob(filepath.Join(site, p))
			sort.Strings(ms)
			for _, m := range ms {
				if !seen[m] {
					seen[m] = true
					out = append(out, m)
				}
			}
		}
	}
	return out
}

// sitePackages lists site-packages and dist-packages directories that exist,
// found without running Python.
func sitePackages() []string {
	var prefixes []string
	for _, p := range []string{os.Getenv("VIRTUAL_ENV"), os.Getenv("CONDA_PREFIX")} {
		if p != "" {
			prefixes = append(prefixes, p)
		}
	}
	for _, d := range splitList(os.Getenv("PATH")) {
		exe := filepath.Join(d, "python3")
		if _, err := os.Stat(exe); err != nil {
			continue
		}
		prefixes = append(prefixes, filepath.Dir(d))
		if r, err := filepath.EvalSymlinks(exe); err == nil {
			prefixes = append(prefixes, filepath.Dir(filepath.Dir(r)))
		}
	}
	if home, err := os.UserHomeDir(); err == nil {
		prefixes = append(prefixes, filepath.Join(home, ".local"))
	}
	prefixes = append(prefixes, "/usr/local", "/usr")
	var out []string
	seen := map[string]bool{}
	for _, p := range prefixes {
		for _, pat := range []string{"lib/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages"} {
			ms, _ := filepath.Glob(filepath.Join(p, pat))
			sort.Sort(sort.Reverse(sort.StringSlice(ms))) // newest Python first
			for _, m := range ms {
				if !seen[m] {
					seen[m] = true
					out = append(out, m)
				}
			}
		}
	}
	return out
}

// linkMap is the head of glibc's struct link_map.
type linkMap struct {
	addr uintptr
	name *byte
}

var dlinfo = struct {
	once sync.Once
	fn   func(handle uintptr, request int32, info *unsafe.Pointer) int32
}{}

// loadedPath asks the loader (dlinfo RTLD_DI_LINKMAP) which file handle h is.
// It returns "" if it cannot tell.
func loadedPath(h uintptr) string {
	dlinfo.once.Do(func() {
		a, err := purego.Dlsym(purego.RTLD_DEFAULT, "dlinfo")
		if err == nil && a != 0 {
			purego.RegisterFunc(&dlinfo.fn, a)
		}
	})
	if dlinfo.fn == nil {
		return ""
	}
	const rtldDILinkmap = 2
	var lm unsafe.Pointer
	if dlinfo.fn(h, rtldDILinkmap, &lm) != 0 || lm == nil {
		return ""
	}
	return cString((*linkMap)(lm).name)
}

// cString copies the NUL-terminated C string at p.
func cString(p *byte) string {
	if p == nil {
		return ""
	}
	var n int
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// CString is cString for other packages: it copies the NUL-terminated C
// string at p (nil gives "").
func CString(p *byte) string { return cString(p) }

// Package cpu is the simulated device that CI runs when there is no GPU. It
// implements every interface of internal/hal with CUDA's semantics so that
// ordering, binding and workspace-sharing bugs show up under `go test -race`:
//
//   - device memory is Go memory, kept alive until Free; every copy, kernel and
//     BLAS operation checks that its ranges lie inside one live allocation;
//   - each stream runs its work in issue order on its own goroutine, different
//     streams run concurrently, and events order work across streams;
//   - an error raised by queued work is sticky on its stream, as CUDA's
//     asynchronous errors are;
//   - BLAS handles queue their work on the stream they were bound to, and large-K
//     GEMMs use the workspace for split-K partial sums, so two streams sharing
//     one workspace can corrupt each other's results exactly as on a GPU. The
//     device counts such overlaps (WorkspaceConflicts).
//
// The workspace is read and written with atomic operations, so a shared
// workspace shows up in WorkspaceConflicts, not as a race report; every other
// device memory access is a plain Go access the race detector sees.
package cpu

import (
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/internal/sysmem"
)

// Open returns the CPU backend, which has one device (index 0). It never fails
// today; the error is there for symmetry with the GPU backends. The returned
// Backend is safe for concurrent use.
func Open() (hal.Backend, error) {
	b := &backend{}
	b.dev = newDevice(b)
	return b, nil
}

type backend struct {
	mu     sync.Mutex
	dev    *device
	closed bool
}

// Name reports "cpu".
func (b *backend) Name() string { return "cpu" }

// DeviceCount reports 1.
func (b *backend) DeviceCount() int { return 1 }

// Device returns the single CPU device for i == 0, the same value on every call.
func (b *backend) Device(i int) (hal.Device, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, fmt.Errorf("cpu: Device: backend is closed (open a new one with cpu.Open): %w", hal.ErrClosed)
	}
	if i != 0 {
		return nil, fmt.Errorf("cpu: Device(%d): the CPU backend has only device 0", i)
	}
	return b.dev, nil
}

// Libraries lists gonum, the BLAS implementation the backend uses.
func (b *backend) Libraries() []hal.Library {
	v := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, m := range bi.Deps {
			if m.Path == "gonum.org/v1/gonum" {
				v = m.Version
				if m.Replace != nil {
					v = m.Replace.Version
				}
			}
		}
	}
	return []hal.Library{{Name: "gonum", Path: "", Version: v}}
}

// Close destroys every stream (after its queued work completes) and releases
// all memory. It is idempotent; use of the device afterwards returns errors.
func (b *backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	return b.dev.close()
}

// allocation is one live block of simulated device memory.
type allocation struct {
	base hal.Ptr
	buf  []byte // exactly the requested size, starting at base
}

type device struct {
	backend *backend
	info    hal.DeviceInfo

	mu      sync.RWMutex
	closed  bool
	allocs  map[hal.Ptr]*allocation
	sorted  []hal.Ptr // bases of allocs, ascending, for range lookup
	hosts   map[uintptr][]byte
	streams map[uint64]*stream

	// limit is the memory budget of Alloc and AllocHost in bytes (0: none but
	// the host's); used is what live allocations hold. Both under mu.
	limit uint64
	used  uint64

	// lost holds the first error raised by queued work. Like a sticky CUDA
	// error (illegal address, launch failure) it poisons the whole device:
	// every later call on it fails with an error wrapping hal.ErrDeviceLost and
	// that first failure. Releasing calls (Free, FreeHost, Destroy, Close)
	// still work so that everything can be cleaned up.
	lost atomic.Pointer[error]

	wsMu      sync.Mutex
	wsBusy    map[hal.Ptr]*atomic.Uint64 // workspace address -> ID of the stream using it (0: free)
	conflicts atomic.Int64
	splitKOps atomic.Int64 // GEMMs computed with split-K (tests)
	// wsHook, when set (tests only, before any work is queued), runs while an
	// operation holds its workspace.
	wsHook func()
	// calls checks the library handles' contract (blas.go).
	calls callChecks
}

func newDevice(b *backend) *device {
	total := memTotal()
	return &device{
		backend: b,
		info: hal.DeviceInfo{
			Index:       0,
			Name:        fmt.Sprintf("CPU (%s, %d threads)", runtime.GOARCH, runtime.GOMAXPROCS(0)),
			SMCount:     runtime.NumCPU(),
			TotalMemory: total,
		},
		limit:   memLimit(total),
		allocs:  map[hal.Ptr]*allocation{},
		hosts:   map[uintptr][]byte{},
		streams: map[uint64]*stream{},
		wsBusy:  map[hal.Ptr]*atomic.Uint64{},
	}
}

func memTotal() uint64 { return sysmem.Field("MemTotal") }

// MemoryLimitEnv caps the memory the CPU device lends (bytes; "1e9" and
// "1073741824" both parse). Unset: the host's MemTotal.
const MemoryLimitEnv = "GPUCTX_CPU_MEMORY"

func memLimit(total uint64) uint64 {
	if v := os.Getenv(MemoryLimitEnv); v != "" {
		if f, err := strconv.ParseFloat(v, 64); err == nil && f >= 1 && f < math.MaxUint64 {
			return uint64(f)
		}
	}
	return total
}

// bigAlloc is the size above which Alloc also checks the host's MemAvailable
// (reading /proc/meminfo costs microseconds; small requests skip it).
const bigAlloc = 64 << 20

// reserve charges n bytes to the budget or returns an out-of-memory error like
// CUDA's (wrapping hal.ErrOutOfMemory), so that an absurd request never
// reaches make, whose failure kills the process. Called with mu held.
func (d *device) reserve(call string, n int) error {
	un := uint64(n)
	if d.limit != 0 && (un > d.limit || d.used > d.limit-un) {
		return fmt.Errorf("cpu: %s(%d): %d of the device's %d bytes are in use (limit: $%s or the host's MemTotal): %w",
			call, n, d.used, d.limit, MemoryLimitEnv, hal.ErrOutOfMemory)
	}
	if n > math.MaxInt-256 {
		return fmt.Errorf("cpu: %s(%d): the request exceeds the address space: %w", call, n, hal.ErrOutOfMemory)
	}
	if n >= bigAlloc {
		if avail := sysmem.Field("MemAvailable"); avail != 0 && un > avail {
			return fmt.Errorf("cpu: %s(%d): the host has %d bytes available: %w", call, n, avail, hal.ErrOutOfMemory)
		}
	}
	d.used += un
	return nil
}

func (d *device) close() error {
	d.mu.Lock()
	ss := make([]*stream, 0, len(d.streams))
	for _, s := range d.streams {
		ss = append(ss, s)
	}
	d.mu.Unlock()
	for _, s := range ss {
		_ = s.Destroy() // drains; an already destroyed stream is fine here
	}
	d.mu.Lock()
	d.closed = true
	d.used = 0
	d.allocs = map[hal.Ptr]*allocation{}
	d.sorted = nil
	d.hosts = map[uintptr][]byte{}
	d.mu.Unlock()
	return nil
}

// markLost records err, raised by queued work on stream sid, as the device's
// first sticky error; later errors are ignored.
func (d *device) markLost(sid uint64, err error) {
	e := fmt.Errorf("stream %d: %w", sid, err)
	d.lost.CompareAndSwap(nil, &e)
}

// lostErr returns nil, or, once queued work has failed, an error naming call
// that wraps hal.ErrDeviceLost and the first failure.
func (d *device) lostErr(call string) error {
	if p := d.lost.Load(); p != nil {
		return fmt.Errorf("cpu: %s: %w (every call fails; open a new backend): first failure: %w", call, hal.ErrDeviceLost, *p)
	}
	return nil
}

func (d *device) errClosed(call string) error {
	return fmt.Errorf("cpu: %s: device is closed (open a new backend with cpu.Open): %w", call, hal.ErrClosed)
}

// Info returns the device's static properties.
func (d *device) Info() hal.DeviceInfo { return d.info }

// PriorityRange returns CUDA's range (0, -5); the CPU backend accepts and
// ignores priorities.
func (d *device) PriorityRange() (least, greatest int) { return 0, -5 }

// Alloc returns n bytes of zeroed host memory posing as device memory, 256-byte
// aligned, kept alive until Free. Safe for concurrent use.
func (d *device) Alloc(n int) (hal.Ptr, error) {
	if err := d.lostErr("Alloc"); err != nil {
		return 0, err
	}
	if n <= 0 {
		return 0, fmt.Errorf("cpu: Alloc(%d): size must be positive", n)
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return 0, d.errClosed("Alloc")
	}
	err := d.reserve("Alloc", n)
	d.mu.Unlock()
	if err != nil {
		return 0, err
	}
	raw := make([]byte, n+255)
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(raw)))
	off := int((addr+255)&^255 - addr)
	a := &allocation{base: hal.Ptr(addr) + hal.Ptr(off), buf: raw[off : off+n : off+n]}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		d.used -= uint64(n)
		return 0, d.errClosed("Alloc")
	}
	d.allocs[a.base] = a
	i := sort.Search(len(d.sorted), func(i int) bool { return d.sorted[i] >= a.base })
	d.sorted = append(d.sorted, 0)
	copy(d.sorted[i+1:], d.sorted[i:])
	d.sorted[i] = a.base
	return a.base, nil
}

// Free releases memory from Alloc. Work still queued that uses the memory fails
// with an error wrapping hal.ErrBadPointer. Safe for concurrent use.
func (d *device) Free(p hal.Ptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.allocs[p]; !ok {
		return fmt.Errorf("cpu: Free(%#x): %w (unknown or already freed; pass a pointer returned by Alloc)", uintptr(p), hal.ErrBadPointer)
	}
	d.used -= uint64(len(d.allocs[p].buf))
	delete(d.allocs, p)
	i := sort.Search(len(d.sorted), func(i int) bool { return d.sorted[i] >= p })
	d.sorted = append(d.sorted[:i], d.sorted[i+1:]...)
	return nil
}

// mem returns the bytes [p, p+n) if they lie inside one live allocation and p
// is a multiple of align; otherwise an error naming call that wraps
// hal.ErrBadPointer. n == 0 returns an empty slice for any p.
func (d *device) mem(call string, p hal.Ptr, n int, align int) ([]byte, error) {
	if n < 0 {
		return nil, fmt.Errorf("cpu: %s: negative size %d", call, n)
	}
	if n == 0 {
		return nil, nil
	}
	if align > 1 && uintptr(p)%uintptr(align) != 0 {
		return nil, fmt.Errorf("cpu: %s: pointer %#x is not %d-byte aligned: %w", call, uintptr(p), align, hal.ErrBadPointer)
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	i := sort.Search(len(d.sorted), func(i int) bool { return d.sorted[i] > p }) - 1
	if i < 0 {
		return nil, fmt.Errorf("cpu: %s: %#x is not inside any live allocation: %w", call, uintptr(p), hal.ErrBadPointer)
	}
	a := d.allocs[d.sorted[i]]
	off := uint64(p - a.base)
	if off >= uint64(len(a.buf)) || uint64(n) > uint64(len(a.buf))-off {
		return nil, fmt.Errorf("cpu: %s: [%#x, +%d) does not fit in the allocation [%#x, +%d): %w",
			call, uintptr(p), n, uintptr(a.base), len(a.buf), hal.ErrBadPointer)
	}
	return a.buf[off : off+uint64(n) : off+uint64(n)], nil
}

// AllocHost returns n bytes of zeroed host memory, 256-byte aligned, kept alive
// until FreeHost ("pinned" has no meaning on the CPU). Safe for concurrent use.
func (d *device) AllocHost(n int) (unsafe.Pointer, error) {
	if err := d.lostErr("AllocHost"); err != nil {
		return nil, err
	}
	if n <= 0 {
		return nil, fmt.Errorf("cpu: AllocHost(%d): size must be positive", n)
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, d.errClosed("AllocHost")
	}
	err := d.reserve("AllocHost", n)
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	raw := make([]byte, n+255)
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(raw)))
	off := int((addr+255)&^255 - addr)
	buf := raw[off : off+n : off+n]
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		d.used -= uint64(n)
		return nil, d.errClosed("AllocHost")
	}
	p := unsafe.Pointer(unsafe.SliceData(buf))
	d.hosts[uintptr(p)] = buf
	return p, nil
}

// FreeHost releases memory from AllocHost. Safe for concurrent use.
func (d *device) FreeHost(p unsafe.Pointer) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.hosts[uintptr(p)]; !ok {
		return fmt.Errorf("cpu: FreeHost(%p): %w (unknown or already freed; pass a pointer returned by AllocHost)", p, hal.ErrBadPointer)
	}
	d.used -= uint64(len(d.hosts[uintptr(p)]))
	delete(d.hosts, uintptr(p))
	return nil
}

// hostBytes views n bytes of caller memory at p.
func hostBytes(call string, p unsafe.Pointer, n int) ([]byte, error) {
	if n < 0 {
		return nil, fmt.Errorf("cpu: %s: negative size %d", call, n)
	}
	if n == 0 {
		return nil, nil
	}
	if p == nil {
		return nil, fmt.Errorf("cpu: %s: nil host pointer for %d bytes", call, n)
	}
	return unsafe.Slice((*byte)(p), n), nil
}

// CopyHtoD copies n bytes from host memory to the device and returns when done.
// It runs on the calling goroutine and does not wait for any stream.
func (d *device) CopyHtoD(dst hal.Ptr, src unsafe.Pointer, n int) error {
	if err := d.lostErr("CopyHtoD"); err != nil {
		return err
	}
	return runNow(d.copyHtoD("CopyHtoD", dst, src, n))
}

// CopyDtoH copies n bytes from the device to host memory and returns when done.
// It runs on the calling goroutine and does not wait for any stream.
func (d *device) CopyDtoH(dst unsafe.Pointer, src hal.Ptr, n int) error {
	if err := d.lostErr("CopyDtoH"); err != nil {
		return err
	}
	return runNow(d.copyDtoH("CopyDtoH", dst, src, n))
}

// CopyDtoD copies n bytes between device ranges (they may overlap) and returns
// when done. It runs on the calling goroutine and does not wait for any stream.
func (d *device) CopyDtoD(dst, src hal.Ptr, n int) error {
	if err := d.lostErr("CopyDtoD"); err != nil {
		return err
	}
	return runNow(d.copyDtoD("CopyDtoD", dst, src, n))
}

func runNow(fn func() error, err error) error {
	if err != nil {
		return err
	}
	return fn()
}

// The copy builders validate their ranges now and return the copy as a closure
// that validates them again when it runs (the memory may be freed in between).

func (d *device) copyHtoD(call string, dst hal.Ptr, src unsafe.Pointer, n int) (func() error, error) {
	h, err := hostBytes(call, src, n)
	if err != nil {
		return nil, err
	}
	if _, err := d.mem(call+" dst", dst, n, 1); err != nil {
		return nil, err
	}
	return func() error {
		m, err := d.mem(call+" dst", dst, n, 1)
		if err != nil {
			return err
		}
		copy(m, h)
		return nil
	}, nil
}

func (d *device) copyDtoH(call string, dst unsafe.Pointer, src hal.Ptr, n int) (func() error, error) {
	h, err := hostBytes(call, dst, n)
	if err != nil {
		return nil, err
	}
	if _, err := d.mem(call+" src", src, n, 1); err != nil {
		return nil, err
	}
	return func() error {
		m, err := d.mem(call+" src", src, n, 1)
		if err != nil {
			return err
		}
		copy(h, m)
		return nil
	}, nil
}

func (d *device) copyDtoD(call string, dst, src hal.Ptr, n int) (func() error, error) {
	run := func() error {
		s, err := d.mem(call+" src", src, n, 1)
		if err != nil {
			return err
		}
		t, err := d.mem(call+" dst", dst, n, 1)
		if err != nil {
			return err
		}
		copy(t, s)
		return nil
	}
	if _, err := d.mem(call+" src", src, n, 1); err != nil {
		return nil, err
	}
	if _, err := d.mem(call+" dst", dst, n, 1); err != nil {
		return nil, err
	}
	return run, nil
}

func (d *device) memset(call string, dst hal.Ptr, v byte, n int) (func() error, error) {
	if _, err := d.mem(call, dst, n, 1); err != nil {
		return nil, err
	}
	return func() error {
		m, err := d.mem(call, dst, n, 1)
		if err != nil {
			return err
		}
		for i := range m {
			m[i] = v
		}
		return nil
	}, nil
}

// NewStream starts a stream: a goroutine that runs the stream's work in order.
// Safe for concurrent use.
func (d *device) NewStream(o hal.StreamOptions) (hal.Stream, error) {
	if err := d.lostErr("NewStream"); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, d.errClosed("NewStream")
	}
	s := newStream(d, o)
	d.streams[s.id] = s
	return s, nil
}

// NewEvent makes an event; timing enables Elapsed. Safe for concurrent use.
func (d *device) NewEvent(timing bool) (hal.Event, error) {
	if err := d.lostErr("NewEvent"); err != nil {
		return nil, err
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return nil, d.errClosed("NewEvent")
	}
	return &event{dev: d, timing: timing}, nil
}

// Synchronize blocks until every stream has run the work queued on it so far
// and returns the streams' sticky errors, joined. Safe for concurrent use.
func (d *device) Synchronize() error {
	d.mu.RLock()
	ss := make([]*stream, 0, len(d.streams))
	for _, s := range d.streams {
		ss = append(ss, s)
	}
	d.mu.RUnlock()
	var errs []error
	for _, s := range ss {
		if err := s.wait(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) == 0 {
		// The stream that failed may be destroyed by now: the device is still lost.
		return d.lostErr("Synchronize")
	}
	return errors.Join(errs...)
}

// MemInfo reports the simulated device's memory as a GPU would: total is its
// budget ($GPUCTX_CPU_MEMORY, else the host's MemTotal), free what the live
// allocations (device and pinned host) leave of it. So a leak of device
// buffers shows in free exactly, as on CUDA; the host's other use does not.
func (d *device) MemInfo() (free, total uint64, err error) {
	if err := d.lostErr("MemInfo"); err != nil {
		return 0, 0, err
	}
	d.mu.Lock()
	total, used := d.limit, d.used
	d.mu.Unlock()
	if total == 0 {
		if total = memTotal(); total == 0 {
			return 0, 0, errors.New("cpu: MemInfo: cannot read MemTotal from /proc/meminfo")
		}
	}
	return total - min(used, total), total, nil
}

// WorkspaceConflicts reports how many times a BLAS operation started while
// another stream's operation held the same workspace address (the workspace
// sharing bug that corrupts results on a GPU). Safe for concurrent use.
func (d *device) WorkspaceConflicts() int64 { return d.conflicts.Load() }

// acquireWorkspace marks the workspace at p busy with stream sid and reports
// whether it did; when another stream already holds it, it counts a conflict and
// the caller proceeds anyway (as a GPU would).
func (d *device) acquireWorkspace(p hal.Ptr, sid uint64) (release func()) {
	d.wsMu.Lock()
	rec := d.wsBusy[p]
	if rec == nil {
		rec = new(atomic.Uint64)
		d.wsBusy[p] = rec
	}
	d.wsMu.Unlock()
	if !rec.CompareAndSwap(0, sid) {
		d.conflicts.Add(1)
		return func() {}
	}
	return func() { rec.CompareAndSwap(sid, 0) }
}

var (
	_ hal.Backend          = (*backend)(nil)
	_ hal.Device           = (*device)(nil)
	_ hal.WorkspaceChecker = (*device)(nil)
)

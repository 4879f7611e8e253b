package gpuctx

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Device is one GPU (or the CPU backend's simulated device). All methods are safe
// for concurrent use.
type Device struct {
	rt   *Runtime
	hd   hal.Device
	info DeviceInfo

	mu       sync.Mutex
	closed   bool
	allocs   map[*allocation]struct{}
	hosts    map[*HostBuffer]struct{}
	streams  map[*Stream]struct{}
	events   map[*Event]struct{}
	contexts map[*ctxCore]struct{}
	graphs   map[*Graph]struct{}

	blas blasState // handle pools and per-stream workspaces (context.go)

	tracer atomic.Pointer[Tracer] // nil unless tracing (trace.go)
	kstats kernelStats            // Device.Kernel lookups (kernelstats.go)
}

func newDevice(r *Runtime, hd hal.Device) *Device {
	d := &Device{rt: r, hd: hd, info: DeviceInfo(hd.Info()),
		allocs: map[*allocation]struct{}{}, hosts: map[*HostBuffer]struct{}{},
		streams: map[*Stream]struct{}{}, events: map[*Event]struct{}{}, contexts: map[*ctxCore]struct{}{}, graphs: map[*Graph]struct{}{}}
	d.blas.init(d)
	return d
}

// Info returns the device's properties.
func (d *Device) Info() DeviceInfo { return d.info }

// Backend returns the name of the device's backend: "cuda", "rocm" or "cpu".
func (d *Device) Backend() string { return d.rt.be.Name() }

// MemInfo reports free and total device memory in bytes.
func (d *Device) MemInfo() (free, total uint64, err error) {
	if err := d.check("Device.MemInfo"); err != nil {
		return 0, 0, err
	}
	return d.hd.MemInfo()
}

func (d *Device) check(op string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("gpuctx: %s: device %d: %w", op, d.info.Index, ErrClosed)
	}
	return nil
}

// Synchronize blocks until all work queued on the device's streams is done.
func (d *Device) Synchronize() error {
	if err := d.check("Device.Synchronize"); err != nil {
		return err
	}
	return d.hd.Synchronize()
}

// Close waits for the device's work, then releases everything made from it:
// contexts (BLAS handles, workspaces), streams, events, buffers and host
// buffers. Objects made from the device return ErrClosed afterwards. Double
// Close is harmless.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.mu.Unlock()
	errs := []error{d.hd.Synchronize()}
	if t := d.tracer.Load(); t != nil {
		errs = append(errs, t.Close()) // its events belong to the device
	}
	d.mu.Lock()
	ctxs := keys(d.contexts)
	d.mu.Unlock()
	for _, c := range ctxs {
		errs = append(errs, c.close())
	}
	errs = append(errs, d.blas.close())
	d.mu.Lock()
	d.closed = true
	streams, events, allocs, hosts, graphs := keys(d.streams), keys(d.events), keys(d.allocs), keys(d.hosts), keys(d.graphs)
	d.mu.Unlock()
	for _, g := range graphs {
		errs = append(errs, g.destroy())
	}
	for _, s := range streams {
		errs = append(errs, s.destroy())
	}
	for _, e := range events {
		errs = append(errs, e.destroy())
	}
	for _, a := range allocs {
		if a.freed.CompareAndSwap(false, true) {
			errs = append(errs, d.hd.Free(a.ptr))
		}
	}
	for _, h := range hosts {
		errs = append(errs, h.free())
	}
	return errors.Join(errs...)
}

func keys[K comparable, V any](m map[K]V) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// allocation is one device allocation shared by a Buffer and its views.
type allocation struct {
	ptr   hal.Ptr
	size  int
	freed atomic.Bool

	mu     sync.Mutex // guards leases, and freed against a new lease (native.go)
	leases int        // Stream.WithNative callbacks using the allocation
}

// Buffer is a range of device memory: a whole allocation from Device.Alloc, or a
// view of one made by Slice. Buffers carry no element type; operations say how
// to read them.
type Buffer struct {
	dev  *Device
	a    *allocation
	off  int
	size int
	view bool
}

// Alloc returns n bytes of uninitialised device memory, 256-byte aligned. It
// does not wait for any stream.
func (d *Device) Alloc(n int) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpuctx: Device.Alloc: size %d bytes must be > 0: %w", n, ErrSize)
	}
	if err := d.check("Device.Alloc"); err != nil {
		return nil, err
	}
	p, err := d.hd.Alloc(n)
	if err != nil {
		return nil, fmt.Errorf("gpuctx: Device.Alloc(%d bytes) on device %d: %w", n, d.info.Index, err)
	}
	a := &allocation{ptr: p, size: n}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		_ = d.hd.Free(p)
		return nil, fmt.Errorf("gpuctx: Device.Alloc: %w", ErrClosed)
	}
	d.allocs[a] = struct{}{}
	d.mu.Unlock()
	return &Buffer{dev: d, a: a, size: n}, nil
}

// Device returns the device that owns b.
func (b *Buffer) Device() *Device { return b.dev }

// Size returns b's length in bytes (0 for a nil buffer).
func (b *Buffer) Size() int {
	if b == nil {
		return 0
	}
	return b.size
}

// Slice returns a view of n bytes of b starting at byte off. The view shares b's
// memory, becomes invalid when b is freed, and cannot itself be freed.
func (b *Buffer) Slice(off, n int) (*Buffer, error) {
	if err := b.valid("Buffer.Slice"); err != nil {
		return nil, err
	}
	if off < 0 || n < 0 || off+n > b.size {
		return nil, fmt.Errorf("gpuctx: Buffer.Slice(%d, %d) out of range of a %d-byte buffer: %w", off, n, b.size, ErrSize)
	}
	return &Buffer{dev: b.dev, a: b.a, off: b.off + off, size: n, view: true}, nil
}

// Ptr returns the device address of b's first byte, for kernel arguments and
// interop. It is valid until b's allocation is freed.
func (b *Buffer) Ptr() (Ptr, error) {
	if err := b.valid("Buffer.Ptr"); err != nil {
		return 0, err
	}
	return Ptr(b.a.ptr + hal.Ptr(b.off)), nil
}

func (b *Buffer) ptr() hal.Ptr { return b.a.ptr + hal.Ptr(b.off) }

func (b *Buffer) valid(op string) error {
	if b == nil {
		return fmt.Errorf("gpuctx: %s: nil buffer: %w", op, ErrInvalid)
	}
	if err := b.dev.check(op); err != nil { // a closed device freed everything: say so
		return err
	}
	if b.a.freed.Load() {
		return fmt.Errorf("gpuctx: %s: %w", op, ErrFreed)
	}
	return nil
}

// onDevice checks b is live and belongs to d.
func (b *Buffer) onDevice(op string, d *Device) error {
	if err := b.valid(op); err != nil {
		return err
	}
	if b.dev != d {
		return fmt.Errorf("gpuctx: %s: buffer of device %d used on device %d: %w", op, b.dev.info.Index, d.info.Index, ErrWrongDevice)
	}
	return nil
}

// Free releases b's memory. It does not wait for streams that still use it:
// synchronise them first. Freeing a view, or freeing twice, is an error, and so
// is freeing while a Stream.WithNative callback holds b (ErrInvalid).
func (b *Buffer) Free() error {
	if b == nil {
		return fmt.Errorf("gpuctx: Buffer.Free: nil buffer: %w", ErrInvalid)
	}
	if b.view {
		return fmt.Errorf("gpuctx: Buffer.Free: b is a view made by Slice; free the buffer it came from: %w", ErrInvalid)
	}
	if busy, double := b.a.markFreed(); busy {
		return fmt.Errorf("gpuctx: Buffer.Free: buffer in use by a Stream.WithNative callback: %w", ErrInvalid)
	} else if double {
		return fmt.Errorf("gpuctx: Buffer.Free: %w (double free)", ErrFreed)
	}
	d := b.dev
	d.mu.Lock()
	delete(d.allocs, b.a)
	closed := d.closed
	d.mu.Unlock()
	if closed {
		return nil // Device.Close freed it
	}
	return d.hd.Free(b.a.ptr)
}

// CopyFromHost copies len(src) bytes from host memory into b, synchronously. It
// does not wait for work queued on streams: synchronise them first.
func (b *Buffer) CopyFromHost(src []byte) error {
	if err := b.valid("Buffer.CopyFromHost"); err != nil {
		return err
	}
	if len(src) != b.size {
		return fmt.Errorf("gpuctx: Buffer.CopyFromHost: %d source bytes for a %d-byte buffer (use Slice for part of a buffer): %w", len(src), b.size, ErrSize)
	}
	if len(src) == 0 {
		return nil
	}
	return b.dev.hd.CopyHtoD(b.ptr(), unsafe.Pointer(&src[0]), len(src))
}

// CopyToHost copies b into dst (len(dst) == b.Size()), synchronously. It does
// not wait for work queued on streams: synchronise them first.
func (b *Buffer) CopyToHost(dst []byte) error {
	if err := b.valid("Buffer.CopyToHost"); err != nil {
		return err
	}
	if len(dst) != b.size {
		return fmt.Errorf("gpuctx: Buffer.CopyToHost: %d destination bytes for a %d-byte buffer: %w", len(dst), b.size, ErrSize)
	}
	if len(dst) == 0 {
		return nil
	}
	return b.dev.hd.CopyDtoH(unsafe.Pointer(&dst[0]), b.ptr(), len(dst))
}

// CopyFrom copies src into b (same size), device to device, synchronously.
func (b *Buffer) CopyFrom(src *Buffer) error {
	if err := b.valid("Buffer.CopyFrom"); err != nil {
		return err
	}
	if err := src.onDevice("Buffer.CopyFrom", b.dev); err != nil {
		return err
	}
	if src.size != b.size {
		return fmt.Errorf("gpuctx: Buffer.CopyFrom: source has %d bytes, destination %d: %w", src.size, b.size, ErrSize)
	}
	return b.dev.hd.CopyDtoD(b.ptr(), src.ptr(), b.size)
}

// HostBuffer is page-locked host memory, the source or destination of
// asynchronous copies. Its bytes must not be touched while a stream copy that
// uses it is in flight.
type HostBuffer struct {
	dev   *Device
	p     unsafe.Pointer
	size  int
	freed atomic.Bool
}

// AllocHost returns n bytes of page-locked host memory.
func (d *Device) AllocHost(n int) (*HostBuffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpuctx: Device.AllocHost: size %d bytes must be > 0: %w", n, ErrSize)
	}
	if err := d.check("Device.AllocHost"); err != nil {
		return nil, err
	}
	p, err := d.hd.AllocHost(n)
	if err != nil {
		return nil, fmt.Errorf("gpuctx: Device.AllocHost(%d bytes): %w", n, err)
	}
	h := &HostBuffer{dev: d, p: p, size: n}
	d.mu.Lock()
	d.hosts[h] = struct{}{}
	d.mu.Unlock()
	return h, nil
}

// Bytes returns the memory as a byte slice (nil once freed).
func (h *HostBuffer) Bytes() []byte {
	if h == nil || h.freed.Load() {
		return nil
	}
	return unsafe.Slice((*byte)(h.p), h.size)
}

// Size returns h's length in bytes (0 for nil).
func (h *HostBuffer) Size() int {
	if h == nil {
		return 0
	}
	return h.size
}

// Free releases h. Double free is an error.
func (h *HostBuffer) Free() error {
	if h == nil {
		return fmt.Errorf("gpuctx: HostBuffer.Free: nil host buffer: %w", ErrInvalid)
	}
	if err := h.dev.check("HostBuffer.Free"); err != nil {
		return err
	}
	if h.freed.Load() {
		return fmt.Errorf("gpuctx: HostBuffer.Free: %w (double free)", ErrFreed)
	}
	h.dev.mu.Lock()
	delete(h.dev.hosts, h)
	h.dev.mu.Unlock()
	return h.free()
}

func (h *HostBuffer) free() error {
	if !h.freed.CompareAndSwap(false, true) {
		return nil
	}
	return h.dev.hd.FreeHost(h.p)
}

func (h *HostBuffer) valid(op string, off, n int) error {
	if h == nil {
		return fmt.Errorf("gpuctx: %s: nil host buffer: %w", op, ErrInvalid)
	}
	if err := h.dev.check(op); err != nil {
		return err
	}
	if h.freed.Load() {
		return fmt.Errorf("gpuctx: %s: host buffer: %w", op, ErrFreed)
	}
	if off < 0 || n < 0 || off+n > h.size {
		return fmt.Errorf("gpuctx: %s: host range [%d, %d) outside a %d-byte host buffer: %w", op, off, off+n, h.size, ErrSize)
	}
	return nil
}

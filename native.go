package gpuctx

import (
	"fmt"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Native is what Stream.WithNative lends to its callback: the vendor handle of
// the stream and the device addresses of the leased buffers. Its values are
// valid only until the callback returns; keeping them longer is a
// use-after-free waiting to happen (the stream may be destroyed and the memory
// freed once the callback has returned).
type Native struct {
	// Stream is the vendor stream handle (CUstream, hipStream_t) that the
	// stream wraps, or 0 on a backend without vendor streams (cpu).
	Stream uintptr
	// Ptrs[i] is the device address of the first byte of the i-th buffer
	// passed to WithNative (0 for a nil buffer).
	Ptrs []Ptr
}

// WithNative is the escape hatch for vendor libraries that queue their own
// work on a gpuctx stream (NCCL): it runs fn with s's vendor handle and the
// device addresses of bufs in n, on one OS thread with the device's context
// current (as OnThread does), and holds leases on s and on every buffer of
// bufs until fn returns:
//   - s cannot close meanwhile: Stream.Close and Device.Close wait for fn to
//     return (and then, as always, for the work queued on s, fn's included);
//   - no buffer of bufs (nor the allocation a view of bufs belongs to) can be
//     freed: Buffer.Free fails with an error wrapping ErrInvalid while a lease
//     is held, so a buffer is never freed between the check and its use.
//
// fn must queue its work on n.Stream and must not keep n's values after it
// returns. It must not call methods of s (they would wait behind a Close
// waiting for fn) nor free bufs. WithNative itself queues nothing and waits for
// no device work. Nil entries of bufs are allowed (address 0). On a nil or
// closed stream, a closed device, a freed buffer or a buffer of another device
// it returns an error (ErrInvalid, ErrClosed, ErrFreed, ErrWrongDevice) without
// running fn; otherwise it returns fn's error. Safe for concurrent use.
func (s *Stream) WithNative(bufs []*Buffer, fn func(n Native) error) error {
	const op = "Stream.WithNative"
	if fn == nil {
		return fmt.Errorf("gpuctx: %s: nil callback: %w", op, ErrInvalid)
	}
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	n := Native{Ptrs: make([]Ptr, len(bufs))}
	if r, ok := s.hs.(hal.RawStream); ok {
		n.Stream = r.Handle()
	}
	for i, b := range bufs {
		if b == nil {
			continue
		}
		if err := b.lease(op, s.dev); err != nil {
			releaseAll(bufs[:i])
			return fmt.Errorf("gpuctx: %s: buffer %d: %w", op, i, err)
		}
		n.Ptrs[i] = Ptr(b.ptr())
	}
	defer releaseAll(bufs)
	return s.dev.OnThread(func() error { return fn(n) })
}

// lease takes a lease on b's allocation for a WithNative callback on device
// d: b must be live and belong to d. Free fails until release.
func (b *Buffer) lease(op string, d *Device) error {
	if err := b.onDevice(op, d); err != nil {
		return err
	}
	a := b.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.freed.Load() {
		return fmt.Errorf("gpuctx: %s: %w", op, ErrFreed)
	}
	a.leases++
	return nil
}

// releaseAll returns the leases taken on the non-nil buffers of bufs.
func releaseAll(bufs []*Buffer) {
	for _, b := range bufs {
		if b != nil {
			b.a.mu.Lock()
			b.a.leases--
			b.a.mu.Unlock()
		}
	}
}

// markFreed marks a freed unless a lease holds it (busy) or it was freed
// before (double).
func (a *allocation) markFreed() (busy, double bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.leases > 0 {
		return true, false
	}
	return false, !a.freed.CompareAndSwap(false, true)
}

// OnThread runs fn on one OS thread with the device's context current (CUDA,
// ROCm), so that fn may call a vendor library that uses the current device
// (NCCL); on other backends it runs fn directly. It returns fn's error.
func (d *Device) OnThread(fn func() error) error {
	if err := d.check("Device.OnThread"); err != nil {
		return err
	}
	if r, ok := d.hd.(hal.Runner); ok {
		return r.Do(fn)
	}
	return fn()
}

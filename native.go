package gpuctx

import (
	"fmt"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// NativeHandle returns the vendor stream handle (CUstream, hipStream_t) that
// s wraps, for libraries that queue their own work on it (NCCL). It fails
// with ErrUnavailable on backends without vendor streams (cpu) and with
// ErrClosed after Close. The handle is valid until s is closed.
func (s *Stream) NativeHandle() (uintptr, error) {
	done, err := s.use("Stream.NativeHandle")
	if err != nil {
		return 0, err
	}
	defer done()
	r, ok := s.hs.(hal.RawStream)
	if !ok {
		return 0, fmt.Errorf("gpuctx: Stream.NativeHandle: backend %s has no vendor stream handle: %w", s.dev.Backend(), ErrUnavailable)
	}
	return r.Handle(), nil
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

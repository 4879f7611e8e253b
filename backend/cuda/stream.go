package cuda

import (
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// stream implements hal.Stream and hal.RawStream with a CUstream.
type stream struct {
	d         *device
	h         uintptr // CUstream
	id        uint64
	destroyed atomic.Bool
}

// Handle returns the CUstream. It stays valid until Destroy or Close.
func (s *stream) Handle() uintptr { return s.h }

// ID returns the process-unique stream number.
func (s *stream) ID() uint64 { return s.id }

// do runs fn inside the device's Do after checking the stream is alive.
func (s *stream) do(call string, fn func() error) error {
	if s.destroyed.Load() {
		return fmt.Errorf("cuda: stream %d: %s: %w", s.id, call, hal.ErrClosed)
	}
	return s.d.Do(fn)
}

// CopyHtoDAsync queues a copy of n bytes from host src (from AllocHost) to
// device dst on s (cuMemcpyHtoDAsync_v2). src must stay untouched until the
// stream has passed the copy.
func (s *stream) CopyHtoDAsync(dst hal.Ptr, src unsafe.Pointer, n int) error {
	if err := checkSize("CopyHtoDAsync", n); err != nil || n == 0 {
		return err
	}
	return s.do("CopyHtoDAsync", func() error {
		return check(s.d.api, "cuMemcpyHtoDAsync_v2", s.d.api.cuMemcpyHtoDAsy(uintptr(dst), src, uintptr(n), s.h))
	})
}

// CopyDtoHAsync queues a copy of n bytes from device src to host dst (from
// AllocHost) on s (cuMemcpyDtoHAsync_v2). Read dst only after the stream (or
// an event recorded after the copy) has been synchronised.
func (s *stream) CopyDtoHAsync(dst unsafe.Pointer, src hal.Ptr, n int) error {
	if err := checkSize("CopyDtoHAsync", n); err != nil || n == 0 {
		return err
	}
	return s.do("CopyDtoHAsync", func() error {
		return check(s.d.api, "cuMemcpyDtoHAsync_v2", s.d.api.cuMemcpyDtoHAsy(dst, uintptr(src), uintptr(n), s.h))
	})
}

// CopyDtoDAsync queues a device-to-device copy of n bytes on s
// (cuMemcpyDtoDAsync_v2).
func (s *stream) CopyDtoDAsync(dst, src hal.Ptr, n int) error {
	if err := checkSize("CopyDtoDAsync", n); err != nil || n == 0 {
		return err
	}
	return s.do("CopyDtoDAsync", func() error {
		return check(s.d.api, "cuMemcpyDtoDAsync_v2", s.d.api.cuMemcpyDtoDAsy(uintptr(dst), uintptr(src), uintptr(n), s.h))
	})
}

// MemsetAsync queues setting n bytes at dst to value on s (cuMemsetD8Async).
func (s *stream) MemsetAsync(dst hal.Ptr, value byte, n int) error {
	if err := checkSize("MemsetAsync", n); err != nil || n == 0 {
		return err
	}
	return s.do("MemsetAsync", func() error {
		return check(s.d.api, "cuMemsetD8Async", s.d.api.cuMemsetD8Async(uintptr(dst), value, uintptr(n), s.h))
	})
}

// Launch queues kernel k on s (cuLaunchKernel). See launch.go.
func (s *stream) Launch(k hal.Kernel, grid, block hal.Dim3, sharedMem int, args ...any) error {
	kk, ok := k.(*kernel)
	if !ok || kk == nil {
		return fmt.Errorf("cuda: Launch: kernel %T is not a CUDA kernel from this backend", k)
	}
	if kk.d != s.d {
		return fmt.Errorf("cuda: Launch %s: kernel belongs to device %d, stream %d to device %d", kk.name, kk.d.info.Index, s.id, s.d.info.Index)
	}
	return s.launch(kk, grid, block, sharedMem, args, false)
}

// LaunchEarly queues kernel k on s so that it may start before the kernel
// queued ahead of it on s has finished (programmatic dependent launch,
// cuLaunchKernelEx with PROGRAMMATIC_STREAM_SERIALIZATION) where the device
// supports it (compute capability 9.0 and later, a driver with
// cuLaunchKernelEx, GPUCTX_EARLY_LAUNCH not "0"); elsewhere it is Launch.
// k must execute griddepcontrol.wait before it touches memory that earlier
// work on s writes, or writes memory that earlier work reads: the wait
// returns when the kernels ahead of it have completed and their writes are
// visible.
func (s *stream) LaunchEarly(k hal.Kernel, grid, block hal.Dim3, sharedMem int, args ...any) error {
	kk, ok := k.(*kernel)
	if !ok || kk == nil {
		return fmt.Errorf("cuda: LaunchEarly: kernel %T is not a CUDA kernel from this backend", k)
	}
	if kk.d != s.d {
		return fmt.Errorf("cuda: LaunchEarly %s: kernel belongs to device %d, stream %d to device %d", kk.name, kk.d.info.Index, s.id, s.d.info.Index)
	}
	return s.launch(kk, grid, block, sharedMem, args, true)
}

// Wait makes later work on s wait for e's recorded work (cuStreamWaitEvent).
// It does not block the host.
func (s *stream) Wait(e hal.Event) error {
	ev, ok := e.(*event)
	if !ok || ev == nil {
		return fmt.Errorf("cuda: stream %d Wait: event %T is not a CUDA event from this backend", s.id, e)
	}
	if ev.destroyed.Load() {
		return fmt.Errorf("cuda: stream %d Wait: event: %w", s.id, hal.ErrClosed)
	}
	return s.do("Wait", func() error {
		return check(s.d.api, "cuStreamWaitEvent", s.d.api.streamWaitEvent(s.h, ev.h, 0))
	})
}

// Synchronize blocks the host until all work queued on s so far is done
// (cuStreamSynchronize).
func (s *stream) Synchronize() error {
	return s.do("Synchronize", func() error {
		return check(s.d.api, "cuStreamSynchronize", s.d.api.cuStreamSynchronize(s.h))
	})
}

// Query reports whether all work queued on s is done (cuStreamQuery). It does
// not block.
func (s *stream) Query() (bool, error) {
	var r int32
	err := s.do("Query", func() error {
		r = s.d.api.cuStreamQuery(s.h)
		return nil
	})
	return queryResult(s.d.api, "cuStreamQuery", r, err)
}

// queryResult maps a cuStreamQuery/cuEventQuery status to (done, error).
func queryResult(api *driverAPI, call string, r int32, err error) (bool, error) {
	switch {
	case err != nil:
		return false, err
	case r == cudaSuccess:
		return true, nil
	case r == cudaErrorNotReady:
		return false, nil
	}
	return false, check(api, call, r)
}

// Destroy releases s (cuStreamDestroy_v2); work already queued still runs to
// completion. Destroying twice is harmless; other calls afterwards fail with
// hal.ErrClosed.
func (s *stream) Destroy() error {
	if !s.destroyed.CompareAndSwap(false, true) {
		return nil
	}
	s.d.mu.Lock()
	delete(s.d.streams, s)
	s.d.mu.Unlock()
	return s.d.Do(func() error { return check(s.d.api, "cuStreamDestroy_v2", s.d.api.cuStreamDestroy(s.h)) })
}

// event implements hal.Event with a CUevent.
type event struct {
	d         *device
	h         uintptr // CUevent
	timing    bool
	destroyed atomic.Bool
}

func (e *event) do(call string, fn func() error) error {
	if e.destroyed.Load() {
		return fmt.Errorf("cuda: event %s: %w", call, hal.ErrClosed)
	}
	return e.d.Do(fn)
}

// Record captures the work queued on s so far (cuEventRecord). s must belong
// to the same device.
func (e *event) Record(s hal.Stream) error {
	st, ok := s.(*stream)
	if !ok || st == nil {
		return fmt.Errorf("cuda: event Record: stream %T is not a CUDA stream from this backend", s)
	}
	if st.d != e.d {
		return fmt.Errorf("cuda: event Record: stream %d is on device %d, event on device %d", st.id, st.d.info.Index, e.d.info.Index)
	}
	if st.destroyed.Load() {
		return fmt.Errorf("cuda: event Record on stream %d: %w", st.id, hal.ErrClosed)
	}
	return e.do("Record", func() error { return check(e.d.api, "cuEventRecord", e.d.api.eventRecord(e.h, st.h)) })
}

// Synchronize blocks the host until the recorded work is done
// (cuEventSynchronize). An event never recorded is complete.
func (e *event) Synchronize() error {
	return e.do("Synchronize", func() error { return check(e.d.api, "cuEventSynchronize", e.d.api.cuEventSynchronize(e.h)) })
}

// Query reports whether the recorded work is done (cuEventQuery); it does not
// block.
func (e *event) Query() (bool, error) {
	var r int32
	err := e.do("Query", func() error {
		r = e.d.api.cuEventQuery(e.h)
		return nil
	})
	return queryResult(e.d.api, "cuEventQuery", r, err)
}

// Elapsed returns the GPU time between start and e (cuEventElapsedTime_v2,
// about 0.5 us resolution). Both events must be timing events that have
// been recorded and have completed.
func (e *event) Elapsed(start hal.Event) (time.Duration, error) {
	st, ok := start.(*event)
	if !ok || st == nil {
		return 0, fmt.Errorf("cuda: Elapsed: start event %T is not a CUDA event from this backend", start)
	}
	if !e.timing || !st.timing {
		return 0, fmt.Errorf("cuda: Elapsed: both events must be made with NewEvent(true) (start timing=%v, end timing=%v)", st.timing, e.timing)
	}
	if st.destroyed.Load() {
		return 0, fmt.Errorf("cuda: Elapsed: start event: %w", hal.ErrClosed)
	}
	var ms float32
	err := e.do("Elapsed", func() error {
		if e.d.api.cuEventElapsedTimeV2 != nil {
			return check(e.d.api, "cuEventElapsedTime_v2", e.d.api.cuEventElapsedTimeV2(&ms, st.h, e.h))
		}
		return check(e.d.api, "cuEventElapsedTime", e.d.api.cuEventElapsedTime(&ms, st.h, e.h))
	})
	if err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Destroy releases the event (cuEventDestroy_v2). Destroying twice is
// harmless; other calls afterwards fail with hal.ErrClosed.
func (e *event) Destroy() error {
	if !e.destroyed.CompareAndSwap(false, true) {
		return nil
	}
	e.d.mu.Lock()
	delete(e.d.events, e)
	e.d.mu.Unlock()
	return e.d.Do(func() error { return check(e.d.api, "cuEventDestroy_v2", e.d.api.cuEventDestroy(e.h)) })
}

package rocm

import (
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// stream implements hal.Stream, hal.RawStream and hal.Capturer.
type stream struct {
	d  *device
	h  uintptr // hipStream_t
	id uint64
}

// Handle returns the hipStream_t.
func (s *stream) Handle() uintptr { return s.h }

// ID is unique per stream in the process.
func (s *stream) ID() uint64 { return s.id }

// CopyHtoDAsync queues hipMemcpyHtoDAsync on s.
func (s *stream) CopyHtoDAsync(dst hal.Ptr, src unsafe.Pointer, n int) error {
	return s.d.run("CopyHtoDAsync", func() error {
		return check(s.d.api, "hipMemcpyHtoDAsync", s.d.api.memcpyHtoDAsync(uintptr(dst), src, uintptr(n), s.h))
	})
}

// CopyDtoHAsync queues hipMemcpyDtoHAsync on s.
func (s *stream) CopyDtoHAsync(dst unsafe.Pointer, src hal.Ptr, n int) error {
	return s.d.run("CopyDtoHAsync", func() error {
		return check(s.d.api, "hipMemcpyDtoHAsync", s.d.api.memcpyDtoHAsync(dst, uintptr(src), uintptr(n), s.h))
	})
}

// CopyDtoDAsync queues hipMemcpyDtoDAsync on s.
func (s *stream) CopyDtoDAsync(dst, src hal.Ptr, n int) error {
	return s.d.run("CopyDtoDAsync", func() error {
		return check(s.d.api, "hipMemcpyDtoDAsync", s.d.api.memcpyDtoDAsync(uintptr(dst), uintptr(src), uintptr(n), s.h))
	})
}

// MemsetAsync queues hipMemsetD8Async on s.
func (s *stream) MemsetAsync(dst hal.Ptr, value byte, n int) error {
	return s.d.run("MemsetAsync", func() error {
		return check(s.d.api, "hipMemsetD8Async", s.d.api.memsetD8Async(uintptr(dst), value, uintptr(n), s.h))
	})
}

// Wait makes later work on s wait for e (hipStreamWaitEvent).
func (s *stream) Wait(e hal.Event) error {
	ev, ok := e.(*event)
	if !ok || ev == nil {
		return fmt.Errorf("rocm: Stream.Wait: event %T is not a ROCm event: %w", e, hal.ErrInvalid)
	}
	return s.d.run("Stream.Wait", func() error {
		return check(s.d.api, "hipStreamWaitEvent", s.d.api.streamWaitEvent(s.h, ev.h, 0))
	})
}

// Synchronize blocks until s's queued work is done.
func (s *stream) Synchronize() error {
	return s.d.run("Stream.Synchronize", func() error {
		return check(s.d.api, "hipStreamSynchronize", s.d.api.streamSynchronize(s.h))
	})
}

// Query reports whether s's queued work is done (hipErrorNotReady: not yet).
func (s *stream) Query() (bool, error) {
	var r int32
	err := s.d.run("Stream.Query", func() error { r = s.d.api.streamQuery(s.h); return nil })
	return queryResult(s.d.api, "hipStreamQuery", r, err)
}

func queryResult(a *hipAPI, call string, r int32, err error) (bool, error) {
	if err != nil {
		return false, err
	}
	switch r {
	case hipSuccess:
		return true, nil
	case hipErrorNotReady:
		return false, nil
	}
	return false, fmt.Errorf("rocm: %w", check(a, call, r))
}

// Destroy releases s (hipStreamDestroy lets queued work finish).
func (s *stream) Destroy() error {
	return s.d.run("Stream.Destroy", func() error {
		return check(s.d.api, "hipStreamDestroy", s.d.api.streamDestroy(s.h))
	})
}

// hipStreamCaptureModeRelaxed: other threads may make unsafe calls meanwhile
// (as the CUDA backend's relaxed mode).
const hipStreamCaptureModeRelaxed = 2

func (s *stream) graphAPI(call string) error {
	a := s.d.api
	if a.streamBeginCapture == nil || a.streamEndCapture == nil || a.graphInstantiate == nil ||
		a.graphLaunch == nil || a.graphExecDestroy == nil || a.graphDestroy == nil {
		return fmt.Errorf("rocm: %s: %w: %w", call, errNoCapture, hal.ErrUnavailable)
	}
	return nil
}

// BeginCapture starts recording s's work (hipStreamBeginCapture).
func (s *stream) BeginCapture() error {
	if err := s.graphAPI("BeginCapture"); err != nil {
		return err
	}
	return s.d.run("BeginCapture", func() error {
		return check(s.d.api, "hipStreamBeginCapture", s.d.api.streamBeginCapture(s.h, hipStreamCaptureModeRelaxed))
	})
}

// EndCapture stops recording and instantiates the graph (hipStreamEndCapture,
// hipGraphInstantiate).
func (s *stream) EndCapture() (hal.Graph, error) {
	if err := s.graphAPI("EndCapture"); err != nil {
		return nil, err
	}
	g := &graph{d: s.d}
	err := s.d.run("EndCapture", func() error {
		if err := check(s.d.api, "hipStreamEndCapture", s.d.api.streamEndCapture(s.h, &g.g)); err != nil {
			return err
		}
		if err := check(s.d.api, "hipGraphInstantiate", s.d.api.graphInstantiate(&g.exec, g.g, nil, nil, 0)); err != nil {
			_ = s.d.api.graphDestroy(g.g)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return g, nil
}

// graph implements hal.Graph.
type graph struct {
	d       *device
	g, exec uintptr
}

// Launch queues the graph on hs (hipGraphLaunch).
func (g *graph) Launch(hs hal.Stream) error {
	s, ok := hs.(*stream)
	if !ok {
		return fmt.Errorf("rocm: Graph.Launch: stream %T is not a ROCm stream: %w", hs, hal.ErrInvalid)
	}
	return g.d.run("Graph.Launch", func() error { return check(g.d.api, "hipGraphLaunch", g.d.api.graphLaunch(g.exec, s.h)) })
}

// Destroy releases the graph.
func (g *graph) Destroy() error {
	return g.d.run("Graph.Destroy", func() error {
		err := check(g.d.api, "hipGraphExecDestroy", g.d.api.graphExecDestroy(g.exec))
		if err2 := check(g.d.api, "hipGraphDestroy", g.d.api.graphDestroy(g.g)); err == nil {
			err = err2
		}
		return err
	})
}

// event implements hal.Event.
type event struct {
	d      *device
	h      uintptr
	timing bool
}

// Record captures s's work so far (hipEventRecord).
func (e *event) Record(hs hal.Stream) error {
	s, ok := hs.(*stream)
	if !ok {
		return fmt.Errorf("rocm: Event.Record: stream %T is not a ROCm stream: %w", hs, hal.ErrInvalid)
	}
	return e.d.run("Event.Record", func() error { return check(e.d.api, "hipEventRecord", e.d.api.eventRecord(e.h, s.h)) })
}

// Synchronize blocks until the recorded work is done.
func (e *event) Synchronize() error {
	return e.d.run("Event.Synchronize", func() error { return check(e.d.api, "hipEventSynchronize", e.d.api.eventSynchronize(e.h)) })
}

// Query reports whether the recorded work is done.
func (e *event) Query() (bool, error) {
	var r int32
	err := e.d.run("Event.Query", func() error { r = e.d.api.eventQuery(e.h); return nil })
	return queryResult(e.d.api, "hipEventQuery", r, err)
}

// Elapsed returns the time from start to e (hipEventElapsedTime).
func (e *event) Elapsed(start hal.Event) (time.Duration, error) {
	st, ok := start.(*event)
	if !ok {
		return 0, fmt.Errorf("rocm: Event.Elapsed: start %T is not a ROCm event: %w", start, hal.ErrInvalid)
	}
	if !e.timing || !st.timing {
		return 0, fmt.Errorf("rocm: Event.Elapsed: both events need timing: %w", hal.ErrInvalid)
	}
	var ms float32
	err := e.d.run("Event.Elapsed", func() error {
		return check(e.d.api, "hipEventElapsedTime", e.d.api.eventElapsedTime(&ms, st.h, e.h))
	})
	return time.Duration(float64(ms) * float64(time.Millisecond)), err
}

// Destroy releases the event.
func (e *event) Destroy() error {
	return e.d.run("Event.Destroy", func() error { return check(e.d.api, "hipEventDestroy", e.d.api.eventDestroy(e.h)) })
}

// kernel implements hal.Kernel: one hipFunction_t.
type kernel struct {
	d      *device
	name   string
	fn     uintptr
	params int // parameter count declared in the source (kernels.ParamCounts), -1 unknown
}

// Name returns the kernel's name.
func (k *kernel) Name() string { return k.name }

const maxKernelArgs = 32

// paramBlock holds one launch's argument values and the void* array
// hipModuleLaunchKernel reads (the runtime copies them before returning).
type paramBlock struct {
	vals [maxKernelArgs]uint64
	ptrs [maxKernelArgs]unsafe.Pointer
}

// pack stores args into pb; a wrong type is an error naming the argument.
func pack(name string, pb *paramBlock, args []any) error {
	if len(args) > maxKernelArgs {
		return fmt.Errorf("rocm: Launch %s: %d arguments; at most %d are supported: %w", name, len(args), maxKernelArgs, hal.ErrInvalid)
	}
	for i, a := range args {
		slot := unsafe.Pointer(&pb.vals[i])
		pb.vals[i] = 0
		switch v := a.(type) {
		case hal.Ptr:
			*(*uint64)(slot) = uint64(v)
		case int32:
			*(*int32)(slot) = v
		case uint32:
			*(*uint32)(slot) = v
		case int64:
			*(*int64)(slot) = v
		case uint64:
			*(*uint64)(slot) = v
		case float32:
			*(*float32)(slot) = v
		case float64:
			*(*float64)(slot) = v
		default:
			return fmt.Errorf("rocm: Launch %s: argument %d has type %T; want one of hal.Ptr, int32, uint32, int64, uint64, float32, float64: %w", name, i, a, hal.ErrInvalid)
		}
		pb.ptrs[i] = slot
	}
	return nil
}

// Launch queues k on s (hipModuleLaunchKernel).
func (s *stream) Launch(hk hal.Kernel, grid, block hal.Dim3, sharedMem int, args ...any) error {
	k, ok := hk.(*kernel)
	if !ok || k == nil {
		return fmt.Errorf("rocm: Launch: kernel %T is not a ROCm kernel: %w", hk, hal.ErrInvalid)
	}
	var dims [6]uint32
	for i, v := range [6]int{grid.X, grid.Y, grid.Z, block.X, block.Y, block.Z} {
		if v < 1 || v > math.MaxInt32 {
			return fmt.Errorf("rocm: Launch %s: grid %v, block %v: every dimension must be in [1, %d]: %w", k.name, grid, block, math.MaxInt32, hal.ErrInvalid)
		}
		dims[i] = uint32(v)
	}
	if sharedMem < 0 || sharedMem > math.MaxInt32 {
		return fmt.Errorf("rocm: Launch %s: sharedMem = %d: %w", k.name, sharedMem, hal.ErrInvalid)
	}
	if k.params >= 0 && len(args) != k.params {
		return fmt.Errorf("rocm: Launch %s: %d arguments given, the kernel takes %d (see package kernels): %w", k.name, len(args), k.params, hal.ErrInvalid)
	}
	pb := new(paramBlock)
	if err := pack(k.name, pb, args); err != nil {
		return err
	}
	var params unsafe.Pointer
	if len(args) > 0 {
		params = unsafe.Pointer(&pb.ptrs[0])
	}
	err := s.d.run("Launch "+k.name, func() error {
		r := s.d.api.moduleLaunchKernel(k.fn, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], uint32(sharedMem), s.h, params, nil)
		runtime.KeepAlive(pb)
		return check(s.d.api, "hipModuleLaunchKernel", r)
	})
	return err
}

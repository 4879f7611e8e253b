package cuda

import (
	"fmt"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// BareLaunch returns a function that launches the argument-less kernel k on s
// with one bare purego call of cuLaunchKernel: no context check, no validation.
// It exists so benchmarks can compare gpuctx's launch path with the raw driver
// call; the caller must keep the device's context current on its (locked) OS
// thread, e.g. by calling Do once after runtime.LockOSThread.
func BareLaunch(dev hal.Device, s hal.Stream, k hal.Kernel) (func() error, error) {
	d, ok1 := dev.(*device)
	st, ok2 := s.(*stream)
	kk, ok3 := k.(*kernel)
	if !ok1 || !ok2 || !ok3 {
		return nil, fmt.Errorf("cuda.BareLaunch: device, stream and kernel must come from the CUDA backend")
	}
	return func() error {
		return check(d.api, "cuLaunchKernel", d.api.cuLaunchKernel(kk.fn, 1, 1, 1, 1, 1, 1, 0, st.h, nil, nil))
	}, nil
}

// BareEventRecord is BareLaunch for cuEventRecord(e, s).
func BareEventRecord(dev hal.Device, e hal.Event, s hal.Stream) (func() error, error) {
	d, ok1 := dev.(*device)
	st, ok2 := s.(*stream)
	ev, ok3 := e.(*event)
	if !ok1 || !ok2 || !ok3 {
		return nil, fmt.Errorf("cuda.BareEventRecord: device, stream and event must come from the CUDA backend")
	}
	return func() error { return check(d.api, "cuEventRecord", d.api.cuEventRecord(ev.h, st.h)) }, nil
}

package gpuctx_test

import (
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/conformance"
)

// openDevice opens device 0 of the named backend, closing the Runtime at
// cleanup. For "cuda" it skips (with the loader's diagnosis) when CUDA is not
// available; the CPU backend must always open.
func openDevice(t *testing.T, backend string) *gpuctx.Device {
	t.Helper()
	rt, err := gpuctx.OpenBackend(backend)
	if err != nil {
		if backend == "cpu" {
			t.Fatalf("gpuctx.OpenBackend(%q): %v", backend, err)
		}
		t.Skipf("backend %s not available here: %v", backend, err)
	}
	t.Cleanup(func() {
		if err := rt.Close(); err != nil {
			t.Errorf("Runtime.Close: %v", err)
		}
	})
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatalf("%s Runtime.Device(0): %v", backend, err)
	}
	info := dev.Info()
	t.Logf("backend %s: device %d %q, compute %d.%d, %d SMs, %d MiB, driver %d",
		rt.Backend(), info.Index, info.Name, info.ComputeMajor, info.ComputeMinor, info.SMCount, info.TotalMemory>>20, info.DriverVersion)
	return dev
}

// TestConformance runs the backend-neutral conformance suite on every backend
// available here: always the CPU backend, and CUDA when it loads.
func TestConformance(t *testing.T) {
	for _, backend := range []string{"cpu", "cuda"} {
		t.Run(backend, func(t *testing.T) {
			conformance.Run(t, openDevice(t, backend))
		})
	}
}

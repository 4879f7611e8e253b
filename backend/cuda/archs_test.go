package cuda

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/kernels"
)

// archsTestFile is a source registered for a compute capability no real GPU
// has (1.0): its kernel must be refused on every device, before any
// compilation (NVRTC would reject the sm_10a target).
const archsTestFile = "archs_test.cu"

func init() {
	kernels.Register(kernels.Source{File: archsTestFile, Archs: []int{10},
		Text:    "extern \"C\" __global__ void gpuctx_test_archs() {}\n",
		Kernels: []kernels.Kernel{{Name: "gpuctx_test_archs", CPU: func(kernels.Memory, []any) error { return nil }}}})
}

// TestKernelArchs checks a file registered with kernels.Source.Archs: its
// kernels are unavailable (hal.ErrUnavailable, naming the file, the
// capabilities it needs and the device's) on a device outside the list, and
// capList formats the list.
func TestKernelArchs(t *testing.T) {
	if got := capList([]int{90, 100}); got != "9.0 or 10.0" {
		t.Errorf("capList = %q", got)
	}
	d := gpu(t)
	_, err := d.Kernel("gpuctx_test_archs")
	if !errors.Is(err, hal.ErrUnavailable) {
		t.Fatalf("Kernel(gpuctx_test_archs) on %d.%d: err = %v, want ErrUnavailable", d.info.ComputeMajor, d.info.ComputeMinor, err)
	}
	for _, w := range []string{archsTestFile, "compute capability 1.0", fmt.Sprintf("this device is %d.%d", d.info.ComputeMajor, d.info.ComputeMinor)} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error lacks %q: %v", w, err)
		}
	}
}

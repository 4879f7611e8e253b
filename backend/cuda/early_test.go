package cuda

import (
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/kernels"
)

// earlyTestFile holds a producer that lets its dependants start at once and
// then spins before it writes a flag, and a consumer that reads the flag
// before and after griddepcontrol.wait. Where the consumer really started
// early, its first read sees the flag unset; its second read always sees it
// set.
const earlyTestFile = "early_test.cu"

func init() {
	kernels.Register(kernels.Source{File: earlyTestFile,
		Text: `extern "C" __global__ void gpuctx_test_early_producer(int* flag, long long spin) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    *(volatile int*)flag = 1;
}
extern "C" __global__ void gpuctx_test_early_consumer(const int* flag, int* out) {
    out[0] = *(const volatile int*)flag;
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    out[1] = *(const volatile int*)flag;
}
`,
		Kernels: []kernels.Kernel{
			{Name: "gpuctx_test_early_producer", Params: []kernels.ArgKind{kernels.ArgPtr, kernels.ArgI64},
				CPU: func(kernels.Memory, []any) error { return nil }},
			{Name: "gpuctx_test_early_consumer", Params: []kernels.ArgKind{kernels.ArgPtr, kernels.ArgPtr},
				CPU: func(kernels.Memory, []any) error { return nil }},
		}})
}

// TestLaunchEarly checks on the device what LaunchEarly promises: the kernel
// starts before the one ahead of it finishes (where d.early: compute
// capability 9.0+, so its read before griddepcontrol.wait sees the
// producer's flag unset), and after the wait it sees everything the producer
// wrote, eagerly and replayed from a captured graph. Launch never overlaps.
func TestLaunchEarly(t *testing.T) {
	d := gpu(t)
	prod, err := d.Kernel("gpuctx_test_early_producer")
	if err != nil {
		t.Fatal(err)
	}
	cons, err := d.Kernel("gpuctx_test_early_consumer")
	if err != nil {
		t.Fatal(err)
	}
	hs, err := d.NewStream(hal.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer hs.Destroy()
	s := hs.(*stream)
	buf, err := d.Alloc(16)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(buf)
	flag, out := buf, buf+8
	host := pinned[int32](t, d, 4)
	const spin = int64(20_000_000) // ~10 ms at 2 GHz: far longer than a launch
	one := hal.Dim3{X: 1, Y: 1, Z: 1}
	queue := func(early bool) error {
		if err := s.MemsetAsync(buf, 0, 16); err != nil {
			return err
		}
		if err := s.Launch(prod, one, one, 0, flag, spin); err != nil {
			return err
		}
		if early {
			return s.LaunchEarly(cons, one, one, 0, flag, out)
		}
		return s.Launch(cons, one, one, 0, flag, out)
	}
	for _, tc := range []struct {
		name         string
		early, graph bool
	}{
		{"Launch", false, false},
		{"LaunchEarly", true, false},
		{"LaunchEarly captured", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.graph {
				if err := s.BeginCapture(); err != nil {
					t.Skipf("capture unavailable: %v", err)
				}
				if err := queue(tc.early); err != nil {
					t.Fatal(err)
				}
				g, err := s.EndCapture()
				if err != nil {
					t.Fatal(err)
				}
				defer g.Destroy()
				if err := g.Launch(s); err != nil {
					t.Fatal(err)
				}
			} else if err := queue(tc.early); err != nil {
				t.Fatal(err)
			}
			if err := s.CopyDtoHAsync(unsafe.Pointer(&host[0]), out, 8); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			wantBefore := int32(1)
			if tc.early && d.early {
				wantBefore = 0
			}
			if host[0] != wantBefore || host[1] != 1 {
				t.Errorf("consumer read the flag as %d before its wait and %d after; want %d and 1 (early launch in effect: %v, compute %d.%d)",
					host[0], host[1], wantBefore, d.early, d.info.ComputeMajor, d.info.ComputeMinor)
			}
		})
	}
}

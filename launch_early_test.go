package gpuctx_test

import (
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestLaunchEarlyLikeLaunch checks that Stream.LaunchEarly validates and runs
// exactly as Stream.Launch where there is no early launch (the CPU backend):
// the same result, the same errors for a nil kernel, a bad argument, an empty
// grid and a closed stream, each naming the method that was called. (On CUDA
// 9.0+ backend/cuda's TestLaunchEarly checks the overlap on the device.)
func TestLaunchEarlyLikeLaunch(t *testing.T) {
	d := cpuDevice(t)
	fill, err := d.Kernel("gpuctx_fill_f32")
	if err != nil {
		t.Fatal(err)
	}
	const n = 1000
	y, err := d.Alloc(4 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer y.Free()
	one := gpuctx.Dim3{X: 1, Y: 1, Z: 1}
	type launchFn func(s *gpuctx.Stream, k *gpuctx.Kernel, grid gpuctx.Dim3, args ...any) error
	methods := []struct {
		name string
		op   string
		call launchFn
	}{
		{"Launch", "Stream.Launch", func(s *gpuctx.Stream, k *gpuctx.Kernel, grid gpuctx.Dim3, args ...any) error {
			return s.Launch(k, grid, one, 0, args...)
		}},
		{"LaunchEarly", "Stream.LaunchEarly", func(s *gpuctx.Stream, k *gpuctx.Kernel, grid gpuctx.Dim3, args ...any) error {
			return s.LaunchEarly(k, grid, one, 0, args...)
		}},
	}
	for i, m := range methods {
		t.Run(m.name, func(t *testing.T) {
			s, err := d.NewStream(gpuctx.StreamOptions{})
			if err != nil {
				t.Fatal(err)
			}
			v := float32(3 + i)
			if err := m.call(s, fill, one, y, v, int64(n)); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			host := make([]byte, 4*n)
			if err := y.CopyToHost(host); err != nil {
				t.Fatal(err)
			}
			for j := 0; j < n; j++ {
				if got := math.Float32frombits(binary.LittleEndian.Uint32(host[4*j:])); got != v {
					t.Fatalf("y[%d] = %v, want %v", j, got, v)
				}
			}
			for _, tc := range []struct {
				name string
				k    *gpuctx.Kernel
				grid gpuctx.Dim3
				args []any
				want error
			}{
				{"nil kernel", nil, one, []any{y, v, int64(n)}, gpuctx.ErrInvalid},
				{"Go int argument", fill, one, []any{y, v, n}, gpuctx.ErrInvalid},
				{"empty grid", fill, gpuctx.Dim3{X: 0, Y: 1, Z: 1}, []any{y, v, int64(n)}, gpuctx.ErrInvalid},
			} {
				err := m.call(s, tc.k, tc.grid, tc.args...)
				if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), m.op) {
					t.Errorf("%s: err = %v, want %v naming %s", tc.name, err, tc.want, m.op)
				}
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			if err := m.call(s, fill, one, y, v, int64(n)); !errors.Is(err, gpuctx.ErrClosed) || !strings.Contains(err.Error(), m.op) {
				t.Errorf("closed stream: err = %v, want ErrClosed naming %s", err, m.op)
			}
		})
	}
}

package cpu

import (
	"errors"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
)

func TestKernels(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	const n = 37
	tests := []struct {
		name  string
		args  func(y, x hal.Ptr) []any
		y, x  []float32 // initial contents (y as int32 bits for add_i32)
		want  func(i int) float32
		asI32 bool
	}{
		{name: "gpuctx_empty", args: func(y, x hal.Ptr) []any { return nil }, want: func(i int) float32 { return float32(i) }},
		{name: "gpuctx_fill_f32", args: func(y, x hal.Ptr) []any { return []any{y, float32(2.5), int64(n - 1)} },
			want: func(i int) float32 {
				if i == n-1 {
					return float32(i) // n-1 elements only: the last is untouched
				}
				return 2.5
			}},
		{name: "gpuctx_axpby_f32", args: func(y, x hal.Ptr) []any { return []any{y, x, float32(3), float32(-2), int64(n)} },
			want: func(i int) float32 { return 3*float32(100+i) - 2*float32(i) }},
		{name: "gpuctx_add_i32", asI32: true, args: func(y, x hal.Ptr) []any { return []any{y, int32(-7), int64(n)} },
			want: func(i int) float32 { return float32(i - 7) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			yv, xv := make([]float32, n), make([]float32, n)
			yi := make([]int32, n)
			for i := range n {
				yv[i], xv[i], yi[i] = float32(i), float32(100+i), int32(i)
			}
			yb := asBytes(yv)
			if tc.asI32 {
				yb = asBytes(yi)
			}
			y, x := upload(t, d, yb), upload(t, d, asBytes(xv))
			k := mustKernel(t, d, tc.name)
			if k.Name() != tc.name {
				t.Errorf("Name = %q", k.Name())
			}
			if err := s.Launch(k, hal.Dim3{X: 2, Y: 1, Z: 1}, hal.Dim3{X: 32, Y: 1, Z: 1}, 0, tc.args(y, x)...); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			out := download(t, d, y, 4*n)
			for i := range n {
				var got float32
				if tc.asI32 {
					got = float32(fromBytes[int32](out)[i])
				} else {
					got = fromBytes[float32](out)[i]
				}
				if got != tc.want(i) {
					t.Fatalf("y[%d] = %v, want %v", i, got, tc.want(i))
				}
			}
		})
	}
}

func TestKernelErrors(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	y, _ := d.Alloc(64)
	fill := mustKernel(t, d, "gpuctx_fill_f32")
	tests := []struct {
		name        string
		grid, block hal.Dim3
		args        []any
		want        string
	}{
		{"too few arguments", one, one, []any{y, float32(1)}, "got 2 arguments"},
		{"too many arguments", one, one, []any{y, float32(1), int64(1), int64(1)}, "got 4 arguments"},
		{"wrong type", one, one, []any{y, 1.0, int64(1)}, "argument 1 is float64"},
		{"int instead of int64", one, one, []any{y, float32(1), 1}, "argument 2 is int"},
		{"zero grid", hal.Dim3{X: 0, Y: 1, Z: 1}, one, []any{y, float32(1), int64(1)}, "grid"},
		{"zero block", one, hal.Dim3{}, []any{y, float32(1), int64(1)}, "block"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := s.Launch(fill, tc.grid, tc.block, 0, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "gpuctx_fill_f32") {
				t.Fatalf("got %v, want an error naming the kernel and containing %q", err, tc.want)
			}
		})
	}
	if _, err := d.Kernel("gpuctx_nope"); !errors.Is(err, hal.ErrNoKernel) {
		t.Errorf("unknown kernel: got %v, want hal.ErrNoKernel", err)
	}
	// The stream stays usable after rejected launches.
	if err := s.Synchronize(); err != nil {
		t.Errorf("Synchronize after rejected launches: %v", err)
	}
}

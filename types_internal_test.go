package gpuctx

import (
	"testing"

	"github.com/gpuctx/gpuctx/internal/blas"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// The public types are converted to the backend's (hal, blas) by value: their
// constants must keep the same numbers, and the structs the same fields.
func TestPublicTypesMatchBackend(t *testing.T) {
	dtypes := map[DType]hal.DType{F32: hal.F32, F64: hal.F64, F16: hal.F16, BF16: hal.BF16,
		C64: hal.C64, C128: hal.C128, I32: hal.I32, I64: hal.I64, U8: hal.U8}
	for d, h := range dtypes {
		if hal.DType(d) != h || d.String() != h.String() || d.Size() != h.Size() {
			t.Errorf("DType %v (%d) does not match hal's %v (%d)", d, int(d), h, int(h))
		}
	}
	if blas.Layout(RowMajor) != blas.RowMajor || blas.Layout(ColMajor) != blas.ColMajor {
		t.Error("Layout constants do not match package blas")
	}
	if RowMajor.String() != "row-major" || ColMajor.String() != "col-major" {
		t.Errorf("Layout strings %q %q", RowMajor, ColMajor)
	}
	// Conversions compile only while the fields match.
	_ = DeviceInfo(hal.DeviceInfo{})
	_ = Library(hal.Library{})
	_ = hal.Dim3(Dim3{})
}

package blastest

import (
	"math"
	"testing"
)

func TestRelErrNaN(t *testing.T) {
	if e := RelErr([]float64{math.NaN()}, []float64{1}); !math.IsInf(e, 1) {
		t.Fatalf("NaN must never pass a tolerance, got %g", e)
	}
}

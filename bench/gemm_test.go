package bench

import (
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestGemmBench runs small GEMM benches on the CPU backend: the rates are
// positive, sampled entries match the float64 reference, and the progress
// count is exact.
func TestGemmBench(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name    string
		dt      gpuctx.DType
		flavour gpuctx.Flavour
		streams int
		tol     float64
	}{
		{"f32 one stream", gpuctx.F32, gpuctx.Default, 1, 1e-4},
		{"bf16 two streams", gpuctx.BF16, gpuctx.TensorOp, 2, 2e-2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pr := &countSteps{}
			o := GemmOptions{M: 24, N: 40, K: 32, DType: c.dt, Flavour: c.flavour, Streams: c.streams, Iters: 3, Warmup: 1, Repeats: 2, Check: true, Progress: pr}
			g, err := NewGemmBench(dev, o)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			if g.Sets() != 8 || len(g.Streams()) != c.streams {
				t.Errorf("%d sets, %d streams; want 8 (small operands) and %d", g.Sets(), len(g.Streams()), c.streams)
			}
			res, err := g.Run()
			if err != nil {
				t.Fatal(err)
			}
			if !(res.TFLOPS > 0) || len(res.PerStream) != c.streams || !(res.MedianUS > 0) {
				t.Errorf("result %+v", res)
			}
			if res.Checked != c.streams*3*8 || !(res.MaxRelErr <= c.tol) {
				t.Errorf("checked %d entries, max rel err %g (tol %g)", res.Checked, res.MaxRelErr, c.tol)
			}
			if pr.steps != GemmSteps(o) {
				t.Errorf("%d progress steps, GemmSteps says %d", pr.steps, GemmSteps(o))
			}
		})
	}
}

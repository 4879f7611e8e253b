package moekernels_test

import (
	"fmt"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// ExampleNewLauncher routes two tokens over four experts with
// gpuctx_moe_route on the CPU backend, naming every argument.
func ExampleNewLauncher() {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		panic(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		panic(err)
	}
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		panic(err)
	}
	const T, E, K = 2, 4, 2
	logits := []float32{0, 3, 1, 2, 5, 0, 0, 4}
	buf := func(n int) *gpuctx.Buffer {
		b, err := dev.Alloc(n)
		if err != nil {
			panic(err)
		}
		return b
	}
	lg, bias, idx, w := buf(4*T*E), buf(4*E), buf(4*T*K), buf(4*T*K)
	if err := lg.CopyFromHost(unsafe.Slice((*byte)(unsafe.Pointer(&logits[0])), 4*len(logits))); err != nil {
		panic(err)
	}
	route, err := moekernels.NewLauncher[moekernels.Route](dev)
	if err != nil {
		panic(err)
	}
	err = route.LaunchEarly(s, gpuctx.Dim3{X: T, Y: 1, Z: 1}, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0, moekernels.Route{
		Logits: lg, Bias: bias, TopkIdx: idx, TopkW: w, T: T, E: E, K: K,
		Rule: moekernels.RouteRule{Scoring: moekernels.ScoreSoftmax, Method: moekernels.MethodGreedy, Norm: 1, Scale: 1},
		Ks:   K,
	})
	if err != nil {
		panic(err)
	}
	if err := s.Synchronize(); err != nil {
		panic(err)
	}
	got := make([]int32, T*K)
	if err := idx.CopyToHost(unsafe.Slice((*byte)(unsafe.Pointer(&got[0])), 4*len(got))); err != nil {
		panic(err)
	}
	fmt.Println("experts per token:", got[:K], got[K:])
	// Output: experts per token: [1 3] [0 3]
}

package gpuctx_test

import (
	"encoding/binary"
	"fmt"
	"log"
	"math"
	"sync"

	"github.com/gpuctx/gpuctx"
)

// toDevice copies float32 values into a new device buffer.
func toDevice(dev *gpuctx.Device, v []float32) *gpuctx.Buffer {
	b, err := dev.Alloc(4 * len(v))
	if err != nil {
		log.Fatal(err)
	}
	host := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(host[4*i:], math.Float32bits(x))
	}
	if err := b.CopyFromHost(host); err != nil { // synchronous
		log.Fatal(err)
	}
	return b
}

// toHost copies a device buffer of float32 values to the host.
func toHost(b *gpuctx.Buffer) []float32 {
	host := make([]byte, b.Size())
	if err := b.CopyToHost(host); err != nil { // synchronous
		log.Fatal(err)
	}
	v := make([]float32, len(host)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(host[4*i:]))
	}
	return v
}

// filled returns n copies of x.
func filled(n int, x float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = x
	}
	return v
}

// Open a runtime on a named backend and look at its devices. gpuctx.Open()
// picks the backend from $GPUCTX_BACKEND, else CUDA where libcuda loads and a
// device exists, else the CPU backend; OpenBackend("cpu") forces the CPU
// backend, which runs everywhere.
func ExampleOpenBackend() {
	rt, err := gpuctx.OpenBackend("cpu") // "auto", "cuda" or "cpu"
	if err != nil {
		log.Fatal(err) // a forced backend that is unavailable is an error, never a fallback
	}
	defer rt.Close() // closes every device, stream, Context and buffer left open

	fmt.Println("backend:", rt.Backend())
	fmt.Println("devices:", rt.DeviceCount())
	dev, err := rt.Device(0)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("device 0 backend:", dev.Backend())
	// Output:
	// backend: cpu
	// devices: 1
	// device 0 backend: cpu
}

// Drive two streams through one Context from two goroutines: each goroutine
// gets a view of the Context bound to its own stream (WithStream), so its BLAS
// calls run on that stream while the other goroutine's run on the other. The
// views share the Context's handles and lifetime: they are never closed
// (closing a view would close the Context and every other view); the Context
// is closed once, after both goroutines are done.
func ExampleContext_WithStream() {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		log.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		log.Fatal(err)
	}
	ctx, err := dev.NewContext(gpuctx.ContextOptions{}) // with a stream of its own, unused here
	if err != nil {
		log.Fatal(err)
	}
	defer ctx.Close() // the only Close: it ends every view too

	const n = 4 // C = A*B, all n×n
	results := make([][]float32, 2)
	var wg sync.WaitGroup
	for g := range 2 {
		s, err := dev.NewStream(gpuctx.StreamOptions{})
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close() // at return; no view uses s after wg.Wait
		view, err := ctx.WithStream(s)
		if err != nil {
			log.Fatal(err)
		}
		a, b := toDevice(dev, filled(n*n, float32(g+1))), toDevice(dev, filled(n*n, 1))
		c, err := dev.Alloc(4 * n * n)
		if err != nil {
			log.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The handle lent here is bound to s, this view's stream.
			err := view.Blas(func(h gpuctx.Blas) error {
				return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, M: n, N: n, K: n, Alpha: 1,
					A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
			})
			if err == nil {
				err = s.Synchronize() // the GEMM was only queued on s
			}
			if err != nil {
				log.Fatal(err)
			}
			results[g] = toHost(c)
		}()
	}
	wg.Wait()
	fmt.Println("goroutine 0, C[0][0]:", results[0][0])
	fmt.Println("goroutine 1, C[0][0]:", results[1][0])
	// Output:
	// goroutine 0, C[0][0]: 4
	// goroutine 1, C[0][0]: 8
}

// GemmGrouped runs independent GEMMs of different shapes in one call, as the
// routed experts of an MoE layer do (one group per expert, M = that expert's
// tokens). All groups share the dtypes, Alpha and Beta. A group with M == 0
// (an expert that got no tokens) is skipped but still validated, so it needs
// real buffers; leaving it out of the slice is simpler.
func ExampleBlas_GemmGrouped() {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		log.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		log.Fatal(err)
	}
	ctx, err := dev.NewContext(gpuctx.ContextOptions{}) // queues on its own stream
	if err != nil {
		log.Fatal(err)
	}
	defer ctx.Close()

	const k, n = 8, 2
	tokens := []int{3, 1, 0} // rows per group; the third group is empty
	var groups []gpuctx.Gemm
	var outs []*gpuctx.Buffer
	for i, m := range tokens {
		rows := max(m, 1) // an empty group still needs (non-empty) buffers
		a := toDevice(dev, filled(rows*k, float32(i+1)))
		b := toDevice(dev, filled(k*n, 0.5))
		c := toDevice(dev, filled(rows*n, -1)) // Beta = 0: overwritten where computed
		groups = append(groups, gpuctx.Gemm{Layout: gpuctx.RowMajor, M: m, N: n, K: k, Alpha: 1,
			A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
		outs = append(outs, c)
	}
	err = ctx.Blas(func(h gpuctx.Blas) error { return h.GemmGrouped(groups) })
	if err != nil {
		log.Fatal(err)
	}
	if err := ctx.Stream().Synchronize(); err != nil { // the GEMMs were queued on ctx's stream
		log.Fatal(err)
	}
	for i, c := range outs {
		fmt.Printf("group %d (M=%d): C = %v\n", i, tokens[i], toHost(c))
	}
	// Output:
	// group 0 (M=3): C = [4 4 4 4 4 4]
	// group 1 (M=1): C = [8 8]
	// group 2 (M=0): C = [-1 -1]
}

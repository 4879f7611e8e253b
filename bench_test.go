package gpuctx_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx"
)

// benchDevices opens the CPU backend and, where it works, CUDA.
func benchDevices(b *testing.B) []*gpuctx.Device {
	var devs []*gpuctx.Device
	for _, name := range []string{"cpu", "cuda"} {
		rt, err := gpuctx.OpenBackend(name)
		if err != nil {
			continue
		}
		b.Cleanup(func() { _ = rt.Close() })
		d, err := rt.Device(0)
		if err != nil {
			b.Fatal(err)
		}
		devs = append(devs, d)
	}
	return devs
}

var noop = func(gpuctx.Blas) error { return nil }

// BenchmarkBindingOverhead: a BLAS callback around a no-op on an unchanged
// stream, against calling the no-op directly. added-ns/op is the cost of the
// callback (lock, lazy bind check, workspace check, handle lifetime).
func BenchmarkBindingOverhead(b *testing.B) {
	for _, d := range benchDevices(b) {
		for _, pol := range []gpuctx.HandlePolicy{gpuctx.PooledHandles, gpuctx.SharedHandle} {
			b.Run(d.Backend()+"/"+pol.String(), func(b *testing.B) {
				ctx, err := d.NewContext(gpuctx.ContextOptions{Policy: pol})
				if err != nil {
					b.Fatal(err)
				}
				defer ctx.Close()
				if err := ctx.Blas(noop); err != nil { // create and bind outside the loop
					b.Fatal(err)
				}
				before := ctx.Stats()
				start := time.Now()
				n := 0
				for b.Loop() {
					if err := ctx.Blas(noop); err != nil {
						b.Fatal(err)
					}
					n++
				}
				cb := float64(time.Since(start).Nanoseconds()) / float64(n)
				fn := noop
				start = time.Now()
				for range n {
					_ = fn(gpuctx.Blas{})
				}
				bare := float64(time.Since(start).Nanoseconds()) / float64(n)
				after := ctx.Stats()
				b.ReportMetric(bare, "bare-ns/op")
				b.ReportMetric(cb-bare, "added-ns/op")
				b.ReportMetric(float64(after.Rebinds-before.Rebinds)/float64(n), "rebinds/op")
			})
		}
	}
}

// BenchmarkAlternatingStreams: one Context switched between two streams before
// every callback. rebinds/op shows each policy's cost: the shared handle
// rebinds on every switch, the pooled handles never.
func BenchmarkAlternatingStreams(b *testing.B) {
	for _, d := range benchDevices(b) {
		for _, pol := range []gpuctx.HandlePolicy{gpuctx.PooledHandles, gpuctx.SharedHandle} {
			b.Run(d.Backend()+"/"+pol.String(), func(b *testing.B) {
				sA, err := d.NewStream(gpuctx.StreamOptions{})
				if err != nil {
					b.Fatal(err)
				}
				defer sA.Close()
				sB, err := d.NewStream(gpuctx.StreamOptions{})
				if err != nil {
					b.Fatal(err)
				}
				defer sB.Close()
				ctx, err := d.NewContext(gpuctx.ContextOptions{Stream: sA, Policy: pol})
				if err != nil {
					b.Fatal(err)
				}
				defer ctx.Close()
				before := ctx.Stats()
				i := 0
				for b.Loop() {
					s := sA
					if i%2 == 1 {
						s = sB
					}
					i++
					if _, err := ctx.SetStream(s); err != nil {
						b.Fatal(err)
					}
					if err := ctx.Blas(noop); err != nil {
						b.Fatal(err)
					}
				}
				st := ctx.Stats()
				b.ReportMetric(float64(st.Rebinds-before.Rebinds)/float64(i), "rebinds/op")
				b.ReportMetric(float64(st.WorkspaceApplies-before.WorkspaceApplies)/float64(i), "ws-applies/op")
			})
		}
	}
}

// BenchmarkContention: 1, 2, 4 and 8 goroutines, each on its own stream,
// issuing GEMMs (256^3 on CUDA, 64^3 on CPU) through one Context (a view per
// goroutine) or through separate Contexts, for both policies. calls/s should
// grow with goroutines, not serialise on one lock.
func BenchmarkContention(b *testing.B) {
	for _, d := range benchDevices(b) {
		size := 256
		if d.Backend() == "cpu" {
			size = 64
		}
		for _, pol := range []gpuctx.HandlePolicy{gpuctx.PooledHandles, gpuctx.SharedHandle} {
			for _, shared := range []bool{true, false} {
				for _, g := range []int{1, 2, 4, 8} {
					name := fmt.Sprintf("%s/%s/oneContext=%v/goroutines=%d", d.Backend(), pol, shared, g)
					b.Run(name, func(b *testing.B) { contention(b, d, pol, shared, g, size) })
				}
			}
		}
	}
}

func contention(b *testing.B, d *gpuctx.Device, pol gpuctx.HandlePolicy, shared bool, goroutines, n int) {
	bytes := 4 * n * n
	mats := make([]*gpuctx.Buffer, 3*goroutines)
	for i := range mats {
		buf, err := d.Alloc(bytes)
		if err != nil {
			b.Fatal(err)
		}
		defer buf.Free()
		s, _ := d.NewStream(gpuctx.StreamOptions{})
		if err := s.Memset(buf, 0x3c); err != nil { // ~0.0116 as f32: finite, non-zero
			b.Fatal(err)
		}
		_ = s.Synchronize()
		_ = s.Close()
		mats[i] = buf
	}
	root, err := d.NewContext(gpuctx.ContextOptions{Policy: pol})
	if err != nil {
		b.Fatal(err)
	}
	defer root.Close()
	ctxs := make([]*gpuctx.Context, goroutines)
	streams := make([]*gpuctx.Stream, goroutines)
	for g := range goroutines {
		s, err := d.NewStream(gpuctx.StreamOptions{})
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		streams[g] = s
		if shared {
			ctxs[g], err = root.WithStream(s)
		} else {
			ctxs[g], err = d.NewContext(gpuctx.ContextOptions{Stream: s, Policy: pol})
			defer ctxs[g].Close()
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	calls := 0
	start := time.Now()
	for b.Loop() {
		var wg sync.WaitGroup
		for g := range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				a, bb, c := mats[3*g], mats[3*g+1], mats[3*g+2]
				for range 16 {
					err := ctxs[g].Blas(func(h gpuctx.Blas) error {
						return h.Gemm(gpuctx.Gemm{M: n, N: n, K: n, Alpha: 1, A: a, B: bb, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
					})
					if err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		for _, s := range streams {
			if err := s.Synchronize(); err != nil {
				b.Fatal(err)
			}
		}
		calls += 16 * goroutines
	}
	b.ReportMetric(float64(calls)/time.Since(start).Seconds(), "calls/s")
	var waits int64
	for _, c := range ctxs {
		waits = max(waits, c.Stats().LockWaits)
	}
	b.ReportMetric(float64(waits)/float64(calls), "lockwaits/call")
}

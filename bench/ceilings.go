package bench

import (
	"fmt"
	"math/rand/v2"

	"github.com/gpuctx/gpuctx"
)

// CopyBandwidth returns the device-to-device copy bandwidth in bytes (read +
// written) per second for an n-byte copy on a new stream.
func CopyBandwidth(dev *gpuctx.Device, n, iters int) (float64, error) {
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return 0, err
	}
	defer s.Close()
	src, err := dev.Alloc(n)
	if err != nil {
		return 0, Fail(fmt.Sprintf("allocating %d MiB for the copy ceiling", n>>20), "free device memory", err)
	}
	defer src.Free()
	dst, err := dev.Alloc(n)
	if err != nil {
		return 0, Fail(fmt.Sprintf("allocating %d MiB for the copy ceiling", n>>20), "free device memory", err)
	}
	defer dst.Free()
	if err := s.Memset(src, 0x5a); err != nil {
		return 0, err
	}
	t, err := NewTimer(dev, s)
	if err != nil {
		return 0, err
	}
	defer t.Close()
	sec, err := t.Median(2, iters, func() error { return s.CopyDtoD(dst, 0, src, 0, n) })
	if err != nil {
		return 0, Fail("timing the device-to-device copy", "", err)
	}
	return 2 * float64(n) / sec, nil
}

// GemmRate returns the rate in FLOP/s of an n³ GEMM in dt (output in dt, f32
// compute; bf16 through the TensorOp flavour, f32 through Default, as the layer
// uses them) through a Context on a new stream, perRound GEMMs per timed round.
func GemmRate(dev *gpuctx.Device, n int, dt gpuctx.DType, perRound, iters int) (float64, error) {
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return 0, err
	}
	defer s.Close()
	ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s})
	if err != nil {
		return 0, err
	}
	defer ctx.Close()
	bytes := n * n * dt.Size()
	// Random operands: a block of 2^19 random values tiled over the matrix.
	r := rand.New(rand.NewPCG(7, uint64(n)))
	block := Encode(RandVec(r, min(n*n, 1<<19)), dt)
	host := make([]byte, bytes)
	for off := 0; off < bytes; off += len(block) {
		copy(host[off:], block)
	}
	var bufs [3]*gpuctx.Buffer
	for i := range bufs {
		if bufs[i], err = dev.Alloc(bytes); err != nil {
			return 0, Fail(fmt.Sprintf("allocating %d MiB for the GEMM ceiling", bytes>>20), "free device memory", err)
		}
		defer bufs[i].Free()
		if i < 2 {
			if err := bufs[i].CopyFromHost(host); err != nil {
				return 0, err
			}
		}
	}
	g := gpuctx.Gemm{M: n, N: n, K: n, Alpha: 1, A: bufs[0], B: bufs[1], C: bufs[2], AB: dt, CType: dt}
	flavour := gpuctx.Default
	if dt == gpuctx.BF16 {
		flavour = gpuctx.TensorOp
	}
	t, err := NewTimer(dev, s)
	if err != nil {
		return 0, err
	}
	defer t.Close()
	sec, err := t.Median(1, iters, func() error {
		for range perRound {
			if err := ctx.BlasFlavour(flavour, func(h gpuctx.Blas) error { return h.Gemm(g) }); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return 0, Fail(fmt.Sprintf("timing the %s GEMM ceiling", dt), fmt.Sprintf("check 'gpuctx gemm --dtype %s'", dt), err)
	}
	return 2 * float64(n) * float64(n) * float64(n) * float64(perRound) / sec, nil
}

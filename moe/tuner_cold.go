package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
)

// coldL2 makes the tuner's timings start with an L2 that holds none of the
// layer's weights, as a forward in a model finds it (the other layers'
// weights stream through L2 in between): before each timing the main stream
// multiplies a bf16 row by a matrix of twice the L2's bytes (a GEMM of M = 1
// through the main stream's Context), which reads the matrix once and writes
// one row, so L2 is left holding clean lines of it. Without it the tuner timed
// repeated launches over the same weights: a one-token FP8 layer's touched
// weights (Qwen3-30B-A3B: 36.5 MiB) fit in the H200's 50 MiB L2, so the tiles
// were ranked on L2 hits, and Auto's Dual was timed with its bf16 shared
// expert (DeepSeek-V2-Lite: 33 MiB) left in L2 by the forward before.
type coldL2 struct {
	row, mat, out *gpuctx.Buffer
	k, n          int
}

// coldL2Cols is the GEMM's K: its matrix is n rows of coldL2Cols bf16.
const coldL2Cols = 4096

// coldL2Bytes is the L2 size openColdL2 flushes for (tests give the CPU
// backend one).
var coldL2Bytes = func(d *gpuctx.Device) int { return d.Info().L2Bytes }

// coldL2Rows is the flush matrix's rows for an L2 of l2 bytes.
func coldL2Rows(l2 int) int { return (2*l2 + 2*coldL2Cols - 1) / (2 * coldL2Cols) }

// openColdL2 allocates the tuner's coldL2 for one tuning (tune, tuneFP8,
// Auto's timings) and returns a function that frees it: the buffers (about
// twice the L2's bytes) are held only while the layer tunes. It does nothing
// where a tuning is already open (Auto's forwards tune their tiles inside its
// own) or the device reports no L2 (the CPU backend: its timings rank the
// twins, and no cache of it is modelled). Where the device has no memory for
// the buffers the tuning times from a warm L2, as before the flush existed,
// and says so in TileChoices: the forward that tunes does not fail for it.
func (l *Layer) openColdL2() (done func(), err error) {
	tu := &l.tuner
	l2 := coldL2Bytes(l.dev)
	if tu.cold != nil || l2 <= 0 {
		return func() {}, nil
	}
	k, n := coldL2Cols, coldL2Rows(l2)
	c := &coldL2{k: k, n: n}
	free := func() {
		for _, b := range []*gpuctx.Buffer{c.row, c.mat, c.out} {
			if b != nil {
				_ = b.Free()
			}
		}
	}
	for _, a := range []struct {
		b     **gpuctx.Buffer
		bytes int
	}{{&c.row, 2 * k}, {&c.mat, 2 * k * n}, {&c.out, 4 * n}} {
		if *a.b, err = l.dev.Alloc(a.bytes); err != nil {
			free() // nothing queued on them yet
			tu.log = append(tu.log, fmt.Sprintf("timed from a warm L2: no memory for the L2 flush's %d bytes (%v)", a.bytes, err))
			return func() {}, nil
		}
	}
	// Zeros, so that the GEMM reads defined values (and no NaN slows it).
	for _, b := range []*gpuctx.Buffer{c.row, c.mat, c.out} {
		if err = l.main.Memset(b, 0); err != nil {
			_ = l.main.Synchronize()
			free()
			return nil, err
		}
	}
	tu.cold = c
	return func() {
		// The GEMMs queued on the main stream end before the buffers go.
		_ = l.main.Synchronize()
		tu.cold = nil
		free()
	}, nil
}

// coldTuning runs tune (a tuning of tiles) with the L2 flush open
// (openColdL2).
func coldTuning[P any](l *Layer, tune func() (P, error)) (P, error) {
	done, err := l.openColdL2()
	if err != nil {
		var none P
		return none, err
	}
	defer done()
	return tune()
}

// flushL2 queues coldL2's GEMM on the main stream (nothing where no tuning
// opened one). It waits for nothing but the work queued on the main stream.
func (l *Layer) flushL2() error {
	c := l.tuner.cold
	if c == nil {
		return nil
	}
	err := l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: 1, N: c.n, K: c.k, Alpha: 1,
			A: c.row, B: c.mat, C: c.out, AB: gpuctx.BF16, CType: gpuctx.F32})
	})
	if err != nil {
		return fmt.Errorf("moe: tuning: the L2 flush: %w", err)
	}
	return nil
}

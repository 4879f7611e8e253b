package moe

import (
	"runtime"
	"slices"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
	"golang.org/x/sync/errgroup"
)

// prefetchTiles requests the kernels of tiles cs from dev concurrently, up to
// one request per CPU at a time, and returns a function that waits for them.
// Each tile is its own compilation unit (moekernels.TileSource), so on CUDA
// the units compile on several cores at once while the caller goes on (the
// backend compiles a unit once per process; a later lookup of the same
// kernel waits for that compilation or finds it done). NVRTC may be called
// from several threads at once for distinct programs: "Multiple threads can
// invoke NVRTC API functions concurrently, as long as there is no race
// condition", a race being concurrent calls on the same nvrtcProgram (NVRTC
// User Guide, Thread Safety); backend/cuda creates one program per
// compilation. Errors are ignored: the lookup that needs the kernel
// (expertStage.fusedKernels) reports them.
func prefetchTiles(dev *gpuctx.Device, cs []moekernels.MoEGemm) (wait func()) {
	var g errgroup.Group
	g.SetLimit(runtime.NumCPU())
	var files []string
	for _, c := range cs {
		if slices.Contains(files, c.File()) {
			continue
		}
		files = append(files, c.File())
		name := c.DownName() // every tile has a down kernel; one lookup compiles and loads the unit
		g.Go(func() error {
			_, _ = dev.Kernel(name)
			return nil
		})
	}
	return func() { _ = g.Wait() }
}

// tuneCandidates returns the tiles tune times for a batch of T tokens: every
// tile, or only the 16-row ones up to smallTileTokens tokens.
func tuneCandidates(T int) []moekernels.MoEGemm {
	var cs []moekernels.MoEGemm
	for _, c := range moekernels.MoEGemms {
		if T > smallTileTokens || c.BM == 16 {
			cs = append(cs, c)
		}
	}
	return cs
}

// expectedTiles returns the tiles the fused path will likely run or time for
// batches of the given token counts (LayerOptions.Tokens): the forced tile's
// pair; the rule's tiles without tuning; with tuning, the tiles the tuning
// cache holds for this shape, or else tune's candidates. Nothing on a layer
// without the fused path or on a backend other than "cuda" (nothing to
// compile).
func (l *Layer) expectedTiles(backend string, tokens []int) []moekernels.MoEGemm {
	tu := &l.tuner
	if !l.fusedOK || backend != "cuda" || len(tokens) == 0 {
		return nil
	}
	if tu.forceTile != nil {
		p := forcedPair(*tu.forceTile)
		return []moekernels.MoEGemm{p.up, p.down}
	}
	var cs []moekernels.MoEGemm
	K, E := l.cfg.TopK, l.cfg.NumExperts
	for _, T := range tokens {
		switch {
		case !tu.autotune:
			cs = append(cs, ruleTile(T, K, E), ruleTile(T, K+l.ns, E+l.ns))
		default:
			cached := false
			for _, fs := range []bool{false, true} {
				if tp, ok := tu.cache.tiles(tileKey{tileBucket(T), fs}); ok {
					cs, cached = append(cs, tp.up, tp.down), true
				}
			}
			if !cached {
				cs = append(cs, tuneCandidates(T)...)
			}
		}
	}
	return cs
}

package moe

import (
	"fmt"
	"runtime"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
	"golang.org/x/sync/errgroup"
)

// fp8Experts is the FP8 form of the routed experts (LayerOptions.FP8): their
// weights as E4M3 codes with the float32 scale_inv of every 128x128 block
// beside them, never expanded to bf16 in device memory, and the launchers of
// the w8a16 tiles of moe_fp8_mma.cu (moekernels.FP8Gemm) that read them. The
// tiles run on the fused path's aligned sort, as the bf16 tiles do; the
// activations (x, act, out) stay bf16, in the expert stage's scratch. Layout,
// for routed experts [lo, hi) at index e-lo:
//
//	gu    [E'][2I][H] codes (gate rows, then up rows)
//	gus   [E'][2][ceil(I/128)][ceil(H/128)] f32 (the gate's, then the up's)
//	down  [E'][H][I] codes
//	downs [E'][ceil(H/128)][ceil(I/128)] f32
type fp8Experts struct {
	gu, gus, down, downs *gpuctx.Buffer
	kUp                  map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Up]
	kDown                map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Down]
}

// fp8Pair is the FP8 tile of the up and of the down kernel of a forward (the
// same BM: they share the sort).
type fp8Pair struct{ up, down moekernels.FP8Gemm }

// The FP8 tiles a layer runs, by the rule of fp8Tiles.
var (
	fp8SmallUp   = moekernels.FP8Gemm{BM: 16, BN: 64, WarpsN: 4, Stages: 4}
	fp8SmallDown = moekernels.FP8Gemm{BM: 16, BN: 128, WarpsN: 8, Stages: 3}
	fp8Large     = moekernels.FP8Gemm{BM: 32, BN: 64, WarpsN: 4, Stages: 4}
)

// fp8Tiles picks the FP8 tiles of a batch of T tokens by a rule, with no
// timing (there is no FP8 tuner yet): by the rows each touched expert gets
// on average, 16-row tiles up to 16 rows (the sweep winners of
// BenchmarkFP8Expert on the H200 at 1-64 tokens, bench/RESULTS.md), 32-row
// tiles above, which read each expert's weights half as often. The tile
// changes no result.
func fp8Tiles(T, K, E int) fp8Pair {
	TK := T * K
	if m := (TK + min(E, TK) - 1) / min(E, TK); m > 16 {
		return fp8Pair{fp8Large, fp8Large}
	}
	return fp8Pair{fp8SmallUp, fp8SmallDown}
}

// checkFP8 checks the options of an FP8 layer of cfg; the error has no
// prefix. The FP8 tiles run on the fused path only (bf16 activations), need
// H and I multiples of 16 of at most moekernels.FP8MaxK, and do not hold the
// fused shared expert (its chunks would need quantizing): FusedShared, a
// forced bf16 tile, NoFused and a small-batch path are refused.
func checkFP8(cfg *Config, o LayerOptions) error {
	H, I := cfg.HiddenSize, cfg.Intermediate
	switch {
	case o.DType != gpuctx.BF16:
		return fmt.Errorf("LayerOptions.FP8 needs DType bf16 (the activations and the other weights), not %v: %w", o.DType, gpuctx.ErrInvalid)
	case H%16 != 0 || I%16 != 0 || H > moekernels.FP8MaxK || I > moekernels.FP8MaxK:
		return fmt.Errorf("FP8 experts: hidden_size %d and moe_intermediate_size %d must be multiples of 16 of at most %d (the FP8 tiles): %w", H, I, moekernels.FP8MaxK, gpuctx.ErrInvalid)
	case o.Mode == FusedShared:
		return fmt.Errorf("mode FusedShared is not supported with FP8 experts (the shared expert stays bf16); use Dual: %w", gpuctx.ErrInvalid)
	case o.NoFused:
		return fmt.Errorf("LayerOptions.NoFused: FP8 experts run on the fused path only: %w", gpuctx.ErrInvalid)
	case o.SmallBatchTokens > 0:
		return fmt.Errorf("SmallBatchTokens = %d: FP8 experts have no small-batch kernels; leave it 0: %w", o.SmallBatchTokens, gpuctx.ErrInvalid)
	case o.Tile != "":
		return fmt.Errorf("LayerOptions.Tile %q names a bf16 tile; FP8 layers pick their tiles by rule: %w", o.Tile, gpuctx.ErrInvalid)
	}
	return nil
}

// fp8Sizes returns the bytes of the buffers of fp8Experts for n experts:
// gu, gus, down, downs.
func fp8Sizes(cfg *Config, n int) [4]int {
	H, I := cfg.HiddenSize, cfg.Intermediate
	bh, bi := ceilBlocks(H), ceilBlocks(I)
	return [4]int{n * 2 * I * H, n * 2 * bi * bh * 4, n * H * I, n * bh * bi * 4}
}

func ceilBlocks(n int) int { return (n + fp8.BlockSize - 1) / fp8.BlockSize }

// alloc allocates q's weight buffers for n experts (recorded in e.weightBufs).
func (q *fp8Experts) alloc(e *env, n int) error {
	sz := fp8Sizes(&e.cfg, n)
	for i, dst := range []**gpuctx.Buffer{&q.gu, &q.gus, &q.down, &q.downs} {
		b, err := e.dev.Alloc(sz[i])
		if err != nil {
			return err
		}
		e.weightBufs = append(e.weightBufs, b)
		*dst = b
	}
	return nil
}

// upload fills q with routed experts [lo, hi) from src (FP8 as stored, or
// quantized in 128x128 blocks: weightSource.fp8Weight), expert by expert on
// up to GOMAXPROCS goroutines, with synchronous copies that wait for nothing
// queued on any stream.
func (q *fp8Experts) upload(e *env, src weightSource, lo, hi int) error {
	H, I := e.cfg.HiddenSize, e.cfg.Intermediate
	bh, bi := ceilBlocks(H), ceilBlocks(I)
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for x := lo; x < hi; x++ {
		g.Go(func() error {
			k := x - lo
			for _, pc := range []struct {
				part         weightPart
				rows, cols   int
				codes, scale *gpuctx.Buffer
				coff, soff   int // bytes
			}{
				{wGate, I, H, q.gu, q.gus, k * 2 * I * H, k * 2 * bi * bh * 4},
				{wUp, I, H, q.gu, q.gus, (k*2 + 1) * I * H, (k*2 + 1) * bi * bh * 4},
				{wDown, H, I, q.down, q.downs, k * H * I, k * bh * bi * 4},
			} {
				w, err := src.fp8Weight(pc.part, x, pc.rows, pc.cols)
				if err != nil {
					return err
				}
				if err := copyAt(pc.codes, pc.coff, w.Codes); err != nil {
					return err
				}
				if err := copyAt(pc.scale, pc.soff, f32Bytes(w.Scales)); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// copyAt copies b to dst at byte offset off (synchronous).
func copyAt(dst *gpuctx.Buffer, off int, b []byte) error {
	v, err := dst.Slice(off, len(b))
	if err != nil {
		return err
	}
	return v.CopyFromHost(b)
}

// loadKernels looks up (on CUDA: compiles moe_fp8_mma.cu) the kernels of
// every tile fp8Tiles picks, so that a device that cannot run them fails at
// load.
func (q *fp8Experts) loadKernels(dev *gpuctx.Device) error {
	q.kUp = map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Up]{}
	q.kDown = map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Down]{}
	for _, c := range []moekernels.FP8Gemm{fp8SmallUp, fp8SmallDown, fp8Large} {
		up, err := moekernels.NewFP8Up(dev, c)
		if err != nil {
			return fmt.Errorf("FP8 tile %s: %w", c.Tag(), err)
		}
		down, err := moekernels.NewFP8Down(dev, c)
		if err != nil {
			return fmt.Errorf("FP8 tile %s: %w", c.Tag(), err)
		}
		q.kUp[c], q.kDown[c] = up, down
	}
	return nil
}

// fusedFP8 queues the FP8 up kernel (gather, gate/up GEMM, SwiGLU into act)
// and the FP8 down kernel (into out, in assignment order) of p's tiles on
// the main stream over p's aligned sort in d, which must have run (or be
// queued just ahead: the kernels wait on the device, LaunchEarly) with the
// tiles' BM. Nothing waits for the host.
func (x *expertStage) fusedFP8(in *gpuctx.Buffer, d *dispatchStage, p *plan) error {
	e, q, tp := x.e, x.q, p.fp8
	H, I, K := e.cfg.HiddenSize, e.cfg.Intermediate, p.ks
	TK := p.T * K
	up, ok := q.kUp[tp.up]
	down, ok2 := q.kDown[tp.down]
	if !ok || !ok2 {
		return fmt.Errorf("moe: FP8 tiles %s/%s were not loaded: %w", tp.up.Tag(), tp.down.Tag(), gpuctx.ErrInvalid)
	}
	cp := moekernels.AlignCap(TK, p.experts, tp.up.BM)
	gx, gy := tp.up.Grid(I, cp)
	if err := up.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: tp.up.Threads(), Y: 1, Z: 1}, tp.up.SmemBytes(true), moekernels.FP8Up{
		X: in, Gu: q.gu, Gus: q.gus, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Act: x.act,
		TK: int32(TK), K: int32(K), H: int32(H), I: int32(I), E0: int32(e.cfg.NumExperts), Ns: int32(p.early)}); err != nil {
		return err
	}
	gx, gy = tp.down.Grid(H, cp)
	return down.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: tp.down.Threads(), Y: 1, Z: 1}, tp.down.SmemBytes(false), moekernels.FP8Down{
		Act: x.act, Down: q.down, Downs: q.downs, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Out: x.out,
		TK: int32(TK), H: int32(H), I: int32(I)})
}

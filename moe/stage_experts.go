package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// expertStage runs the routed experts: its weights (gate-then-up [E',2I,H] and
// down [E',H,I] for routed experts [lo, hi), at index e-lo, then any fused
// shared-expert chunks), and its scratch (h [rows,2I], act, out [rows,H]) in
// one of three forms: the small-batch kernels (group sizes on the device),
// grouped GEMMs (group sizes on the host), or the fused tile kernels over the
// aligned sort. With FP8 experts (q set; LayerOptions.FP8) gu and down are
// nil and the fused form runs q's tiles on q's weights.
type expertStage struct {
	e           *env
	gu, down    *gpuctx.Buffer
	q           *fp8Experts
	lo, hi      int
	kSwiglu     moekernels.Launcher[moekernels.Swiglu]
	kExpertUp   moekernels.Launcher[moekernels.ExpertUp]
	kExpertDown moekernels.Launcher[moekernels.ExpertDown]
	kUp         map[moekernels.MoEGemm]moekernels.Launcher[moekernels.Up]   // fused kernels by tile
	kDown       map[moekernels.MoEGemm]moekernels.Launcher[moekernels.Down] // (a down-only tile has no up)
	h, act, out *gpuctx.Buffer
	// The w8a8 form's quantized activations (fp8Experts, fusedW8A8): x's
	// codes [T,H] and scales [T,ceil(H/128)], act's [cp,I] and [cp,ceil(I/128)].
	xq, xs, aq, as *gpuctx.Buffer
}

// expertWarps is MOE_XW of kernels/moe.cu: output rows (warps) per block.
const expertWarps = 8

// needs returns the scratch of rows assignments for the small-batch and
// grouped-GEMM forms.
func (x *expertStage) needs(rows int) []need {
	H, I, es := x.e.cfg.HiddenSize, x.e.cfg.Intermediate, x.e.es
	return []need{{&x.h, rows * 2 * I * es}, {&x.act, rows * I * es}, {&x.out, rows * H * es}}
}

// fusedNeeds returns the fused form's scratch: act for cp sorted rows, out
// for TK assignments.
func (x *expertStage) fusedNeeds(cp, TK int) []need {
	c := &x.e.cfg
	return []need{{&x.act, cp * c.Intermediate * x.e.es}, {&x.out, TK * c.HiddenSize * x.e.es}}
}

// small queues gpuctx_moe_expert_up and gpuctx_moe_expert_down on the main
// stream over the rows d gathered, reading the plan's counts and offsets on
// the device: nothing waits for the host.
func (x *expertStage) small(d *dispatchStage) error {
	e := x.e
	E, H, I := e.cfg.NumExperts, e.cfg.HiddenSize, e.cfg.Intermediate
	block := gpuctx.Dim3{X: 32 * expertWarps, Y: 1, Z: 1}
	if err := x.kExpertUp.Launch(e.main, gpuctx.Dim3{X: (I + expertWarps - 1) / expertWarps, Y: E, Z: 1}, block, 0, moekernels.ExpertUp{
		Xp: d.xp, Gu: x.gu, Counts: d.counts, Offsets: d.offsets, Act: x.act, E: int32(E), H: int32(H), I: int32(I), BF16: e.bf16()}); err != nil {
		return err
	}
	return x.kExpertDown.Launch(e.main, gpuctx.Dim3{X: (H + expertWarps - 1) / expertWarps, Y: E, Z: 1}, block, 0, moekernels.ExpertDown{
		Act: x.act, Down: x.down, Counts: d.counts, Offsets: d.offsets, Out: x.out, E: int32(E), H: int32(H), I: int32(I), BF16: e.bf16()})
}

// forPlan queues the routed experts of p on the main stream in the form its
// path takes: the small-batch kernels over the rows d gathered (sizes on the
// device), the grouped GEMMs over them (the host first waits for d's
// per-expert counts: hostCounts), or the fused tile kernels of p.tiles over
// in and d's aligned sort; nothing for the shared expert alone.
func (x *expertStage) forPlan(p *plan, in *gpuctx.Buffer, d *dispatchStage) error {
	switch p.path {
	case pathSmall:
		return x.small(d)
	case pathGrouped:
		counts, err := d.hostCounts()
		if err != nil {
			return err
		}
		TK := p.T * x.e.cfg.TopK
		groups, err := groupsOf(counts, TK)
		if err != nil {
			return err
		}
		return x.grouped(d.xp, groups, TK)
	case pathFused:
		return x.fused(in, d, p, p.tiles)
	}
	return nil
}

// group is one GEMM group of grouped: n rows from row off of the input, with
// the weights of expert index w (e-lo).
type group struct{ w, off, n int }

// groupsOf returns the groups of host-side per-expert counts over TK rows,
// expert by expert; an impossible count is a kernel bug.
func groupsOf(counts []int32, TK int) ([]group, error) {
	gs := make([]group, 0, len(counts))
	off := 0
	for e, c := range counts {
		n := int(c)
		if n < 0 || off+n > TK {
			return nil, fmt.Errorf("moe: routing produced count %d for expert %d (%d rows before it, %d in all): a kernel bug", n, e, off, TK)
		}
		if n > 0 {
			gs = append(gs, group{e, off, n})
		}
		off += n
	}
	if off != TK {
		return nil, fmt.Errorf("moe: routing counted %d rows, want T*K = %d: a kernel bug", off, TK)
	}
	return gs, nil
}

// grouped queues the experts of groups over the rows of xp through the main
// stream's Context: the gate/up grouped GEMM into h, gpuctx_moe_swiglu over
// rows into act, and the down grouped GEMM into out.
func (x *expertStage) grouped(xp *gpuctx.Buffer, groups []group, rows int) error {
	e := x.e
	H, I, es := e.cfg.HiddenSize, e.cfg.Intermediate, e.es
	gateUp := make([]gpuctx.Gemm, 0, len(groups))
	down := make([]gpuctx.Gemm, 0, len(groups))
	for _, g := range groups {
		views := make([]*gpuctx.Buffer, 6)
		for i, v := range []struct {
			b        *gpuctx.Buffer
			off, len int
		}{
			{xp, g.off * H, g.n * H}, {x.gu, g.w * 2 * I * H, 2 * I * H}, {x.h, g.off * 2 * I, g.n * 2 * I},
			{x.act, g.off * I, g.n * I}, {x.down, g.w * H * I, H * I}, {x.out, g.off * H, g.n * H},
		} {
			var err error
			if views[i], err = v.b.Slice(v.off*es, v.len*es); err != nil {
				return err
			}
		}
		gateUp = append(gateUp, gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: g.n, N: 2 * I, K: H, Alpha: 1,
			A: views[0], B: views[1], C: views[2], AB: e.dt, CType: e.dt})
		down = append(down, gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: g.n, N: H, K: I, Alpha: 1,
			A: views[3], B: views[4], C: views[5], AB: e.dt, CType: e.dt})
	}
	if err := e.ctx.BlasFlavour(e.flav, func(h gpuctx.Blas) error { return h.GemmGrouped(gateUp) }); err != nil {
		return fmt.Errorf("moe: expert gate/up grouped GEMM: %w", err)
	}
	if err := x.kSwiglu.Launch(e.main, eltGrid(rows*I), eltBlock, 0, moekernels.Swiglu{
		H: x.h, Act: x.act, Rows: int32(rows), I: int32(I), BF16: e.bf16()}); err != nil {
		return err
	}
	if err := e.ctx.BlasFlavour(e.flav, func(h gpuctx.Blas) error { return h.GemmGrouped(down) }); err != nil {
		return fmt.Errorf("moe: expert down grouped GEMM: %w", err)
	}
	return nil
}

// fusedKernels looks up (compiling on first use) the kernels of tile c; up is
// the zero Launcher for a down-only tile (c.HasUp false).
func (x *expertStage) fusedKernels(c moekernels.MoEGemm) (up moekernels.Launcher[moekernels.Up], down moekernels.Launcher[moekernels.Down], err error) {
	if k, ok := x.kDown[c]; ok {
		return x.kUp[c], k, nil
	}
	if c.HasUp() {
		if up, err = moekernels.NewUp(x.e.dev, c); err != nil {
			return up, down, err
		}
	}
	if down, err = moekernels.NewDown(x.e.dev, c); err != nil {
		return up, down, err
	}
	if x.kUp == nil {
		x.kUp, x.kDown = map[moekernels.MoEGemm]moekernels.Launcher[moekernels.Up]{}, map[moekernels.MoEGemm]moekernels.Launcher[moekernels.Down]{}
	}
	x.kUp[c], x.kDown[c] = up, down
	return up, down, nil
}

// fused queues the up and down kernels of tiles tp on the main stream over
// p's aligned sort in d (which must have run with tp's BM).
func (x *expertStage) fused(in *gpuctx.Buffer, d *dispatchStage, p *plan, tp tilePair) error {
	if x.q != nil {
		return x.fusedFP8(in, d, p)
	}
	kUp, _, err := x.fusedKernels(tp.up)
	if err != nil {
		return err
	}
	_, kDown, err := x.fusedKernels(tp.down)
	if err != nil {
		return err
	}
	if err := x.up(kUp, tp.up, in, d, p); err != nil {
		return err
	}
	return x.downs(kDown, tp.down, d, p)
}

// up queues kUp, the up kernel of tile c, over p's T tokens on the main
// stream (the align with c's BM must have run, or be the kernel just ahead:
// the fused shared expert's p.early chunks start before it ends).
func (x *expertStage) up(kUp moekernels.Launcher[moekernels.Up], c moekernels.MoEGemm, in *gpuctx.Buffer, d *dispatchStage, p *plan) error {
	e := x.e
	H, I, K := e.cfg.HiddenSize, e.cfg.Intermediate, p.ks
	TK := p.T * K
	gx, gy := c.Grid(I, moekernels.AlignCap(TK, p.experts, c.BM), e.dev.Info().SMCount)
	return kUp.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(true), moekernels.Up{
		X: in, Gu: x.gu, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Act: x.act,
		TK: int32(TK), K: int32(K), H: int32(H), I: int32(I), E0: int32(e.cfg.NumExperts), Ns: int32(p.early)})
}

// downs queues kDown, the down kernel of tile c, over p's T tokens on the
// main stream, after the up kernel.
func (x *expertStage) downs(kDown moekernels.Launcher[moekernels.Down], c moekernels.MoEGemm, d *dispatchStage, p *plan) error {
	e := x.e
	H, I, K := e.cfg.HiddenSize, e.cfg.Intermediate, p.ks
	TK := p.T * K
	gx, gy := c.Grid(H, moekernels.AlignCap(TK, p.experts, c.BM), e.dev.Info().SMCount)
	return kDown.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(false), moekernels.Down{
		Act: x.act, Down: x.down, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Out: x.out,
		TK: int32(TK), H: int32(H), I: int32(I)})
}

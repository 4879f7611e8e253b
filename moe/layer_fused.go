package moe

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// The fused routed path (bf16): vLLM's fused-MoE design on gpuctx kernels.
//
//	router GEMM -> gpuctx_moe_route -> gpuctx_moe_align (block-aligned,
//	stable per-expert sort, sizes on the device) -> gpuctx_moe_up_<tile>
//	(gather + gate/up GEMM + SwiGLU) -> gpuctx_moe_down_<tile> (down GEMM,
//	rows scattered back to assignment order) -> gpuctx_moe_combine_rows
//
// Nothing waits for the host, so every batch size is captured into a graph and
// replayed. The expert GEMMs run on tensor cores (moekernels' moe_gemm.cu); the
// tile shape is picked per token bucket, by timing the candidates on the first
// forward of a bucket on CUDA (see tune) or by a rule of thumb elsewhere.

// fused reports whether a batch of T tokens takes the fused routed path.
func (l *Layer) fused(T int) bool {
	return l.fusedOK && !l.smallBatch(T)
}

// alignCap is the worst-case padded row count of gpuctx_moe_align for TK
// assignments over E experts in blocks of bm rows.
func alignCap(TK, E, bm int) int {
	n := TK + min(E, TK)*(bm-1)
	return (n + bm - 1) / bm * bm
}

// tileBucket is the token bucket whose tile choice a batch of T tokens shares:
// the next power of two.
func tileBucket(T int) int {
	if T <= 1 {
		return 1
	}
	return 1 << bits.Len(uint(T-1))
}

// ruleTile picks a tile by the rows each touched expert gets on average: the
// tuner's usual choices on an H200 (bench/RESULTS.md, DeepSeek-V2-Lite and
// Qwen3-30B-A3B), for layers that do not tune (LayerOptions.NoAutotune, the
// CPU backend, where the tile changes no result).
func ruleTile(T, K, E int) moekernels.MoEGemm {
	TK := T * K
	m := (TK + min(E, TK) - 1) / min(E, TK)
	switch {
	case m > 96:
		return moekernels.MoEGemm{BM: 128, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 3}
	case m > 32:
		return moekernels.MoEGemm{BM: 64, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 4}
	case m > 16:
		return moekernels.MoEGemm{BM: 32, BN: 128, BK: 64, WarpsM: 1, WarpsN: 8, Stages: 4}
	}
	return moekernels.MoEGemm{BM: 16, BN: 64, BK: 64, WarpsM: 1, WarpsN: 4, Stages: 6}
}

// parseTile finds the config whose tag (moekernels.MoEGemm.Tag) is s.
func parseTile(s string) (moekernels.MoEGemm, error) {
	var tags []string
	for _, c := range moekernels.MoEGemms {
		if c.Tag() == s {
			return c, nil
		}
		tags = append(tags, c.Tag())
	}
	return moekernels.MoEGemm{}, fmt.Errorf("moe: unknown tile %q; use one of %s: %w", s, strings.Join(tags, ", "), gpuctx.ErrInvalid)
}

// tilePair is the tile of the up and the down kernel of one bucket (same BM:
// they share the alignment).
type tilePair struct{ up, down moekernels.MoEGemm }

// forcedPair is the pair a forced tile c runs: c for both kernels, or for a
// down-only tile, c for the down kernel and the first tile of the same family
// and BM that has an up kernel.
func forcedPair(c moekernels.MoEGemm) tilePair {
	if c.HasUp() {
		return tilePair{c, c}
	}
	for _, u := range moekernels.MoEGemms {
		if u.HasUp() && u.BM == c.BM && (u.Warpgroups > 0) == (c.Warpgroups > 0) {
			return tilePair{u, c}
		}
	}
	panic("moe: down-only tile " + c.Tag() + " has no up tile of its BM") // TestForcedPairs
}

// fusedKernels looks up (compiling on first use) the kernels of tile c; up is
// nil for a down-only tile.
func (l *Layer) fusedKernels(c moekernels.MoEGemm) (up, down *gpuctx.Kernel, err error) {
	if k, ok := l.kDown[c]; ok {
		return l.kUp[c], k, nil
	}
	if c.HasUp() {
		if up, err = l.dev.Kernel(c.UpName()); err != nil {
			return nil, nil, err
		}
	}
	if down, err = l.dev.Kernel(c.DownName()); err != nil {
		return nil, nil, err
	}
	l.kUp[c], l.kDown[c] = up, down
	return up, down, nil
}

// ensureFused grows the fused path's scratch for T tokens and tile rows bm.
func (l *Layer) ensureFused(T, bm int) error {
	c := &l.cfg
	TK := T * l.routedKS
	cp := alignCap(TK, l.experts(), bm)
	s := &l.scr
	synced := false
	for _, nd := range []struct {
		b **gpuctx.Buffer
		n int
	}{{&s.sorted, 4 * cp}, {&s.bexp, 4 * (cp / bm)}, {&s.npost, 4}, {&s.act, cp * c.Intermediate * l.es}, {&s.out, TK * c.HiddenSize * l.es},
		{&s.bcnt, 4 * moekernels.AlignBlocks(TK) * l.experts()}, {&s.boff, 4 * moekernels.AlignBlocks(TK) * l.experts()}} {
		if err := l.grow(nd.b, nd.n, &synced); err != nil {
			return err
		}
	}
	if s.ticket == nil { // gpuctx_moe_route_align's ticket: 0 before its first launch, and every launch leaves it 0
		if err := l.grow(&s.ticket, 4, &synced); err != nil {
			return err
		}
		return l.main.Memset(s.ticket, 0)
	}
	return nil
}

// alignThreads is the block size gpuctx_moe_align needs (MOE_ALIGN_WARPS).
const alignThreads = 512

// align3From is the assignment count from which launchAlign sorts in three
// launches (gpuctx_moe_align_count, _scan, _scatter over chunks of
// moekernels.AlignChunk) instead of gpuctx_moe_align's one block.
const align3From = 2 * moekernels.AlignChunk

// smallTileTokens is the largest batch for which tune times only 16-row
// tiles. A 64-row warpgroup tile timed as fast as the 16-row ones alone at 1
// token (DeepSeek-V2-Lite, FusedShared: 53.8 against ~55 us) but made the
// graph-replayed forward 72-75 us instead of 62 (H200, s5_route.sh); 16-row
// tiles won every tuning up to 64 tokens.
const smallTileTokens = 16

// launchAlign queues the aligned sort for T tokens with tile rows bm:
// gpuctx_moe_align, or from l.align3From assignments its three-launch form
// (same outputs).
func (l *Layer) launchAlign(T, bm int) error {
	s := &l.scr
	TK, E := T*l.routedKS, l.experts()
	first := 0
	if l.sharedChunks() > 0 {
		first = l.cfg.NumExperts // the fused shared expert's chunks sort first (moekernels' moe_shared_rows)
	}
	if first >= E {
		return fmt.Errorf("moe: internal error: the fused shared expert's chunks sort first at expert %d of %d", first, E)
	}
	if TK >= l.align3From {
		nb := moekernels.AlignBlocks(TK)
		blk := gpuctx.Dim3{X: alignThreads, Y: 1, Z: 1}
		if err := l.launchEarly(l.kAlign3[0], gpuctx.Dim3{X: nb, Y: 1, Z: 1}, blk, 0, s.idx, s.bcnt, int32(TK), int32(E)); err != nil {
			return err
		}
		if err := l.launchEarly(l.kAlign3[1], gpuctx.Dim3{X: 1, Y: 1, Z: 1}, blk, 0, s.bcnt, s.boff, s.sorted, s.bexp, s.npost,
			int32(TK), int32(E), int32(bm), int32(alignCap(TK, E, bm)), int32(nb), int32(first)); err != nil {
			return err
		}
		return l.launchEarly(l.kAlign3[2], gpuctx.Dim3{X: nb, Y: 1, Z: 1}, blk, 0, s.idx, s.boff, s.npost, s.sorted, int32(TK), int32(E))
	}
	return l.launchEarly(l.kAlign, gpuctx.Dim3{X: 1, Y: 1, Z: 1}, gpuctx.Dim3{X: alignThreads, Y: 1, Z: 1}, 0,
		s.idx, s.sorted, s.bexp, s.npost, int32(TK), int32(E), int32(bm), int32(alignCap(TK, E, bm)), int32(first))
}

// sharedChunks returns the fused shared expert's chunks in the sort of the
// current routed forward: l.ns in FusedShared mode (its slots K.. of every
// token, experts cfg.NumExperts..), else 0. The sort puts them first, and the
// up kernel runs their rows without waiting for it.
func (l *Layer) sharedChunks() int { return l.routedKS - l.cfg.TopK }

// launchEarly queues k on the main stream with gpuctx.Stream.LaunchEarly
// when k waits for the kernels ahead of it before it touches memory
// (moekernels.WaitsFirst), otherwise with Launch.
func (l *Layer) launchEarly(k *gpuctx.Kernel, grid, block gpuctx.Dim3, sharedMem int, args ...any) error {
	if moekernels.WaitsFirst(k.Name()) {
		return l.main.LaunchEarly(k, grid, block, sharedMem, args...)
	}
	return l.main.Launch(k, grid, block, sharedMem, args...)
}

// launchExperts queues the up and down kernels of tiles tp on the main stream
// (gpuctx_moe_align with tp's BM must have run).
func (l *Layer) launchExperts(x *gpuctx.Buffer, T int, tp tilePair) error {
	kUp, _, err := l.fusedKernels(tp.up)
	if err != nil {
		return err
	}
	_, kDown, err := l.fusedKernels(tp.down)
	if err != nil {
		return err
	}
	if err := l.launchUp(kUp, tp.up, x, T); err != nil {
		return err
	}
	return l.launchDown(kDown, tp.down, T)
}

// launchUp queues kUp, the up kernel of tile c, over T tokens on the main
// stream (gpuctx_moe_align with c's BM must have run, or be the kernel just
// ahead: the fused shared expert's blocks start before it ends).
func (l *Layer) launchUp(kUp *gpuctx.Kernel, c moekernels.MoEGemm, x *gpuctx.Buffer, T int) error {
	cfg, s := &l.cfg, &l.scr
	H, I, K := cfg.HiddenSize, cfg.Intermediate, l.routedKS
	TK := T * K
	gx, gy := c.Grid(I, alignCap(TK, l.experts(), c.BM), l.dev.Info().SMCount)
	ns := l.sharedChunks() // their blocks start before the sort ends
	if l.sharedWait {
		ns = 0
	}
	return l.launchEarly(kUp, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(true),
		x, l.gu, s.sorted, s.bexp, s.npost, s.act, int32(TK), int32(K), int32(H), int32(I),
		int32(cfg.NumExperts), int32(ns))
}

// launchDown queues kDown, the down kernel of tile c, over T tokens on the
// main stream, after the up kernel.
func (l *Layer) launchDown(kDown *gpuctx.Kernel, c moekernels.MoEGemm, T int) error {
	cfg, s := &l.cfg, &l.scr
	H, I, K := cfg.HiddenSize, cfg.Intermediate, l.routedKS
	TK := T * K
	gx, gy := c.Grid(H, alignCap(TK, l.experts(), c.BM), l.dev.Info().SMCount)
	return l.launchEarly(kDown, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(false),
		s.act, l.down, s.sorted, s.bexp, s.npost, s.out, int32(TK), int32(H), int32(I))
}

// knownTiles returns the tiles of T's bucket when they are already chosen
// (forced or tuned), without tuning.
func (l *Layer) knownTiles(T int) (tilePair, bool) {
	if l.forceTile != nil {
		return forcedPair(*l.forceTile), true
	}
	if !l.autotune {
		return tilePair{ruleTile(T, l.routedKS, l.experts()), ruleTile(T, l.routedKS, l.experts())}, true
	}
	tp, ok := l.tiles[tileKey{tileBucket(T), l.fusedShared}]
	return tp, ok
}

// routeAlignTokens bounds the batches that route in gpuctx_moe_route_align
// (its last block routes them with a warp per token); T*E is also bounded by
// moekernels.RouteAlignMaxDots. The one launch replaces the router GEMM,
// gpuctx_moe_route and gpuctx_moe_align (bench/RESULTS.md, 2026-12-01
// evening: measured on an H200).
const routeAlignTokens = 16

// routeAlignOK reports whether a fused-path batch of T tokens routes and sorts
// in one launch (gpuctx_moe_route_align).
func (l *Layer) routeAlignOK(T int) bool {
	return l.fused(T) && T <= l.raTokens && T*l.cfg.NumExperts <= moekernels.RouteAlignMaxDots &&
		l.experts() <= MaxExperts
}

// routedSmall queues the fused routed path of a batch that routeAlignOK
// accepts: gpuctx_moe_route_align, then the expert kernels. Every forward of
// such a batch computes the router logits the same way (in that kernel, never
// in a GEMM), so results do not depend on whether the tiles were tuned yet;
// the first forward of a bucket on CUDA tunes them on this routing and sorts
// again with the chosen rows per block.
func (l *Layer) routedSmall(x *gpuctx.Buffer, T, shared int) error {
	tp, known := l.knownTiles(T)
	bm := tp.up.BM
	if !known {
		bm = ruleTile(T, l.routedKS, l.experts()).BM
	}
	if err := l.ensureFused(T, bm); err != nil {
		return err
	}
	if err := l.launchRouteAlign(x, T, shared, bm); err != nil {
		return err
	}
	if !known {
		var err error
		if tp, err = l.tilesFor(x, T); err != nil {
			return err
		}
		if err := l.ensureFused(T, tp.up.BM); err != nil {
			return err
		}
		if err := l.launchAlign(T, tp.up.BM); err != nil {
			return err
		}
	}
	return l.expertsFused(x, T, shared, tp)
}

// launchRouteAlign queues gpuctx_moe_route_align for T tokens with tile rows
// bm (the fused scratch must be sized for them) on the main stream: one block
// per 16 router logits, the last of them routing and sorting.
func (l *Layer) launchRouteAlign(x *gpuctx.Buffer, T, shared, bm int) error {
	c, s := &l.cfg, &l.scr
	scoring, method, eps, scale := l.routeArgs()
	ks := l.slots(shared)
	TK, E := T*ks, l.experts()
	grid := gpuctx.Dim3{X: moekernels.RouteAlignBlocks(T * c.NumExperts), Y: 1, Z: 1}
	return l.launchEarly(l.kRouteAlign, grid, gpuctx.Dim3{X: alignThreads, Y: 1, Z: 1}, moekernels.RouteAlignSmem(T, c.NumExperts),
		x, l.router, l.bias, s.logits, s.idx, s.w, s.sorted, s.bexp, s.npost, s.ticket,
		int32(T), int32(c.HiddenSize), int32(c.NumExperts), int32(c.TopK), scoring, method,
		int32(c.NumGroups), int32(c.TopKGroups), flag(c.HasBias()), flag(c.NormTopKProb), eps, scale,
		int32(ks), int32(ks-c.TopK), int32(bm), int32(alignCap(TK, E, bm)))
}

// tilesFor returns the tiles of T's bucket: the forced tile, the tuned or
// rule-of-thumb choice. Tuning (CUDA, first forward of a bucket, never during a
// capture) needs the routing of this forward in s.idx, and waits for the main
// stream.
func (l *Layer) tilesFor(x *gpuctx.Buffer, T int) (tilePair, error) {
	if l.forceTile != nil {
		return forcedPair(*l.forceTile), nil
	}
	b := tileKey{tileBucket(T), l.fusedShared}
	if tp, ok := l.tiles[b]; ok {
		return tp, nil
	}
	tp := tilePair{ruleTile(T, l.routedKS, l.experts()), ruleTile(T, l.routedKS, l.experts())}
	if l.autotune && !l.capturing {
		var err error
		if tp, err = l.tune(x, T); err != nil {
			return tilePair{}, err
		}
	}
	l.tiles[b] = tp
	return tp, nil
}

// tuneSpan is about how long one of tune's timings runs: kernels shorter than
// it are timed over several launches back to back (at most 8).
const tuneSpan = 250 * time.Microsecond

// tune times every tile's up and down kernel on this forward's routing (three
// runs each after one warm-up, median) and returns the fastest up and the
// fastest down of the fastest BM. With the fused shared expert on the
// one-launch routing, each up kernel is timed together with
// gpuctx_moe_route_align ahead of it: its shared blocks run while the routing
// does (moe_shared_rows), and how much of them a tile hides there depends on
// how many blocks it has. It runs on the main stream and waits for it.
func (l *Layer) tune(x *gpuctx.Buffer, T int) (tilePair, error) {
	withRoute := l.sharedChunks() > 0 && l.routeAlignOK(T)
	start, stop := l.evTune[0], l.evTune[1]
	// timeIt returns the median of three timings of launch after a warm-up.
	// A timing queues launch back to back reps times between the events and
	// divides: one launch alone would also count the host's launch latency,
	// the device being idle when the start event runs (a few us, enough to
	// swap the ranking of 1-token tiles from one tuning to the next: H200,
	// bench/gpu/s6_tune.sh). reps makes each timing about tuneSpan long.
	timeIt := func(launch func() error) (time.Duration, error) {
		var ts []time.Duration
		reps := 1
		for r := 0; r < 4; r++ {
			if err := start.Record(l.main); err != nil {
				return 0, err
			}
			for i := 0; i < reps; i++ {
				if err := launch(); err != nil {
					return 0, err
				}
			}
			if err := stop.Record(l.main); err != nil {
				return 0, err
			}
			if err := stop.Synchronize(); err != nil {
				return 0, err
			}
			d, err := stop.Elapsed(start)
			if err != nil {
				return 0, err
			}
			d /= time.Duration(reps)
			if r == 0 {
				reps = min(max(int(tuneSpan/max(d, time.Microsecond)), 1), 8)
				continue
			}
			ts = append(ts, d)
		}
		slices.Sort(ts)
		return ts[len(ts)/2], nil
	}
	type best struct {
		c moekernels.MoEGemm
		d time.Duration
	}
	var bestPair tilePair
	bestSum := time.Duration(-1)
	var timed []string
	var bms []int
	for _, cand := range moekernels.MoEGemms {
		if T <= smallTileTokens && cand.BM > 16 {
			continue
		}
		if !slices.Contains(bms, cand.BM) {
			bms = append(bms, cand.BM)
		}
	}
	slices.Sort(bms)
	for _, bm := range bms {
		if err := l.ensureFused(T, bm); err != nil {
			return tilePair{}, err
		}
		if err := l.launchAlign(T, bm); err != nil {
			return tilePair{}, err
		}
		up, down := best{d: -1}, best{d: -1}
		for _, cand := range moekernels.MoEGemms {
			if cand.BM != bm {
				continue
			}
			kUp, kDown, err := l.fusedKernels(cand)
			if errors.Is(err, gpuctx.ErrUnavailable) {
				continue // a warpgroup tile on a GPU other than compute capability 9.0
			}
			if err != nil {
				return tilePair{}, err
			}
			du := time.Duration(-1) // a down-only tile
			if kUp != nil {
				du, err = timeIt(func() error {
					if withRoute {
						if err := l.launchRouteAlign(x, T, sharedFused, cand.BM); err != nil {
							return err
						}
					}
					return l.launchUp(kUp, cand, x, T)
				})
				if err != nil {
					return tilePair{}, fmt.Errorf("moe: timing tile %s: %w", cand.Tag(), err)
				}
			}
			dd, err := timeIt(func() error { return l.launchDown(kDown, cand, T) })
			if err != nil {
				return tilePair{}, fmt.Errorf("moe: timing tile %s: %w", cand.Tag(), err)
			}
			if du < 0 {
				timed = append(timed, fmt.Sprintf("%s -+%.1f", cand.Tag(), us(dd)))
			} else {
				timed = append(timed, fmt.Sprintf("%s %.1f+%.1f", cand.Tag(), us(du), us(dd)))
			}
			if du >= 0 && (up.d < 0 || du < up.d) {
				up = best{cand, du}
			}
			if down.d < 0 || dd < down.d {
				down = best{cand, dd}
			}
		}
		if up.d >= 0 && (bestSum < 0 || up.d+down.d < bestSum) {
			bestSum = up.d + down.d
			bestPair = tilePair{up.c, down.c}
		}
	}
	what := "up+down us"
	if withRoute {
		what = "routing+up and down us"
	}
	l.tuneLog = append(l.tuneLog, fmt.Sprintf("T=%d (bucket %d, fused shared %v): up %s, down %s, %.1f us (%s: %s)",
		T, tileBucket(T), l.fusedShared, bestPair.up.Tag(), bestPair.down.Tag(), us(bestSum), what, strings.Join(timed, ", ")))
	return bestPair, nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// autoRuleTokens is the largest batch for which Auto picks FusedShared
// without timing (LayerOptions.NoAutotune): on the H200 the timed choice was
// FusedShared at 1 and 8 tokens and Dual from 64 tokens (DeepSeek-V2-Lite,
// bench/RESULTS.md).
const autoRuleTokens = 16

// autoMode returns the mode Auto runs for a fused-path batch of T tokens whose
// shared expert can be fused: Dual or FusedShared, whichever replayed faster
// on the first Auto forward of T's bucket (each mode's graph captured, then
// timed over three replays with events on the main stream; that first forward
// waits for the main stream). The choice is kept per bucket and listed by
// TileChoices. With LayerOptions.NoAutotune it times nothing: FusedShared up
// to autoRuleTokens tokens, Dual above.
func (l *Layer) autoMode(op string, x, y *gpuctx.Buffer, T int, part Part) (Mode, error) {
	b := tileBucket(T)
	if m, ok := l.autoModes[b]; ok {
		return m, nil
	}
	if l.noTune {
		m := Dual
		if T <= autoRuleTokens {
			m = FusedShared
		}
		l.autoModes[b] = m
		l.tuneLog = append(l.tuneLog, fmt.Sprintf("T=%d (bucket %d): auto runs %v (rule, NoAutotune: fused up to %d tokens)", T, b, m, autoRuleTokens))
		return m, nil
	}
	start, stop := l.evTune[0], l.evTune[1]
	best, bestD := Dual, time.Duration(-1)
	var timed []string
	for _, m := range []Mode{Dual, FusedShared} {
		for range 2 { // eager (tunes the tiles), then the capture
			if err := l.forward(op, x, y, T, m, part); err != nil {
				return 0, err
			}
		}
		var ds []time.Duration
		for range 3 {
			if err := start.Record(l.main); err != nil {
				return 0, err
			}
			if err := l.forward(op, x, y, T, m, part); err != nil {
				return 0, err
			}
			if err := stop.Record(l.main); err != nil {
				return 0, err
			}
			if err := stop.Synchronize(); err != nil {
				return 0, err
			}
			d, err := stop.Elapsed(start)
			if err != nil {
				return 0, err
			}
			ds = append(ds, d)
		}
		slices.Sort(ds)
		timed = append(timed, fmt.Sprintf("%v %.1f us", m, us(ds[1])))
		if bestD < 0 || ds[1] < bestD {
			best, bestD = m, ds[1]
		}
	}
	l.autoModes[b] = best
	l.tuneLog = append(l.tuneLog, fmt.Sprintf("T=%d (bucket %d): auto runs %v (%s)", T, b, best, strings.Join(timed, ", ")))
	return best, nil
}

// TileChoices returns one line per token bucket that the autotuner timed: the
// chosen up and down tiles and their time, and the mode Auto picked where it
// measured one. For benchmarks and logs.
func (l *Layer) TileChoices() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.tuneLog)
}

// slots returns the topk row stride of a routed forward: K, plus the fused
// shared expert's chunks in FusedShared mode.
func (l *Layer) slots(shared int) int {
	if shared == sharedFused {
		return l.cfg.TopK + l.ns
	}
	return l.cfg.TopK
}

// experts returns the experts the fused kernels see: the routed ones, plus
// the fused shared expert's chunks in FusedShared mode.
func (l *Layer) experts() int {
	if l.fusedShared {
		return l.cfg.NumExperts + l.ns
	}
	return l.cfg.NumExperts
}

// tileKey is what a tile choice depends on: the token bucket and whether the
// shared expert rides along.
type tileKey struct {
	bucket      int
	fusedShared bool
}

// routedFused queues the fused routed path on the main stream after the router
// and the routing (s.idx, s.w); the shared expert as in smallExperts.
func (l *Layer) routedFused(x *gpuctx.Buffer, T int, shared int) error {
	tp, err := l.tilesFor(x, T)
	if err != nil {
		return err
	}
	if err := l.ensureFused(T, tp.up.BM); err != nil {
		return err
	}
	if err := l.launchAlign(T, tp.up.BM); err != nil {
		return err
	}
	return l.expertsFused(x, T, shared, tp)
}

// expertsFused queues, after the aligned sort, the fused expert kernels on the
// main stream, then the shared expert: on the side stream from evFork, which
// routed recorded before the router (Dual), or after them on the main stream
// (Single).
func (l *Layer) expertsFused(x *gpuctx.Buffer, T int, shared int, tp tilePair) error {
	// The routed kernels are queued before the side stream's shared expert: an
	// eager forward would otherwise leave the main stream idle while the host
	// queues the shared expert's BLAS calls.
	if err := l.launchExperts(x, T, tp); err != nil {
		return err
	}
	switch shared {
	case sharedSide:
		return l.sharedOnSide(l.evFork, x, T)
	case sharedMain:
		return l.sharedExpert(l.ctx, l.main, x, T)
	}
	return nil
}

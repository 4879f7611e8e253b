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

// tuner holds the fused path's tile choices and Auto's mode choices.
type tuner struct {
	forceTile *moekernels.MoEGemm  // LayerOptions.Tile
	autotune  bool                 // time the tiles per bucket
	noTune    bool                 // LayerOptions.NoAutotune: no timing runs at all (tiles, Auto's mode)
	tiles     map[tileKey]tilePair // chosen tiles by token bucket and shared fusion
	log       []string             // what tune chose (TileChoices)
	autoModes map[int]Mode         // Auto's measured choice by token bucket
	evTune    [2]*gpuctx.Event     // timing events of tune
	cache     tuneCache            // tuning results on disk (tunecache.go)
}

// fromCacheNote ends a TileChoices line whose choice came from the tuning
// cache instead of a timing.
const fromCacheNote = " (tuning cache)"

// tuneAnyBackend (tests) times the fused tiles on any backend, not only CUDA.
var tuneAnyBackend bool

// timingHook, when set (tests), is called for every timing tune and autoMode
// run.
var timingHook func()

// tileKey is what a tile choice depends on: the token bucket and whether the
// shared expert rides along.
type tileKey struct {
	bucket      int
	fusedShared bool
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

// smallTileTokens is the largest batch for which tune times only 16-row
// tiles. A 64-row warpgroup tile timed as fast as the 16-row ones alone at 1
// token (DeepSeek-V2-Lite, FusedShared: 53.8 against ~55 us) but made the
// graph-replayed forward 72-75 us instead of 62 (H200, s5_route.sh); 16-row
// tiles won every tuning up to 64 tokens.
const smallTileTokens = 16

// knownTiles returns the tiles of p's bucket when they are already chosen
// (forced, by rule, or tuned), without tuning.
func (l *Layer) knownTiles(p *plan) (tilePair, bool) {
	tu := &l.tuner
	if tu.forceTile != nil {
		return forcedPair(*tu.forceTile), true
	}
	if !tu.autotune {
		return tilePair{ruleTile(p.T, p.ks, p.experts), ruleTile(p.T, p.ks, p.experts)}, true
	}
	tp, ok := tu.tiles[tileKey{tileBucket(p.T), p.fusedShared()}]
	return tp, ok
}

// tilesFor returns the tiles of p's bucket: the forced tile, the tuned or
// rule-of-thumb choice. Tuning (CUDA, first forward of a bucket, never during a
// capture) needs the routing of this forward in the router's idx, and waits for
// the main stream.
func (l *Layer) tilesFor(p *plan, x *gpuctx.Buffer) (tilePair, error) {
	tu := &l.tuner
	if tu.forceTile != nil {
		return forcedPair(*tu.forceTile), nil
	}
	b := tileKey{tileBucket(p.T), p.fusedShared()}
	if tp, ok := tu.tiles[b]; ok {
		return tp, nil
	}
	tp := tilePair{ruleTile(p.T, p.ks, p.experts), ruleTile(p.T, p.ks, p.experts)}
	if tu.autotune && !p.capturing {
		if c, ok := tu.cache.tiles(b); ok {
			tu.log = append(tu.log, fmt.Sprintf("T=%d (bucket %d, fused shared %v): up %s, down %s%s",
				p.T, b.bucket, b.fusedShared, c.up.Tag(), c.down.Tag(), fromCacheNote))
			tu.tiles[b] = c
			return c, nil
		}
		var err error
		if tp, err = l.tune(p, x); err != nil {
			return tilePair{}, err
		}
		_ = tu.cache.storeTiles(b, tp) // a cache that cannot be written only costs a tuning later
	}
	tu.tiles[b] = tp
	return tp, nil
}

// tuneSpan is about how long one of tune's timings runs: kernels shorter than
// it are timed over several launches back to back (at most 8).
const tuneSpan = 250 * time.Microsecond

// timeIt returns the median of three timings of launch on the main stream
// after a warm-up, waiting for each. A timing queues launch back to back reps
// times between the events and divides: one launch alone would also count the
// host's launch latency, the device being idle when the start event runs (a
// few us, enough to swap the ranking of 1-token tiles from one tuning to the
// next: H200, bench/gpu/s6_tune.sh). reps makes each timing about tuneSpan
// long.
func (l *Layer) timeIt(launch func() error) (time.Duration, error) {
	if timingHook != nil {
		timingHook()
	}
	start, stop := l.tuner.evTune[0], l.tuner.evTune[1]
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

// timed is a tile and its time (-1: none).
type timed struct {
	c moekernels.MoEGemm
	d time.Duration
}

// tune times every tile's up and down kernel on this forward's routing (three
// runs each after one warm-up, median) and returns the fastest up and the
// fastest down of the fastest BM. With the fused shared expert on the
// one-launch routing, each up kernel is timed together with
// gpuctx_moe_route_align ahead of it: its shared blocks run while the routing
// does (moe_shared_rows), and how much of them a tile hides there depends on
// how many blocks it has. It runs on the main stream and waits for it.
func (l *Layer) tune(p *plan, x *gpuctx.Buffer) (tilePair, error) {
	withRoute := p.ks > l.cfg.TopK && p.oneLaunch
	prefetchTiles(l.dev, tuneCandidates(p.T))() // compile the candidates on several cores at once
	var bestPair tilePair
	bestSum := time.Duration(-1)
	var log []string
	var bms []int
	for _, cand := range moekernels.MoEGemms {
		if p.T <= smallTileTokens && cand.BM > 16 {
			continue
		}
		if !slices.Contains(bms, cand.BM) {
			bms = append(bms, cand.BM)
		}
	}
	slices.Sort(bms)
	for _, bm := range bms {
		up, down, err := l.tuneBM(p, x, bm, withRoute, &log)
		if err != nil {
			return tilePair{}, err
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
	l.tuner.log = append(l.tuner.log, fmt.Sprintf("T=%d (bucket %d, fused shared %v): up %s, down %s, %.1f us (%s: %s)",
		p.T, tileBucket(p.T), p.fusedShared(), bestPair.up.Tag(), bestPair.down.Tag(), us(bestSum), what, strings.Join(log, ", ")))
	return bestPair, nil
}

// tuneBM sorts p's routing in blocks of bm rows and times the tiles of that
// BM, returning the fastest up and down (d -1: none) and logging each time.
func (l *Layer) tuneBM(p *plan, x *gpuctx.Buffer, bm int, withRoute bool, log *[]string) (up, down timed, err error) {
	if err := l.ensureFused(p, bm); err != nil {
		return up, down, err
	}
	if err := l.dispatch.align(l.router.idx, p, bm); err != nil {
		return up, down, err
	}
	up, down = timed{d: -1}, timed{d: -1}
	for _, cand := range moekernels.MoEGemms {
		if cand.BM != bm {
			continue
		}
		kUp, kDown, err := l.experts.fusedKernels(cand)
		if errors.Is(err, gpuctx.ErrUnavailable) {
			continue // a warpgroup tile on a GPU other than compute capability 9.0
		}
		if err != nil {
			return up, down, err
		}
		du := time.Duration(-1) // a down-only tile
		if cand.HasUp() {
			du, err = l.timeIt(func() error {
				if withRoute {
					if err := l.dispatch.routeAlign(x, &l.router, p, cand.BM); err != nil {
						return err
					}
				}
				return l.experts.up(kUp, cand, x, &l.dispatch, p)
			})
			if err != nil {
				return up, down, fmt.Errorf("moe: timing tile %s: %w", cand.Tag(), err)
			}
		}
		dd, err := l.timeIt(func() error { return l.experts.downs(kDown, cand, &l.dispatch, p) })
		if err != nil {
			return up, down, fmt.Errorf("moe: timing tile %s: %w", cand.Tag(), err)
		}
		if du < 0 {
			*log = append(*log, fmt.Sprintf("%s -+%.1f", cand.Tag(), us(dd)))
		} else {
			*log = append(*log, fmt.Sprintf("%s %.1f+%.1f", cand.Tag(), us(du), us(dd)))
		}
		if du >= 0 && (up.d < 0 || du < up.d) {
			up = timed{cand, du}
		}
		if down.d < 0 || dd < down.d {
			down = timed{cand, dd}
		}
	}
	return up, down, nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// autoRuleTokens is the largest batch for which Auto picks FusedShared
// without timing (LayerOptions.NoAutotune): on the H200 the timed choice was
// FusedShared at 1 and 8 tokens and Dual from 64 tokens (DeepSeek-V2-Lite,
// bench/RESULTS.md).
const autoRuleTokens = 16

// autoCandidates are the modes Auto times against each other (Layer.autoMode),
// in the order they run; on a tie the first wins.
var autoCandidates = [...]Mode{Dual, FusedShared}

// knownMode returns the mode Auto runs for a fused-path batch of T tokens whose
// shared expert can be fused, where nothing needs timing: the choice kept for
// T's bucket, the rule under LayerOptions.NoAutotune (FusedShared up to
// autoRuleTokens tokens, Dual above), or the tuning cache's. ok is false when
// the first Auto forward of the bucket is to time the modes (Layer.autoMode).
// The choices are kept per bucket and listed by TileChoices.
func (tu *tuner) knownMode(T int) (m Mode, ok bool) {
	b := tileBucket(T)
	if m, ok := tu.autoModes[b]; ok {
		return m, true
	}
	if tu.noTune {
		m := Dual
		if T <= autoRuleTokens {
			m = FusedShared
		}
		tu.autoModes[b] = m
		tu.log = append(tu.log, fmt.Sprintf("T=%d (bucket %d): auto runs %v (rule, NoAutotune: fused up to %d tokens)", T, b, m, autoRuleTokens))
		return m, true
	}
	if m, ok := tu.cache.mode(b); ok {
		tu.autoModes[b] = m
		tu.log = append(tu.log, fmt.Sprintf("T=%d (bucket %d): auto runs %v%s", T, b, m, fromCacheNote))
		return m, true
	}
	return 0, false
}

// keepMode keeps for T's bucket the faster of autoCandidates, each timed by
// the median of its replays (medians, in autoCandidates' order), in memory
// and in the tuning cache, logs the timings, and returns it.
func (tu *tuner) keepMode(T int, medians [len(autoCandidates)]time.Duration) Mode {
	b := tileBucket(T)
	best, bestD := Dual, time.Duration(-1)
	var log []string
	for i, m := range autoCandidates {
		log = append(log, fmt.Sprintf("%v %.1f us", m, us(medians[i])))
		if bestD < 0 || medians[i] < bestD {
			best, bestD = m, medians[i]
		}
	}
	tu.autoModes[b] = best
	_ = tu.cache.storeMode(b, best) // a cache that cannot be written only costs a tuning later
	tu.log = append(tu.log, fmt.Sprintf("T=%d (bucket %d): auto runs %v (%s)", T, b, best, strings.Join(log, ", ")))
	return best
}

// TileChoices returns one line per token bucket that the autotuner timed: the
// chosen up and down tiles and their time, and the mode Auto picked where it
// measured one. For benchmarks and logs.
func (l *Layer) TileChoices() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.tuner.log)
}

// TunedFromCache reports whether the layer has made tuning choices and took
// every one of them from the disk cache of tuning results (tunecache.go)
// instead of timing: for moe run -v.
func (l *Layer) TunedFromCache() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.tuner.log {
		if !strings.HasSuffix(line, fromCacheNote) {
			return false
		}
	}
	return len(l.tuner.log) > 0
}

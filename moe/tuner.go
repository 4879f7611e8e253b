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
// forward of a bucket on CUDA (see tune; an FP8 layer's: tuneFP8) or by a rule
// of thumb elsewhere.

// tuner holds the fused path's tile choices and Auto's mode choices.
type tuner struct {
	forceTile *moekernels.MoEGemm  // LayerOptions.Tile
	autotune  bool                 // time the tiles per bucket
	noTune    bool                 // LayerOptions.NoAutotune: no timing runs at all (tiles, Auto's mode)
	fp8Rule   bool                 // an FP8 layer: the rule runs Dual at every size (knownMode)
	tiles     map[tileKey]tilePair // chosen tiles by token bucket and shared fusion
	fp8       map[tileKey]fp8Pair  // an FP8 layer's chosen tiles, the same way
	log       []string             // what tune chose (TileChoices)
	autoModes map[int]Mode         // Auto's measured choice by token bucket
	evTune    [2]*gpuctx.Event     // timing events of tune
	cold      *coldL2              // while a tuning runs on a device with an L2: its flush (openColdL2)
	cache     tuneCache            // tuning results on disk (tunecache.go)
}

// fromCacheNote ends a TileChoices line whose choice came from the tuning
// cache instead of a timing.
const fromCacheNote = " (tuning cache)"

// tuneAnyBackend (tests) times the fused tiles on any backend, not only CUDA.
var tuneAnyBackend bool

// timingHook, when set (tests), is called for every timing tune (timeIt:
// forward false) and autoMode (timeForward: forward true) run.
var timingHook func(forward bool)

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
	m := rowsPerExpert(T, K, E)
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

// rowsPerExpert is the rows each touched expert gets on average (rounded
// up) from T tokens of K slots over E experts, assuming min(E, T*K) of them
// touched.
func rowsPerExpert(T, K, E int) int {
	TK := T * K
	return (TK + min(E, TK) - 1) / min(E, TK)
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
		return ruleTiles(p), true
	}
	tp, ok := tu.tiles[tileKey{tileBucket(p.T), p.fusedShared()}]
	return tp, ok
}

// ruleTiles is the rule's bf16 tile pair for p (ruleTile).
func ruleTiles(p *plan) tilePair {
	c := ruleTile(p.T, p.ks, p.experts)
	return tilePair{c, c}
}

// settleTiles sets the tiles of p, which are not known yet (plan.tilesKnown):
// p.fp8 in an FP8 layer (settle between fp8Rule and tuneFP8), else p.tiles
// (tilesFor). Tuning needs the routing of this forward in the router's idx,
// runs on the main stream and waits for it.
func (l *Layer) settleTiles(p *plan, x *gpuctx.Buffer) error {
	var err error
	if l.experts.q != nil {
		p.fp8, err = settle(&l.tuner, l.tuner.fp8, p, l.fp8Rule(p), func() (fp8Pair, error) {
			return coldTuning(l, func() (fp8Pair, error) { return l.tuneFP8(p, x) })
		})
		return err
	}
	p.tiles, err = l.tilesFor(p, x)
	return err
}

// tilesFor returns the bf16 tiles of p's bucket: the forced tile, or settle's
// choice between the rule (ruleTile) and tune.
func (l *Layer) tilesFor(p *plan, x *gpuctx.Buffer) (tilePair, error) {
	tu := &l.tuner
	if tu.forceTile != nil {
		return forcedPair(*tu.forceTile), nil
	}
	return settle(tu, tu.tiles, p, ruleTiles(p), func() (tilePair, error) {
		return coldTuning(l, func() (tilePair, error) { return l.tune(p, x) })
	})
}

// tileChoice is what the tuner keeps per tileKey: a bf16 layer's tilePair or
// an FP8 layer's fp8Pair.
type tileChoice interface {
	tilePair | fp8Pair
	upDown() string          // "up <tag>, down <tag>" (TileChoices)
	note() string            // what TileChoices adds to the bucket: "", ", fp8"
	record(tileKey) tuneTile // the tuning cache's form
}

// settle returns the tiles of p's bucket kept in kept; else, where the layer
// autotunes and p is not being captured, the tuning cache's, or tune's
// (stored in the cache); else rule. The choice is kept in kept, and logged
// for TileChoices where it came from the cache (tune logs its own). tune runs
// on the main stream and waits for it; nothing else does.
func settle[P tileChoice](tu *tuner, kept map[tileKey]P, p *plan, rule P, tune func() (P, error)) (P, error) {
	b := tileKey{tileBucket(p.T), p.fusedShared()}
	if tp, ok := kept[b]; ok {
		return tp, nil
	}
	tp := rule
	if tu.autotune && !p.capturing {
		if c, ok := cachedChoice[P](tu.cache, b); ok {
			tu.logChoice(p, c, fromCacheNote)
			kept[b] = c
			return c, nil
		}
		var err error
		if tp, err = tune(); err != nil {
			return rule, err
		}
		_ = storeChoice(tu.cache, b, tp) // a cache that cannot be written only costs a tuning later
	}
	kept[b] = tp
	return tp, nil
}

// logChoice adds the TileChoices line of p's bucket: the choice tp, then
// tail (its timings, or fromCacheNote).
func (tu *tuner) logChoice(p *plan, tp interface {
	upDown() string
	note() string
}, tail string) {
	tu.log = append(tu.log, fmt.Sprintf("T=%d (bucket %d, fused shared %v%s): %s%s",
		p.T, tileBucket(p.T), p.fusedShared(), tp.note(), tp.upDown(), tail))
}

func (tp tilePair) upDown() string { return "up " + tp.up.Tag() + ", down " + tp.down.Tag() }
func (tilePair) note() string      { return "" }

// tuneSpan is about how long one of tune's timings runs: kernels shorter than
// it are timed over several launches back to back (at most 8).
const tuneSpan = 250 * time.Microsecond

// tuneTimes, when set (tests), replaces each time timeIt measured: what names
// the launch ("up <tag>", "down <tag>", "w8a8 <up tag>/<down tag>").
var tuneTimes func(what string, d time.Duration) time.Duration

// timeIt returns the median of three timings of launch (what it queues:
// tuneTimes) on the main stream after a warm-up, waiting for each. Where the
// tuning flushes L2 (openColdL2) each timing is one launch after the flush,
// which also keeps the device busy while the host queues the launch. Else a
// timing queues launch back to back reps times between the events and
// divides: one launch alone would also count the host's launch latency, the
// device being idle when the start event runs (a few us, enough to swap the
// ranking of 1-token tiles from one tuning to the next: H200,
// bench/gpu/s6_tune.sh). reps makes each timing about tuneSpan long.
func (l *Layer) timeIt(what string, launch func() error) (time.Duration, error) {
	if timingHook != nil {
		timingHook(false)
	}
	start, stop := l.tuner.evTune[0], l.tuner.evTune[1]
	var ts []time.Duration
	reps := 1
	for r := 0; r < 4; r++ {
		if err := l.flushL2(); err != nil {
			return 0, err
		}
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
			if l.tuner.cold == nil {
				reps = min(max(int(tuneSpan/max(d, time.Microsecond)), 1), 8)
			}
			continue
		}
		ts = append(ts, d)
	}
	slices.Sort(ts)
	if tuneTimes != nil {
		return tuneTimes(what, ts[len(ts)/2]), nil
	}
	return ts[len(ts)/2], nil
}

// timed is a tile and its time (-1: none).
type timed[C any] struct {
	c C
	d time.Duration
}

// tileCand is one tile that tune times: the tile, its tag and rows, and its
// up kernel (nil: a down-only tile) and down kernel, each queued on the main
// stream over the aligned sort of its rows.
type tileCand[C any] struct {
	c        C
	tag      string
	bm       int
	up, down func() error
}

// tune times every bf16 tile's up and down kernel on this forward's routing
// (bestOfBMs) and returns the fastest up and the fastest down of the fastest
// BM. With the fused shared expert on the one-launch routing, each up kernel
// is timed together with gpuctx_moe_route_align ahead of it: its shared
// blocks run while the routing does (moe_shared_rows), and how much of them a
// tile hides there depends on how many blocks it has. It runs on the main
// stream and waits for it.
func (l *Layer) tune(p *plan, x *gpuctx.Buffer) (tilePair, error) {
	withRoute := p.ks > l.cfg.TopK && p.oneLaunch
	prefetchTiles(l.dev, tuneCandidates(p.T))() // compile the candidates on several cores at once
	var cands []tileCand[moekernels.MoEGemm]
	for _, c := range tuneCandidates(p.T) {
		kUp, kDown, err := l.experts.fusedKernels(c)
		if errors.Is(err, gpuctx.ErrUnavailable) {
			continue // a warpgroup tile on a GPU other than compute capability 9.0
		}
		if err != nil {
			return tilePair{}, err
		}
		cand := tileCand[moekernels.MoEGemm]{c: c, tag: c.Tag(), bm: c.BM,
			down: func() error { return l.experts.downs(kDown, c, &l.dispatch, p) }}
		if c.HasUp() {
			cand.up = l.routedUp(p, x, c.BM, withRoute, func() error { return l.experts.up(kUp, c, x, &l.dispatch, p) })
		}
		cands = append(cands, cand)
	}
	var log []string
	up, down, err := bestOfBMs(l, p, cands, &log)
	if err != nil {
		return tilePair{}, err
	}
	best := tilePair{up.c, down.c}
	l.tuner.logChoice(p, best, fmt.Sprintf(", %.1f us (%s: %s)", us(up.d+down.d), timedWhat(withRoute), strings.Join(log, ", ")))
	return best, nil
}

// timedWhat says what tune's per-tile times are (TileChoices).
func timedWhat(withRoute bool) string {
	if withRoute {
		return "routing+up and down us"
	}
	return "up+down us"
}

// routedUp returns up, or where withRoute is set a launch that queues
// gpuctx_moe_route_align of x with tile rows bm ahead of up, on the main
// stream.
func (l *Layer) routedUp(p *plan, x *gpuctx.Buffer, bm int, withRoute bool, up func() error) func() error {
	if !withRoute {
		return up
	}
	return func() error {
		if err := l.dispatch.routeAlign(x, &l.router, &l.experts, p, bm); err != nil {
			return err
		}
		return up()
	}
}

// bestOfBMs times cands BM by BM, smallest first (timeBM), and returns the
// fastest up and the fastest down of the BM whose fastest up+down is least
// (d -1: none). It runs on the main stream and waits for it.
func bestOfBMs[C any](l *Layer, p *plan, cands []tileCand[C], log *[]string) (up, down timed[C], err error) {
	var bms []int
	for _, c := range cands {
		if !slices.Contains(bms, c.bm) {
			bms = append(bms, c.bm)
		}
	}
	slices.Sort(bms)
	up, down = timed[C]{d: -1}, timed[C]{d: -1}
	for _, bm := range bms {
		u, d, err := timeBM(l, p, bm, cands, log)
		if err != nil {
			return up, down, err
		}
		if u.d >= 0 && d.d >= 0 && (up.d < 0 || u.d+d.d < up.d+down.d) {
			up, down = u, d
		}
	}
	return up, down, nil
}

// timeBM sorts p's routing in blocks of bm rows and times the up and down
// kernels of cands of that BM, returning the fastest up and down (d -1:
// none) and logging each time. It runs on the main stream and waits for it.
func timeBM[C any](l *Layer, p *plan, bm int, cands []tileCand[C], log *[]string) (up, down timed[C], err error) {
	if err := l.ensureFused(p, bm); err != nil {
		return up, down, err
	}
	if err := l.dispatch.align(l.router.idx, p, bm); err != nil {
		return up, down, err
	}
	up, down = timed[C]{d: -1}, timed[C]{d: -1}
	for _, cand := range cands {
		if cand.bm != bm {
			continue
		}
		du := time.Duration(-1) // a down-only tile
		if cand.up != nil {
			if du, err = l.timeIt("up "+cand.tag, cand.up); err != nil {
				return up, down, fmt.Errorf("moe: timing tile %s: %w", cand.tag, err)
			}
		}
		dd, err := l.timeIt("down "+cand.tag, cand.down)
		if err != nil {
			return up, down, fmt.Errorf("moe: timing tile %s: %w", cand.tag, err)
		}
		if du < 0 {
			*log = append(*log, fmt.Sprintf("%s -+%.1f", cand.tag, us(dd)))
		} else {
			*log = append(*log, fmt.Sprintf("%s %.1f+%.1f", cand.tag, us(du), us(dd)))
		}
		if du >= 0 && (up.d < 0 || du < up.d) {
			up = timed[C]{cand.c, du}
		}
		if down.d < 0 || dd < down.d {
			down = timed[C]{cand.c, dd}
		}
	}
	return up, down, nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// autoRuleTokens is the largest batch for which Auto picks FusedShared
// without timing (LayerOptions.NoAutotune) on a bf16 layer: on the H200 the
// timed choice was FusedShared at 1 and 8 tokens and Dual from 64 tokens
// (DeepSeek-V2-Lite, bench/RESULTS.md). An FP8 layer's rule is Dual at every
// size: there the timed choice was Dual at every count measured
// (DeepSeek-V2-Lite 1 token 50.9 against 60.7 us, 8 tokens 109.8 against
// 117.1; DeepSeek-V3 1 token 147.9 against 155.5; session 16), FusedShared
// running the shared expert in the slower w8a16 tiles.
const autoRuleTokens = 16

// autoCandidates are the modes Auto times against each other (Layer.autoMode),
// in the order they run; on a tie the first wins.
var autoCandidates = [...]Mode{Dual, FusedShared}

// knownMode returns the mode Auto runs for a fused-path batch of T tokens whose
// shared expert can be fused, where nothing needs timing: the choice kept for
// T's bucket, the rule under LayerOptions.NoAutotune (FusedShared up to
// autoRuleTokens tokens, Dual above; an FP8 layer Dual), or the tuning
// cache's. ok is false when
// the first Auto forward of the bucket is to time the modes (Layer.autoMode).
// The choices are kept per bucket and listed by TileChoices.
func (tu *tuner) knownMode(T int) (m Mode, ok bool) {
	b := tileBucket(T)
	if m, ok := tu.autoModes[b]; ok {
		return m, true
	}
	if tu.noTune {
		m, rule := Dual, "dual at every size for FP8"
		if !tu.fp8Rule {
			rule = fmt.Sprintf("fused up to %d tokens", autoRuleTokens)
			if T <= autoRuleTokens {
				m = FusedShared
			}
		}
		tu.autoModes[b] = m
		tu.log = append(tu.log, fmt.Sprintf("T=%d (bucket %d): auto runs %v (rule, NoAutotune: %s)", T, b, m, rule))
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
// measured one; and a line where a tuning could not flush L2 first (no
// device memory for it) and timed from a warm L2. For benchmarks and logs.
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

package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
)

// routePath is how a forward computes the routed experts.
type routePath uint8

const (
	pathNone    routePath = iota // no routed part (SharedOnly)
	pathGrouped                  // router GEMM, route, plan, grouped GEMMs with host-side group sizes
	pathSmall                    // router GEMM, route, plan, the small-batch kernels (sizes on the device)
	pathFused                    // route, aligned sort, the fused tile kernels (bf16)
)

// sharedPlace is where a forward queues the shared expert.
type sharedPlace uint8

const (
	sharedNone  sharedPlace = iota
	sharedMain              // on the main stream
	sharedSide              // on the side stream, forked (evFork or evCounts), joined by evJoin
	sharedFused             // inside the fused routed kernels, as experts E.. (FusedShared)
)

// plan is one forward, decided before anything is queued: what it computes,
// which path the routed experts take, where the shared expert runs, whether x
// and y are staged and whether the forward is captured and replayed. The
// executor (Layer.enqueue) and the stages read it and never change it, but
// for the tiles the fused path settles (tune) and capturing, which the graph
// runner sets on its copy.
type plan struct {
	T, n           int // tokens; bytes of x and y used
	routed, shared bool
	dual           bool // the shared expert on the side stream
	path           routePath
	place          sharedPlace
	oneLaunch      bool // the fused path routes and sorts in gpuctx_moe_route_align
	xInRoute       bool // gpuctx_moe_route_align also quantizes x for the w8a8 tiles (xQuantInRoute)
	ks             int  // slots per token: K, plus the fused shared expert's chunks
	experts        int  // experts the fused kernels see: E, plus the fused chunks
	early          int  // fused shared chunks whose up blocks run before the sort ends
	staged         bool // x and y go through the layer's 16-byte aligned buffers
	graph          bool // captured on the second forward of its key, replayed after
	capturing      bool // a graph capture is under way (no tuning, no host waits)
	tiles          tilePair
	tilesKnown     bool    // tiles are forced, tuned or by rule; else the forward tunes them
	sortBM         int     // the one-launch sort's tile rows (tiles.up.BM when known)
	fp8            fp8Pair // FP8 experts: the tiles (w8a16 or w8a8), tuned or by rule; tiles is unused
}

// graphKey identifies a captured forward: its shape and what it computes.
type graphKey struct {
	T                                 int
	dual, fusedShared, routed, shared bool
}

func (p *plan) key() graphKey {
	return graphKey{p.T, p.dual, p.place == sharedFused, p.routed, p.shared}
}

// rowsBM is the tile rows of the fused kernels p runs (the sort's BM): the
// FP8 tiles' or the bf16 tiles'.
func (p *plan) rowsBM() int {
	if bm := p.fp8.bm(); bm > 0 {
		return bm
	}
	return p.tiles.up.BM
}

// fusedShared reports whether the shared expert runs inside the fused kernels.
func (p *plan) fusedShared() bool { return p.place == sharedFused }

// sharedFirst reports whether p queues the shared expert (main or side) right
// after the dispatch, before the routed experts: on the small-batch and
// grouped-GEMM paths the side stream forks there, at the counts, and on the
// grouped path the main stream runs it there too, while the host waits for
// the counts. Elsewhere it comes after the routed experts: on the small-batch
// path's main stream after the expert kernels, and on the fused path on
// either stream, since an eager forward would otherwise leave the main stream
// idle while the host queues the shared expert's BLAS calls.
func (p *plan) sharedFirst() bool {
	return p.path == pathGrouped || p.path == pathSmall && p.place == sharedSide
}

// forksAtCounts reports whether p's side stream forks at the counts (evCounts,
// the small-batch and grouped-GEMM paths) instead of from x itself (evFork,
// recorded first: the fused path, the shared expert alone).
func (p *plan) forksAtCounts() bool { return p.path == pathSmall || p.path == pathGrouped }

// plan returns the plan of a forward whose arguments are checked
// (checkForward) and whose mode is settled (autoMode: never Auto). x and y
// are read for their alignment only: whether the forward is staged.
func (l *Layer) plan(x, y *gpuctx.Buffer, T int, mode Mode, part Part) *plan {
	c := &l.cfg
	p := &plan{T: T, n: T * c.HiddenSize * l.es}
	p.routed, p.shared = l.computes(part)
	fusedShared := mode == FusedShared && p.routed && p.shared && l.ns > 0 && l.fused(T)
	if mode == FusedShared && !fusedShared {
		mode = Dual
	}
	p.dual = mode == Dual && p.shared
	l.placeShared(p, fusedShared)
	p.early = p.ks - c.TopK
	p.oneLaunch = p.path == pathFused && l.routeAlignOK(T) && p.experts <= MaxExperts
	p.staged = p.path == pathSmall || p.path == pathFused
	p.staged = p.staged && !(aligned16(x) && aligned16(y))
	p.graph = l.gc.use && p.path != pathGrouped
	if p.path == pathFused {
		l.planTiles(p)
		p.xInRoute = p.oneLaunch && l.xQuantInRoute() && (!p.tilesKnown || p.fp8.w8)
	}
	return p
}

// planTiles sets a fused-path plan's tiles where they are known
// (tilesKnown), and the rows of its sort: the tiles', or where the forward is
// to tune them (settleTiles) the rule's. An FP8 layer's plan gets FP8 tiles
// (p.fp8); the fused shared expert's chunks run in the w8a16 tiles only,
// whose up kernel starts their blocks before the sort ends (p.early; the
// w8a8 tiles take no E0/ns): FusedShared takes them at every batch size.
func (l *Layer) planTiles(p *plan) {
	if l.experts.q != nil {
		p.fp8, p.tilesKnown = l.knownFP8(p)
		p.sortBM = p.fp8.bm()
		if !p.tilesKnown {
			p.sortBM = l.fp8Rule(p).bm()
		}
		return
	}
	p.tiles, p.tilesKnown = l.knownTiles(p)
	p.sortBM = p.tiles.up.BM
	if !p.tilesKnown {
		p.sortBM = ruleTile(p.T, p.ks, p.experts).BM
	}
}

// computes reports what a forward of part computes: the routed experts, the
// shared expert (where the layer has one).
func (l *Layer) computes(part Part) (routed, shared bool) {
	return part != SharedOnly, l.shared.gu != nil && part != RoutedOnly
}

// placeShared sets p's routed path, where the shared expert runs, and the
// slots and experts the routing and the fused kernels see.
func (l *Layer) placeShared(p *plan, fusedShared bool) {
	c, T := &l.cfg, p.T
	p.ks, p.experts = c.TopK, c.NumExperts
	switch {
	case !p.routed:
		p.path = pathNone
	case l.smallBatch(T):
		p.path = pathSmall
	case l.fused(T):
		p.path = pathFused
	default:
		p.path = pathGrouped
	}
	switch {
	case !p.shared:
	case fusedShared:
		p.place, p.ks, p.experts = sharedFused, c.TopK+l.ns, c.NumExperts+l.ns
	case p.dual:
		p.place = sharedSide
	default:
		p.place = sharedMain
	}
}

// resolveMode returns the mode a forward of mode runs: mode itself, or for
// Auto, Dual on the fused path with a shared expert that cannot be fused, and
// elsewhere Dual for the small-batch path and batches of at least
// AutoThreshold tokens, else Single. On the fused path with a fusable shared
// expert Auto runs Dual or FusedShared, whichever is faster: timed reports
// that the caller settles it (Layer.autoMode), and m is Auto.
func (l *Layer) resolveMode(T int, mode Mode, part Part) (m Mode, timed bool) {
	if mode != Auto {
		return mode, false
	}
	routed, shared := l.computes(part)
	both := routed && shared && l.fused(T)
	switch {
	case both && l.ns > 0:
		return Auto, true
	case both:
		return Dual, false
	case (routed && l.smallBatch(T)) || T >= l.thresh:
		return Dual, false
	}
	return Single, false
}

// sharedChunks returns the chunks of the routed width the shared expert
// splits into when it can be fused (bf16 fused path, no Qwen2-MoE gate,
// a multiple of the routed width, at most MaxTopK chunks), else 0; it does
// not check the align kernel's limit (fusedSharedLimit).
func sharedChunks(cfg *Config, fusedOK bool) int {
	if !fusedOK {
		return 0
	}
	return cfg.fusedSharedChunks()
}

// fusedSharedLimit returns an error (without prefix) when FusedShared would
// sort more experts (routed plus the shared expert's chunks) than the align
// kernel can (MaxExperts): such a layer fuses nothing and refuses FusedShared.
func (l *Layer) fusedSharedLimit() error {
	E, ns := l.cfg.NumExperts, sharedChunks(&l.cfg, l.fusedOK)
	if ns > 0 && E+ns > MaxExperts {
		return fmt.Errorf("mode FusedShared: %d routed experts + %d shared-expert chunks = %d experts to sort, over the align kernel's limit of %d (MaxExperts); use Dual: %w",
			E, ns, E+ns, MaxExperts, gpuctx.ErrInvalid)
	}
	return nil
}

// aligned16 reports whether b's device address is a multiple of 16 bytes.
func aligned16(b *gpuctx.Buffer) bool {
	p, err := b.Ptr()
	return err == nil && p%16 == 0
}

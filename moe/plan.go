package moe

import (
	"fmt"
	"math"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// routePath is how a forward computes the routed experts.
type routePath uint8

const (
	pathNone    routePath = iota // no routed part (SharedOnly)
	pathGrouped                  // router GEMM, route, plan, grouped GEMMs with host-side group sizes
	pathSmall                    // router GEMM, route, plan, the small-batch kernels (sizes on the device)
	pathFused                    // route, aligned sort, the fused tile kernels (bf16)
)

// sharedPlace is where a routed forward queues the shared expert.
type sharedPlace uint8

const (
	sharedNone  sharedPlace = iota
	sharedMain              // on the main stream, after the counts copy: it runs while the host waits
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
	ks             int  // slots per token: K, plus the fused shared expert's chunks
	experts        int  // experts the fused kernels see: E, plus the fused chunks
	early          int  // fused shared chunks whose up blocks run before the sort ends
	staged         bool // x and y go through the layer's 16-byte aligned buffers
	graph          bool // captured on the second forward of its key, replayed after
	capturing      bool // a graph capture is under way (no tuning, no host waits)
	tiles          tilePair
	tilesKnown     bool    // tiles are forced, tuned or by rule; else the forward tunes them
	sortBM         int     // the one-launch sort's tile rows (tiles.up.BM when known)
	fp8            fp8Pair // FP8 experts: the tiles (w8a16 or w8a8), by rule (fp8Tiles); tiles is unused
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

// plan checks a forward's arguments and returns its plan. With mode Auto on a
// fused-path batch whose shared expert can be fused, the first forward of a
// token bucket times Dual against FusedShared (autoMode) before planning.
func (l *Layer) plan(op string, x, y *gpuctx.Buffer, T int, mode Mode, part Part) (*plan, error) {
	if err := l.checkForward(op, x, y, T, mode, part); err != nil {
		return nil, err
	}
	c := &l.cfg
	p := &plan{T: T, n: T * c.HiddenSize * l.es, routed: part != SharedOnly, shared: l.shared.gu != nil && part != RoutedOnly}
	mode, err := l.resolveMode(op, x, y, p, mode, part)
	if err != nil {
		return nil, err
	}
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
	if p.path == pathFused && l.experts.q != nil {
		p.fp8, p.tilesKnown = fp8Tiles(T, p.ks, p.experts, l.experts.q.w8), true
		p.sortBM = p.fp8.bm()
	} else if p.path == pathFused {
		p.tiles, p.tilesKnown = l.knownTiles(p)
		p.sortBM = p.tiles.up.BM
		if !p.tilesKnown {
			p.sortBM = ruleTile(T, p.ks, p.experts).BM
		}
	}
	return p, nil
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
	case !p.routed || !p.shared:
	case fusedShared:
		p.place, p.ks, p.experts = sharedFused, c.TopK+l.ns, c.NumExperts+l.ns
	case p.dual:
		p.place = sharedSide
	default:
		p.place = sharedMain
	}
}

// checkForward checks ForwardDevice's arguments; the error names the bad one.
func (l *Layer) checkForward(op string, x, y *gpuctx.Buffer, T int, mode Mode, part Part) error {
	c := &l.cfg
	H, E, K, I, Is := c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate, c.SharedIntermediate
	switch {
	case T <= 0:
		return fmt.Errorf("moe: %s: T = %d tokens: must be > 0: %w", op, T, gpuctx.ErrInvalid)
	case int64(T)*int64(K) > math.MaxInt32 || int64(T)*int64(max(H, 2*I, 2*Is, E)) > math.MaxInt32:
		return fmt.Errorf("moe: %s: T = %d tokens is too many for 32-bit kernel arguments; split the batch: %w", op, T, gpuctx.ErrInvalid)
	case mode < Single || mode > FusedShared:
		return fmt.Errorf("moe: %s: unknown mode %v; use Single, Dual, Auto or FusedShared: %w", op, mode, gpuctx.ErrInvalid)
	case part < Whole || part > RoutedOnly:
		return fmt.Errorf("moe: %s: unknown part %v; use Whole, SharedOnly or RoutedOnly: %w", op, part, gpuctx.ErrInvalid)
	case part == SharedOnly && l.shared.gu == nil:
		return fmt.Errorf("moe: %s: part SharedOnly, but this %s layer has no shared expert: %w", op, c.Family, gpuctx.ErrInvalid)
	}
	if mode == FusedShared {
		if err := l.fusedSharedLimit(); err != nil {
			return fmt.Errorf("moe: %s: %w", op, err)
		}
	}
	if l.fused(T) {
		// The fused kernels' sorted rows stay 32-bit: the slots and experts
		// of FusedShared where the mode may run it.
		ks, ne := K, E
		if mode == FusedShared || mode == Auto {
			ks, ne = K+l.ns, E+l.ns
		}
		if err := moekernels.CheckLimits(T, ks, ne, H, I); err != nil {
			return fmt.Errorf("moe: %s: %v: %w", op, err, gpuctx.ErrInvalid)
		}
	}
	n := T * H * l.es
	for _, b := range []struct {
		name string
		buf  *gpuctx.Buffer
	}{{"x", x}, {"y", y}} {
		if b.buf == nil {
			return fmt.Errorf("moe: %s: %s is nil: %w", op, b.name, gpuctx.ErrInvalid)
		}
		if b.buf.Device() != l.dev {
			return fmt.Errorf("moe: %s: %s belongs to another device than the layer: %w", op, b.name, gpuctx.ErrWrongDevice)
		}
		if b.buf.Size() < n {
			return fmt.Errorf("moe: %s: %s holds %d bytes; T*H = %d*%d %v elements need %d: %w", op, b.name, b.buf.Size(), T, H, l.dt, n, gpuctx.ErrSize)
		}
	}
	return nil
}

// resolveMode returns the mode a forward of p runs: mode itself, or for Auto,
// Dual or FusedShared (autoMode) on the fused path with a fusable shared
// expert, Dual on the fused path otherwise, and elsewhere Dual for the
// small-batch path and batches of at least AutoThreshold tokens, else Single.
func (l *Layer) resolveMode(op string, x, y *gpuctx.Buffer, p *plan, mode Mode, part Part) (Mode, error) {
	if mode != Auto {
		return mode, nil
	}
	T := p.T
	both := p.routed && p.shared && l.fused(T)
	switch {
	case both && l.ns > 0:
		return l.autoMode(op, x, y, T, part)
	case both:
		return Dual, nil
	case (part != SharedOnly && l.smallBatch(T)) || T >= l.thresh:
		return Dual, nil
	}
	return Single, nil
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

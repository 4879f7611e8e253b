package moe

import (
	"fmt"
	"strings"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// The FP8 layer's tuner: as the bf16 one (tune), per token bucket and shared
// fusion (tileKey) on the first forward of a bucket where the layer
// autotunes, it times the w8a16 tiles (moekernels.FP8Gemms, up and down
// apart, BM by BM: bestOfBMs) and, where the w8a8 tiles may run (fp8W8A8Cands),
// the best w8a16 pair as a chain (up then down: timeChain) and each w8a8
// pair's whole chain (both quantizers, up and down: fusedW8A8), and keeps
// the fastest (settle). The choice is the same for Single and Dual (one
// key), so they stay bitwise equal; it changes the result where it switches
// between w8a16 and w8a8, as the rule (fp8Tiles) does by the batch size.

// w8a8Pairs are the w8a8 tile pairs an FP8 layer loads (fp8Experts.loadKernels)
// and the tuner times: the one-warpgroup pair, the 128-row pair, the
// one-warpgroup pair not persistent, the transposed pairs of 8, 16 and 32
// rows, then the wide 128-row pair (last, so that a tie keeps the others).
var w8a8Pairs = [...]fp8Pair{
	{w8: true, w8up: w8a8SmallUp, w8down: w8a8SmallDown},
	{w8: true, w8up: w8a8Up, w8down: w8a8Down},
	{w8: true, w8up: w8a8PlainSmallUp, w8down: w8a8PlainSmallDown},
	{w8: true, w8up: w8a8T8Up, w8down: w8a8T8Down},
	{w8: true, w8up: w8a8T16Up, w8down: w8a8T16Down},
	{w8: true, w8up: w8a8T32Up, w8down: w8a8T32Down},
	{w8: true, w8up: w8a8WideUp, w8down: w8a8WideDown},
}

// w8a8TuneRows is the fewest rows per touched expert at which the tuner
// times the w8a8 pairs of 64 and 128 rows: at 8-16 rows a 64-row block is
// mostly padding, but its products run at FP8's rate and its activations
// are half the bytes, so whether it wins is measured, not assumed.
const w8a8TuneRows = 8

// timedAt reports whether the tuner times w8a8 pair tp for batches of m rows
// per touched expert: a transposed pair of BM rows up to 2*BM rows (a
// second block per expert re-reads its weights), the others from
// w8a8TuneRows.
func (tp fp8Pair) timedAt(m int) bool {
	if tp.w8up.Trans {
		return m <= 2*tp.w8up.BM
	}
	return m >= w8a8TuneRows
}

// fp8Rule is the rule's FP8 tiles for p (fp8Tiles): the w8a8 tiles where the
// layer has them and the shared expert is not fused (they take no shared
// chunks).
func (l *Layer) fp8Rule(p *plan) fp8Pair {
	return fp8Tiles(p.T, p.ks, p.experts, l.experts.q.w8 && !p.fusedShared())
}

// knownFP8 returns the FP8 tiles of p's bucket when they are already chosen
// (by rule where the layer does not autotune, or tuned), without tuning.
func (l *Layer) knownFP8(p *plan) (fp8Pair, bool) {
	if !l.tuner.autotune {
		return l.fp8Rule(p), true
	}
	tp, ok := l.tuner.fp8[tileKey{tileBucket(p.T), p.fusedShared()}]
	return tp, ok
}

// tuneFP8 times the FP8 candidates on this forward's routing and returns the
// fastest: the w8a16 pair of bestOfBMs (up+down; where w8a8 chains are
// timed, its own chain's time) or a w8a8 pair's chain (fp8W8A8Cands). With
// the fused shared expert on the one-launch routing each w8a16 up kernel is
// timed with gpuctx_moe_route_align ahead of it, as in tune. It logs every
// time (TileChoices), runs on the main stream and waits for it.
func (l *Layer) tuneFP8(p *plan, x *gpuctx.Buffer) (fp8Pair, error) {
	withRoute := p.ks > l.cfg.TopK && p.oneLaunch
	var log []string
	up, down, err := bestOfBMs(l, p, l.fp8Cands(p, x, withRoute), &log)
	if err != nil {
		return fp8Pair{}, err
	}
	best, bestD := fp8Pair{up: up.c, down: down.c}, up.d+down.d
	w8a8 := l.fp8W8A8Cands(p)
	var chains []string
	if len(w8a8) > 0 {
		// Against the w8a8 chains, the w8a16 pair is timed as they are: up
		// then down in one timing, as the forward queues them. Its kernels
		// timed apart, each after itself, hid the start and drain between
		// them: on the H200 (session 15, Qwen3-30B-A3B at 64 tokens) the
		// w8a16 pair summed 173.1 us against the t8 chain's 172.5, yet the
		// layer ran 13 us slower with it.
		if bestD, err = l.timeChain(p, x, best); err != nil {
			return fp8Pair{}, err
		}
		chains = append(chains, fmt.Sprintf("w8a16 %s/%s %.1f", best.up.Tag(), best.down.Tag(), us(bestD)))
	}
	for _, tp := range w8a8 {
		d, err := l.timeChain(p, x, tp)
		if err != nil {
			return fp8Pair{}, err
		}
		chains = append(chains, fmt.Sprintf("%s/%s %.1f", tp.w8up.Tag(), tp.w8down.Tag(), us(d)))
		if d < bestD {
			best, bestD = tp, d
		}
	}
	tail := fmt.Sprintf(", %.1f us (%s: %s", us(bestD), timedWhat(withRoute), strings.Join(log, ", "))
	if len(chains) > 0 {
		tail += "; chains us: " + strings.Join(chains, ", ")
	}
	l.tuner.logChoice(p, best, tail+")")
	return best, nil
}

// fp8Cands are the w8a16 tiles tuneFP8 times: every tile of
// moekernels.FP8Gemms, each kernel queued on the main stream as fusedFP8
// queues it.
func (l *Layer) fp8Cands(p *plan, x *gpuctx.Buffer, withRoute bool) []tileCand[moekernels.FP8Gemm] {
	var cands []tileCand[moekernels.FP8Gemm]
	for _, c := range moekernels.FP8Gemms {
		cands = append(cands, tileCand[moekernels.FP8Gemm]{c: c, tag: c.Tag(), bm: c.BM,
			up:   l.routedUp(p, x, c.BM, withRoute, func() error { return l.experts.fp8Up(c, x, &l.dispatch, p) }),
			down: func() error { return l.experts.fp8Down(c, &l.dispatch, p) }})
	}
	return cands
}

// fp8W8A8Cands are the w8a8 pairs tuneFP8 times for p: those of w8a8Pairs
// timed at p's rows per touched expert (fp8Pair.timedAt), where the layer
// has the w8a8 tiles (fp8Experts.w8) and the shared expert is not fused
// (they take no shared chunks); else none.
func (l *Layer) fp8W8A8Cands(p *plan) []fp8Pair {
	if !l.experts.q.w8 || p.fusedShared() {
		return nil
	}
	m := rowsPerExpert(p.T, p.ks, p.experts)
	var out []fp8Pair
	for _, tp := range w8a8Pairs {
		if tp.timedAt(m) {
			out = append(out, tp)
		}
	}
	return out
}

// timeChain sorts p's routing in blocks of tp's rows and times tp's kernels
// together as the forward queues them (fusedFP8): a w8a8 pair's chain (the
// quantizer of x, the up tile, the quantizer of act, the down tile) or a
// w8a16 pair's up then down, on the main stream, waiting for them. It is
// called only where the shared expert is not fused (with the w8a8 chains),
// so no routing is queued ahead of the up kernel.
func (l *Layer) timeChain(p *plan, x *gpuctx.Buffer, tp fp8Pair) (time.Duration, error) {
	cp := *p
	cp.fp8 = tp
	if err := l.ensureFused(&cp, tp.bm()); err != nil {
		return 0, err
	}
	if err := l.dispatch.align(l.router.idx, &cp, tp.bm()); err != nil {
		return 0, err
	}
	d, err := l.timeIt(tp.tags(), func() error { return l.experts.fusedFP8(x, &l.dispatch, &cp) })
	if err != nil {
		return 0, fmt.Errorf("moe: timing tiles %s: %w", tp.tags(), err)
	}
	return d, nil
}

// upDown names tp's kernels' tiles (TileChoices), e.g. "up m16n64w4s4, down
// m16n128w8s3" or "up w8a8 m64n64s4p2, down w8a8 m64n128s4p2".
func (tp fp8Pair) upDown() string {
	if tp.w8 {
		return "up w8a8 " + tp.w8up.Tag() + ", down w8a8 " + tp.w8down.Tag()
	}
	return "up " + tp.up.Tag() + ", down " + tp.down.Tag()
}

func (fp8Pair) note() string { return ", fp8" }

// record is tp's tuning cache record for bucket b.
func (tp fp8Pair) record(b tileKey) tuneTile {
	t := tuneTile{Bucket: b.bucket, FusedShared: b.fusedShared, Up: tp.up.Tag(), Down: tp.down.Tag(), Kind: kindW8A16}
	if tp.w8 {
		t.Up, t.Down, t.Kind = tp.w8up.Tag(), tp.w8down.Tag(), kindW8A8
	}
	return t
}

// fp8PairOf parses an FP8 layer's cache record: w8a16 tiles of
// moekernels.FP8Gemms, or one of w8a8Pairs.
func fp8PairOf(t tuneTile) (fp8Pair, error) {
	switch t.Kind {
	case kindW8A16:
		up, err := parseFP8Tile(t.Up)
		if err != nil {
			return fp8Pair{}, err
		}
		down, err := parseFP8Tile(t.Down)
		if err != nil || up.BM != down.BM {
			return fp8Pair{}, fmt.Errorf("moe: tuning cache: w8a16 tiles %q/%q: %w", t.Up, t.Down, gpuctx.ErrInvalid)
		}
		return fp8Pair{up: up, down: down}, nil
	case kindW8A8:
		for _, tp := range w8a8Pairs {
			if tp.w8up.Tag() == t.Up && tp.w8down.Tag() == t.Down {
				return tp, nil
			}
		}
		return fp8Pair{}, fmt.Errorf("moe: tuning cache: unknown w8a8 pair %q/%q: %w", t.Up, t.Down, gpuctx.ErrInvalid)
	}
	return fp8Pair{}, fmt.Errorf("moe: tuning cache: tiles of kind %q, not FP8 ones: %w", t.Kind, gpuctx.ErrInvalid)
}

// parseFP8Tile finds the w8a16 tile of moekernels.FP8Gemms whose tag is s.
func parseFP8Tile(s string) (moekernels.FP8Gemm, error) {
	for _, c := range moekernels.FP8Gemms {
		if c.Tag() == s {
			return c, nil
		}
	}
	return moekernels.FP8Gemm{}, fmt.Errorf("moe: unknown FP8 tile %q: %w", s, gpuctx.ErrInvalid)
}

package moe

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// Mode says on which streams Layer.ForwardDevice runs the shared expert.
type Mode int

const (
	// Single runs everything on the main stream.
	Single Mode = iota
	// Dual runs the shared expert on a side stream, forked from the main stream
	// with an event after the input is ready and joined back with an event before
	// the combine, so that it overlaps the router and the routed experts.
	Dual
	// Auto picks per batch. On the fused routed path (bf16) with a shared
	// expert it can fuse, it runs Dual or FusedShared, whichever replayed
	// faster when Auto first ran a batch of that token bucket (measured then,
	// kept after); with a shared expert it cannot fuse, Dual. Elsewhere it is
	// Dual for batches that take the small-batch path and for batches of at
	// least the layer's AutoThreshold tokens, Single otherwise.
	Auto
	// FusedShared computes the shared expert inside the fused routed kernels, as
	// extra experts of weight 1 that every token is routed to (its width split
	// into chunks of the routed experts' width): no shared-expert GEMMs, no side
	// stream. Its chunks sort ahead of the routed experts, so the up kernel's
	// blocks of their rows, which do not depend on the routing, run on the main
	// stream while the routing still does. It needs the fused routed path (bf16,
	// a batch above SmallBatchTokens), a shared expert whose width is a multiple
	// of the routed width, and no Qwen2-MoE shared-expert gate; elsewhere it
	// runs as Dual. Its result equals Dual's to bf16 rounding (the shared
	// expert's output is rounded per chunk), not bitwise.
	FusedShared
)

// ParseMode parses "single", "dual", "auto" or "fused" (case-insensitive).
func ParseMode(s string) (Mode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "single":
		return Single, nil
	case "dual":
		return Dual, nil
	case "auto":
		return Auto, nil
	case "fused":
		return FusedShared, nil
	}
	return 0, fmt.Errorf("moe.ParseMode: unknown mode %q; want single, dual, auto or fused", s)
}

// String returns "single", "dual", "auto", or "Mode(n)" for an invalid value.
func (m Mode) String() string {
	switch m {
	case Single:
		return "single"
	case Dual:
		return "dual"
	case Auto:
		return "auto"
	case FusedShared:
		return "fused"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Part selects what Layer.ForwardDevice computes, for benchmarks.
type Part int

const (
	// Whole is the MoE block: routed experts plus the shared expert.
	Whole Part = iota
	// SharedOnly is the shared expert alone (with its Qwen2-MoE gate), y =
	// gate * Shared(x). It is an error on a layer without a shared expert.
	SharedOnly
	// RoutedOnly is the routed path alone: router, routing, permutation, the
	// routed experts and the combine, without the shared expert.
	RoutedOnly
)

// String returns "whole", "shared", "routed", or "Part(n)" for an invalid value.
func (p Part) String() string {
	switch p {
	case Whole:
		return "whole"
	case SharedOnly:
		return "shared"
	case RoutedOnly:
		return "routed"
	}
	return fmt.Sprintf("Part(%d)", int(p))
}

// DefaultAutoThreshold is the batch size (tokens) at and above which Auto uses
// Dual on the grouped-GEMM path when LayerOptions.AutoThreshold is 0.
//
// Measured on an H200 (bench/RESULTS.md, 2026-11-30), DeepSeek-V2-Lite and
// Qwen1.5-MoE layers in bf16: on the small-batch path (graph replay, no host
// wait) Dual beat Single by 10% at 1 token and 1.5-8% up to 64 tokens, so Auto
// always uses Dual there. On the grouped-GEMM path (which waits once for the
// per-expert counts) Dual was within noise of Single or slower at every size
// from 32 to 4096 tokens: Single already runs the shared expert while the host
// waits, and those GEMMs are bound by weight bandwidth, which a second stream
// cannot add to. So on that path Auto stays on Single for any batch (the
// threshold is larger than any batch the kernels accept); set
// LayerOptions.AutoThreshold to opt in where your own measurement says Dual wins.
const DefaultAutoThreshold = math.MaxInt32

// DefaultSmallBatchTokens is what LayerOptions.SmallBatchTokens 0 means for
// layers without the fused path (f32; bf16 with NoFused or sizes not multiples
// of 8); bf16 layers with it take no small-batch path by default.
const DefaultSmallBatchTokens = 16

// Kernel limits (moekernels, which also gives them to moe.cu): experts per
// layer and experts per token.
const (
	MaxExperts = moekernels.MaxExperts
	MaxTopK    = moekernels.MaxTopK
)

// LayerOptions configures NewLayer.
type LayerOptions struct {
	// DType is gpuctx.F32 or gpuctx.BF16: the type of the weights and of every
	// activation on the device. Accumulation is always f32; router logits and
	// routing weights are f32. The zero value is refused.
	DType gpuctx.DType
	// Mode is the default mode of Forward (the zero value is Single).
	Mode Mode
	// AutoThreshold is the number of tokens at or above which Auto uses Dual;
	// 0 means DefaultAutoThreshold.
	AutoThreshold int
	// Stream is the main stream. nil: the layer makes its own (closed by Close).
	Stream *gpuctx.Stream
	// SmallBatchTokens: batches of at most this many tokens compute the routed
	// experts with the small-batch kernels (one warp per output row), whose
	// group sizes stay on the device (no host wait), instead of the fused path
	// (bf16) or grouped GEMMs (f32). 0 means none for layers that take the fused
	// path (on an H200 it beat the small-batch kernels at every size: 65 against
	// 108 us at 1 token, 180 against 298 at 8, DeepSeek-V2-Lite; bench/RESULTS.md)
	// and DefaultSmallBatchTokens for the others; a negative value turns the
	// small-batch path off. It needs hidden_size and moe_intermediate_size to be
	// multiples of 8 (else the GEMM path runs).
	SmallBatchTokens int
	// NoGraphs runs every forward eagerly. By default a forward that needs no
	// host wait (the small-batch path, or the shared expert alone) is captured
	// into a graph on its second run with that shape and replayed from then on,
	// where the backend can capture streams.
	NoGraphs bool
	// NoFused turns the fused routed path off (bf16 layers use it by default for
	// batches above SmallBatchTokens; f32 layers never do): the routed experts
	// then run as grouped GEMMs with host-side group sizes, as before it existed.
	NoFused bool
	// Tile forces one tile config of the fused expert GEMMs for every batch
	// (a tile tag such as "m16n64k64w1x4s6", or a warpgroup tile such as
	// "m128n128k64g2s4", which needs compute capability 9.0 and is refused by
	// NewLayer elsewhere; a down-only tile forces the down kernel and runs the
	// up kernel with a tile of its BM); empty: tuned per bucket.
	Tile string
	// NoAutotune picks fused tiles by a rule of thumb instead of timing the
	// candidates on the first forward of each token bucket (timing needs CUDA
	// events and waits for the main stream once per bucket), and has Auto
	// pick FusedShared or Dual by the token count (autoRuleTokens) instead of
	// timing both. For one-shot runs, where the timing would cost more than it
	// saves; the tile changes no result.
	NoAutotune bool
}

// Layer is one MoE block on a device: the weights (experts fused as [E,2I,H]
// gate-then-up and [E,H,I] down), a BLAS Context on the main stream and a view
// of it on the side stream, the events that fork and join the side stream, and
// scratch buffers that grow as needed.
//
// A Layer serialises its own calls with a mutex, so it is safe to call from
// several goroutines, but calls do not overlap: one forward is queued at a time.
type Layer struct {
	mu     sync.Mutex
	closed bool

	dev    *gpuctx.Device
	cfg    Config
	dt     gpuctx.DType
	es     int // element size of dt
	mode   Mode
	thresh int
	small  int // SmallBatchTokens, resolved

	useGraphs  bool                        // capture and replay where possible
	graphs     map[graphKey]*gpuctx.Graph  // captured forwards
	seen       map[graphKey]int            // forwards run per shape (the first is eager)
	gx, gy     *gpuctx.Buffer              // the graphs' staging input and output
	direct     map[directKey]*gpuctx.Graph // graphs captured on callers' x and y
	directSeen map[directKey]bool          // (shape, x, y) run once through staging
	flav       gpuctx.Flavour

	main, side  *gpuctx.Stream
	ownMain     bool
	ctx, sctx   *gpuctx.Context // sctx: ctx.WithStream(side)
	evFork      *gpuctx.Event
	evJoin      *gpuctx.Event
	evCounts    *gpuctx.Event
	kRoute      *gpuctx.Kernel
	kPlan       *gpuctx.Kernel
	kGather     *gpuctx.Kernel
	kSwiglu     *gpuctx.Kernel
	kCombine    *gpuctx.Kernel
	kExpertUp   *gpuctx.Kernel
	kExpertDown *gpuctx.Kernel
	kAlign      *gpuctx.Kernel
	kAlign3     [3]*gpuctx.Kernel // gpuctx_moe_align_count, _scan, _scatter
	align3From  int               // assignments from which the three-launch align runs
	raTokens    int               // batches of at most this many tokens route in gpuctx_moe_route_align
	kCombRows   *gpuctx.Kernel
	kRouteAlign *gpuctx.Kernel

	fusedOK     bool                                  // bf16, H and I multiples of 8, not NoFused
	ns          int                                   // shared-expert chunks fused as experts E.. (0: none)
	routedKS    int                                   // topk row stride of the last routed forward
	kUp         map[moekernels.MoEGemm]*gpuctx.Kernel // fused up kernels by tile
	kDown       map[moekernels.MoEGemm]*gpuctx.Kernel // fused down kernels by tile
	forceTile   *moekernels.MoEGemm                   // LayerOptions.Tile
	autotune    bool                                  // time the tiles per bucket
	noTune      bool                                  // LayerOptions.NoAutotune: no timing runs at all (tiles, Auto's mode)
	tiles       map[tileKey]tilePair                  // chosen tiles by token bucket and shared fusion
	tuneLog     []string                              // what tune chose (TileChoices)
	autoModes   map[int]Mode                          // Auto's measured choice by token bucket
	evTune      [2]*gpuctx.Event                      // timing events of tune
	capturing   bool                                  // a graph capture is under way
	countsHost  *gpuctx.HostBuffer
	weightBufs  []*gpuctx.Buffer
	router      *gpuctx.Buffer // [E,H] dt
	bias        *gpuctx.Buffer // [E] f32 (zeros when the config has no bias)
	gu, down    *gpuctx.Buffer // [E,2I,H], [E,H,I] dt
	sgu, sdown  *gpuctx.Buffer // [2Is,H], [H,Is] dt, or nil
	sgate       *gpuctx.Buffer // [H] dt, or nil
	scr         scratch
	routedT     int  // tokens of the last forward that routed (0: none)
	lastDual    bool // whether the last forward used the side stream (tests)
	fusedShared bool // the current forward computes the shared expert in the fused kernels
	sharedWait  bool // tests: the up kernel reads the fused shared rows from the sort after its wait, like the others
	lastStaged  bool // the current forward stages x and y (not 16-byte aligned)

	// An expert-parallel shard (ExpertShard) holds only routed experts
	// [expLo, expHi) in gu and down, at index e-expLo; the Layer forward paths
	// are never run on it. For a Layer, expLo = 0 and expHi = NumExperts.
	shard        bool
	expLo, expHi int
}

// scratch holds the reusable device buffers of a forward.
type scratch struct {
	logits, idx, w, counts, offsets, pos *gpuctx.Buffer // routing
	xp, h, act, out                      *gpuctx.Buffer // routed experts
	sorted, bexp, npost                  *gpuctx.Buffer // fused path: aligned sort
	ticket                               *gpuctx.Buffer // gpuctx_moe_route_align's last-block ticket (0 at rest)
	bcnt, boff                           *gpuctx.Buffer // three-launch align: per-chunk counts, offsets
	sh, sact, sout, sg                   *gpuctx.Buffer // shared expert
	xio, yio                             *gpuctx.Buffer // Forward's input and output
}

func (s *scratch) all() []**gpuctx.Buffer {
	return []**gpuctx.Buffer{&s.logits, &s.idx, &s.w, &s.counts, &s.offsets, &s.pos,
		&s.xp, &s.h, &s.act, &s.out, &s.sorted, &s.bexp, &s.npost, &s.ticket, &s.bcnt, &s.boff, &s.sh, &s.sact, &s.sout, &s.sg, &s.xio, &s.yio}
}

// NewLayer validates cfg and w, uploads the weights to dev in o.DType
// (synchronous copies that wait for nothing queued), compiles or looks up the
// MoE kernels, and makes the side stream, the events and the BLAS Context.
// Errors name the bad value: a nil device, an invalid config or weights, a
// dtype other than F32/BF16, more than MaxExperts experts or MaxTopK experts per
// token, a negative AutoThreshold, an unknown Mode, or a stream of another
// device. On error everything made so far is released. LoadLayer builds the
// same layer straight from a checkpoint.
func NewLayer(dev *gpuctx.Device, cfg *Config, w *Weights, o LayerOptions) (*Layer, error) {
	return newLayer("NewLayer", dev, cfg, w, o, nil)
}

// newLayer is NewLayer; a non-nil experts [lo, hi) makes an expert-parallel
// shard that uploads only those routed experts (see Layer.shard).
func newLayer(op string, dev *gpuctx.Device, cfg *Config, w *Weights, o LayerOptions, experts *[2]int) (*Layer, error) {
	if dev == nil {
		return nil, fmt.Errorf("moe: %s: nil device: %w", op, gpuctx.ErrInvalid)
	}
	if err := w.Check(cfg); err != nil {
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	return buildLayer("moe: "+op, dev, cfg, memWeights{w}, o, experts)
}

// checkLayerOptions checks o against dev and a valid cfg; the error names the
// bad value and has no prefix.
func checkLayerOptions(dev *gpuctx.Device, cfg *Config, o LayerOptions) error {
	if o.DType != gpuctx.F32 && o.DType != gpuctx.BF16 {
		return fmt.Errorf("dtype %v is not supported; use gpuctx.F32 or gpuctx.BF16: %w", o.DType, gpuctx.ErrInvalid)
	}
	if cfg.NumExperts > MaxExperts || cfg.TopK > MaxTopK {
		return fmt.Errorf("%d experts, top-%d: the MoE kernels support at most %d experts and top-%d: %w", cfg.NumExperts, cfg.TopK, MaxExperts, MaxTopK, gpuctx.ErrInvalid)
	}
	if o.Mode < Single || o.Mode > FusedShared {
		return fmt.Errorf("unknown mode %v; use Single, Dual, Auto or FusedShared: %w", o.Mode, gpuctx.ErrInvalid)
	}
	if o.AutoThreshold < 0 {
		return fmt.Errorf("AutoThreshold = %d: must be >= 0 (0 means DefaultAutoThreshold): %w", o.AutoThreshold, gpuctx.ErrInvalid)
	}
	if o.Stream != nil && o.Stream.Device() != dev {
		return fmt.Errorf("LayerOptions.Stream belongs to another device: %w", gpuctx.ErrWrongDevice)
	}
	return nil
}

// buildLayer makes a layer of cfg on dev (not nil) with options o and fills
// its weight buffers from src, which holds weights valid for cfg. Errors are
// prefixed with prefix ("moe: NewLayer", "moe.LoadLayer"); on error everything
// made so far is released.
func buildLayer(prefix string, dev *gpuctx.Device, cfg *Config, src weightSource, o LayerOptions, experts *[2]int) (*Layer, error) {
	if err := checkLayerOptions(dev, cfg, o); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	l := &Layer{dev: dev, cfg: *cfg, dt: o.DType, es: o.DType.Size(), mode: o.Mode, thresh: o.AutoThreshold,
		flav: gpuctx.Default, main: o.Stream}
	if l.thresh == 0 {
		l.thresh = DefaultAutoThreshold
	}
	l.useGraphs = !o.NoGraphs
	l.graphs, l.seen = map[graphKey]*gpuctx.Graph{}, map[graphKey]int{}
	l.direct, l.directSeen = map[directKey]*gpuctx.Graph{}, map[directKey]bool{}
	l.autoModes = map[int]Mode{}
	if l.dt == gpuctx.BF16 {
		l.flav = gpuctx.TensorOp
	}
	l.fusedOK = l.dt == gpuctx.BF16 && !o.NoFused && cfg.HiddenSize%8 == 0 && cfg.Intermediate%8 == 0
	switch l.small = o.SmallBatchTokens; {
	case l.small == 0 && l.fusedOK:
		l.small = 0 // the fused path beat the small-batch kernels at every size measured
	case l.small == 0:
		l.small = DefaultSmallBatchTokens
	case l.small < 0:
		l.small = 0
	}
	l.kUp, l.kDown, l.tiles = map[moekernels.MoEGemm]*gpuctx.Kernel{}, map[moekernels.MoEGemm]*gpuctx.Kernel{}, map[tileKey]tilePair{}
	if o.Tile != "" {
		t, err := parseTile(o.Tile)
		if err != nil {
			return nil, fmt.Errorf("%s: LayerOptions.Tile: %w", prefix, err)
		}
		if t.Warpgroups > 0 && l.fusedOK {
			// Fail here, not at the first forward, on a GPU without sm_90a.
			p := forcedPair(t)
			for _, c := range []moekernels.MoEGemm{p.up, p.down} {
				if _, _, err := l.fusedKernels(c); err != nil {
					return nil, fmt.Errorf("%s: LayerOptions.Tile %s: %w", prefix, o.Tile, err)
				}
			}
		}
		l.forceTile = &t
	}
	l.autotune = !o.NoAutotune && dev.Backend() == "cuda"
	l.noTune = o.NoAutotune
	l.align3From = align3From
	l.raTokens = routeAlignTokens
	if experts != nil {
		l.shard, l.expLo, l.expHi = true, experts[0], experts[1]
	}
	if err := l.init(src); err != nil {
		_ = l.release()
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	return l, nil
}

func (l *Layer) init(src weightSource) error {
	var err error
	if l.main == nil {
		if l.main, err = l.dev.NewStream(gpuctx.StreamOptions{}); err != nil {
			return err
		}
		l.ownMain = true
	}
	if l.side, err = l.dev.NewStream(gpuctx.StreamOptions{}); err != nil {
		return err
	}
	if l.ctx, err = l.dev.NewContext(gpuctx.ContextOptions{Stream: l.main}); err != nil {
		return err
	}
	if l.sctx, err = l.ctx.WithStream(l.side); err != nil {
		return err
	}
	for _, e := range []**gpuctx.Event{&l.evFork, &l.evJoin, &l.evCounts} {
		if *e, err = l.dev.NewEvent(false); err != nil {
			return err
		}
	}
	for i := range l.evTune {
		if l.evTune[i], err = l.dev.NewEvent(true); err != nil {
			return err
		}
	}
	for _, k := range []struct {
		dst  **gpuctx.Kernel
		name string
	}{{&l.kRoute, "gpuctx_moe_route"}, {&l.kPlan, "gpuctx_moe_plan"}, {&l.kGather, "gpuctx_moe_gather"},
		{&l.kSwiglu, "gpuctx_moe_swiglu"}, {&l.kCombine, "gpuctx_moe_combine"},
		{&l.kExpertUp, "gpuctx_moe_expert_up"}, {&l.kExpertDown, "gpuctx_moe_expert_down"},
		{&l.kAlign, "gpuctx_moe_align"}, {&l.kCombRows, "gpuctx_moe_combine_rows"},
		{&l.kAlign3[0], "gpuctx_moe_align_count"}, {&l.kAlign3[1], "gpuctx_moe_align_scan"},
		{&l.kAlign3[2], "gpuctx_moe_align_scatter"},
		{&l.kRouteAlign, "gpuctx_moe_route_align"}} {
		if *k.dst, err = l.dev.Kernel(k.name); err != nil {
			return err
		}
	}
	E, H, I, Is := l.cfg.NumExperts, l.cfg.HiddenSize, l.cfg.Intermediate, l.cfg.SharedIntermediate
	if !l.shard {
		l.expLo, l.expHi = 0, E
	}
	lo, hi := l.expLo, l.expHi
	if l.fusedOK && Is > 0 && !l.cfg.SharedGate && Is%I == 0 && Is/I <= MaxTopK {
		l.ns = Is / I
	}
	if l.countsHost, err = l.dev.AllocHost(4 * E); err != nil {
		return err
	}
	// Allocate every weight buffer, then fill them all.
	// With a fused shared expert, gu and down hold l.ns more experts after the
	// routed ones: chunk j of the shared expert's width as expert E+j.
	for _, b := range []struct {
		dst **gpuctx.Buffer
		n   int
		ok  bool
	}{{&l.router, E * H * l.es, true}, {&l.bias, 4 * E, true},
		{&l.gu, (hi - lo + l.ns) * 2 * I * H * l.es, true}, {&l.down, (hi - lo + l.ns) * H * I * l.es, true},
		{&l.sgu, 2 * Is * H * l.es, Is > 0}, {&l.sdown, H * Is * l.es, Is > 0},
		{&l.sgate, H * l.es, l.cfg.SharedGate}} {
		if b.ok {
			if *b.dst, err = l.alloc(b.n); err != nil {
				return err
			}
		}
	}
	if !l.cfg.HasBias() {
		if err := l.bias.CopyFromHost(make([]byte, 4*E)); err != nil { // zeros
			return err
		}
	}
	var copies []weightCopy
	put := func(b *gpuctx.Buffer, off int, c weightCopy) { // off: elements of b
		es := l.es
		if c.f32 {
			es = 4
		}
		if err == nil {
			c.dst, err = b.Slice(off*es, (c.r1-c.r0)*(c.c1-c.c0)*es)
			copies = append(copies, c)
		}
	}
	whole := func(p weightPart, e, rows, cols int) weightCopy {
		return weightCopy{part: p, expert: e, cols: cols, r1: rows, c1: cols}
	}
	put(l.router, 0, whole(wRouter, 0, E, H))
	if l.cfg.HasBias() {
		c := whole(wBias, 0, 1, E)
		c.f32 = true
		put(l.bias, 0, c)
	}
	for j := 0; j < l.ns; j++ {
		g, u := whole(wSharedGateProj, 0, (j+1)*I, H), whole(wSharedUpProj, 0, (j+1)*I, H)
		g.r0, u.r0 = j*I, j*I
		put(l.gu, (E+j)*2*I*H, g)
		put(l.gu, (E+j)*2*I*H+I*H, u)
		// Columns j*I.. of the [H, Is] down projection.
		d := whole(wSharedDownProj, 0, H, Is)
		d.c0, d.c1 = j*I, (j+1)*I
		put(l.down, (E+j)*H*I, d)
	}
	for e := lo; e < hi; e++ {
		put(l.gu, (e-lo)*2*I*H, whole(wGate, e, I, H))
		put(l.gu, (e-lo)*2*I*H+I*H, whole(wUp, e, I, H))
		put(l.down, (e-lo)*H*I, whole(wDown, e, H, I))
	}
	if Is > 0 {
		put(l.sgu, 0, whole(wSharedGateProj, 0, Is, H))
		put(l.sgu, Is*H, whole(wSharedUpProj, 0, Is, H))
		put(l.sdown, 0, whole(wSharedDownProj, 0, H, Is))
	}
	if l.cfg.SharedGate {
		put(l.sgate, 0, whole(wSharedExpertGate, 0, 1, H))
	}
	if err != nil {
		return err
	}
	return src.upload(l, copies)
}

func (l *Layer) alloc(n int) (*gpuctx.Buffer, error) {
	b, err := l.dev.Alloc(n)
	if err != nil {
		return nil, err
	}
	l.weightBufs = append(l.weightBufs, b)
	return b, nil
}

// weightPart names one weight tensor of a layer, as Layer.init asks a
// weightSource for it. Each is a row-major matrix (a vector is one row).
type weightPart uint8

const (
	wRouter           weightPart = iota // router [E, H]
	wBias                               // correction bias [1, E]
	wGate                               // routed expert's gate projection [I, H]
	wUp                                 // routed expert's up projection [I, H]
	wDown                               // routed expert's down projection [H, I]
	wSharedGateProj                     // shared expert's gate projection [Is, H]
	wSharedUpProj                       // shared expert's up projection [Is, H]
	wSharedDownProj                     // shared expert's down projection [H, Is]
	wSharedExpertGate                   // Qwen2-MoE shared_expert_gate [1, H]
)

// weightCopy is one copy Layer.init asks of a weightSource: rows [r0, r1) and
// columns [c0, c1) of weight part (of routed expert `expert` for wGate, wUp
// and wDown), a row-major matrix of cols columns, written row after row to
// dst, which holds exactly (r1-r0)*(c1-c0) elements, in the layer's dtype, or
// in f32 when f32 is set (the correction bias).
type weightCopy struct {
	part           weightPart
	expert         int
	cols           int
	r0, r1, c0, c1 int
	dst            *gpuctx.Buffer
	f32            bool
}

// full reports whether c takes whole rows (its source elements are contiguous).
func (c *weightCopy) full() bool { return c.c0 == 0 && c.c1 == c.cols }

// weightSource supplies a layer's weights to Layer.init: memWeights (NewLayer)
// or fileWeights (LoadLayer). The values it writes for a part are those of
// the part in float32 (Weights), converted to the destination's dtype.
type weightSource interface {
	// upload performs copies with synchronous host-to-device copies that wait
	// for nothing queued, in any order, and returns the first error.
	upload(l *Layer, copies []weightCopy) error
}

// memWeights is a weightSource over *Weights (checked against the config).
type memWeights struct{ w *Weights }

// part returns the values of part p (of routed expert e).
func (m memWeights) part(p weightPart, e int) []float32 {
	w := m.w
	switch p {
	case wRouter:
		return w.Router
	case wBias:
		return w.Bias
	case wGate:
		return w.Experts[e].Gate
	case wUp:
		return w.Experts[e].Up
	case wDown:
		return w.Experts[e].Down
	case wSharedGateProj:
		return w.Shared.Gate
	case wSharedUpProj:
		return w.Shared.Up
	case wSharedDownProj:
		return w.Shared.Down
	case wSharedExpertGate:
		return w.SharedGate
	}
	panic(fmt.Sprintf("moe: unknown weight part %d", p))
}

// upload converts each copy's values to its dtype (bf16 rounds to nearest
// even) and copies them, one copy at a time, on the calling goroutine.
func (m memWeights) upload(l *Layer, copies []weightCopy) error {
	for i := range copies {
		c := &copies[i]
		v := m.part(c.part, c.expert)
		if c.full() {
			v = v[c.r0*c.cols : c.r1*c.cols]
		} else {
			w := make([]float32, 0, (c.r1-c.r0)*(c.c1-c.c0))
			for r := c.r0; r < c.r1; r++ {
				w = append(w, v[r*c.cols+c.c0:r*c.cols+c.c1]...)
			}
			v = w
		}
		b := f32Bytes(v)
		if !c.f32 {
			b = l.encode(v)
		}
		if err := c.dst.CopyFromHost(b); err != nil {
			return err
		}
	}
	return nil
}

// encode returns v's bytes in the layer's dtype (bf16 rounds to nearest even).
func (l *Layer) encode(v []float32) []byte {
	if l.dt == gpuctx.F32 {
		return f32Bytes(v)
	}
	h := half.BF16s(v)
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(h))), 2*len(h))
}

// decode converts b (the layer's dtype) to float32 values.
func (l *Layer) decode(b []byte) []float32 {
	if l.dt == gpuctx.F32 {
		return append([]float32(nil), unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/4)...)
	}
	h := unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/2)
	out := make([]float32, len(h))
	for i, v := range h {
		out[i] = half.FromBF16(v)
	}
	return out
}

func f32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 4*len(v))
}

// MainStream returns the stream ForwardDevice queues work on (LayerOptions.Stream
// or the layer's own stream). Safe for concurrent use.
func (l *Layer) MainStream() *gpuctx.Stream { return l.main }

// SideStream returns the stream Dual runs the shared expert on (for naming
// it in a trace).
func (l *Layer) SideStream() *gpuctx.Stream { return l.side }

// DType returns the layer's storage dtype (gpuctx.F32 or gpuctx.BF16).
func (l *Layer) DType() gpuctx.DType { return l.dt }

// Config returns a copy of the layer's configuration.
func (l *Layer) Config() Config { return l.cfg }

// WeightBytes returns the bytes of weights a batch of T tokens reads: the
// router (and correction bias), the shared expert (and its gate), and each
// distinct routed expert selected in idx (the T*K indices of LastRouting). With
// idx nil it assumes min(E, T*K) distinct experts. It touches no device and is
// safe for concurrent use.
func (l *Layer) WeightBytes(T int, idx []int32) int64 {
	c := &l.cfg
	H, E, es := int64(c.HiddenSize), int64(c.NumExperts), int64(l.es)
	n := E * H * es
	if c.HasBias() {
		n += 4 * E
	}
	n += 3 * H * int64(c.SharedIntermediate) * es
	if c.SharedGate {
		n += H * es
	}
	var experts int64
	if idx == nil {
		experts = min(E, int64(max(T, 0))*int64(c.TopK))
	} else {
		seen := make(map[int32]struct{}, len(idx))
		for _, e := range idx {
			seen[e] = struct{}{}
		}
		experts = int64(len(seen))
	}
	return n + experts*3*H*int64(c.Intermediate)*es
}

// check returns an error if the layer is closed; l.mu must be held.
func (l *Layer) check(op string) error {
	if l.closed {
		return fmt.Errorf("moe: %s: layer: %w", op, gpuctx.ErrClosed)
	}
	return nil
}

// Close waits for the layer's streams, then releases its buffers, events,
// Context, side stream and (when the layer made it) main stream. Later calls
// return an error wrapping gpuctx.ErrClosed; double Close is harmless. If the
// device was closed first, Close only marks the layer closed.
func (l *Layer) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	return l.release()
}

// release frees everything the layer holds, ignoring objects that are already
// closed or freed (a device closed before the layer freed them).
func (l *Layer) release() error {
	var errs []error
	keep := func(err error) {
		if err != nil && !errors.Is(err, gpuctx.ErrClosed) && !errors.Is(err, gpuctx.ErrFreed) {
			errs = append(errs, err)
		}
	}
	for _, s := range []*gpuctx.Stream{l.main, l.side} {
		if s != nil {
			keep(s.Synchronize())
		}
	}
	for _, g := range l.graphs {
		keep(g.Close())
	}
	l.graphs = nil
	for _, g := range l.direct {
		keep(g.Close())
	}
	l.direct = nil
	for _, b := range append(l.scr.all(), &l.gx, &l.gy) {
		if *b != nil {
			keep((*b).Free())
			*b = nil
		}
	}
	for _, b := range l.weightBufs {
		keep(b.Free())
	}
	l.weightBufs = nil
	if l.countsHost != nil {
		keep(l.countsHost.Free())
		l.countsHost = nil
	}
	for _, e := range []*gpuctx.Event{l.evFork, l.evJoin, l.evCounts, l.evTune[0], l.evTune[1]} {
		if e != nil {
			keep(e.Close())
		}
	}
	if l.ctx != nil {
		keep(l.ctx.Close())
	}
	if l.side != nil {
		keep(l.side.Close())
	}
	if l.ownMain && l.main != nil {
		keep(l.main.Close())
	}
	return errors.Join(errs...)
}

package moe

import (
	"fmt"
	"math"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx"
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
	// Auto picks per batch. On the fused routed path (bf16, FP8) with a shared
	// expert it can fuse, it runs Dual or FusedShared, whichever replayed
	// faster when Auto first ran a batch of that token bucket (measured then,
	// kept after; by the token count under NoAutotune); with a shared expert
	// it cannot fuse, Dual. Elsewhere it is
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
	// expert's output is rounded per chunk), not bitwise. With FP8 the chunks
	// are FP8 too (LayerOptions.FP8), run by the w8a16 tiles, and the result
	// also differs from Dual's by the shared expert's FP8 rounding.
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
	// pick FusedShared or Dual by the token count (autoRuleTokens; an FP8
	// layer Dual at every size) instead of timing both. For one-shot runs,
	// where the timing would cost more than it saves; the bf16 tile changes
	// no result (an FP8 layer's choice between w8a16 and w8a8 tiles does:
	// see FP8).
	NoAutotune bool
	// FP8 keeps the routed experts' weights in FP8 on the device: E4M3
	// codes with the float32 scale of every 128x128 block beside them (as
	// DeepSeek-V3/R1 and Qwen3-FP8 ship them), never expanded to bf16, run
	// by the weight-only FP8 tiles (w8a16: bf16 activations, the codes
	// converted in registers) on the fused path; on a GPU of compute
	// capability 9.0 (and on the CPU backend) batches may run w8a8 tiles
	// instead: the activations quantized to E4M3 per token per 128 columns
	// on the device (scale = amax/448, vLLM's per_token_group_quant_fp8),
	// FP8 x FP8 wgmma, whose results differ from the w8a16 tiles' by a few
	// percent (E4M3's 3 mantissa bits). The tiles are timed per token bucket
	// as the bf16 ones (the w8a8 pairs, whole chains with the quantizers,
	// against the w8a16 tiles: the transposed pairs of 8, 16 and 32 rows up
	// to twice their rows per touched expert on average, the 64- and
	// 128-row pairs from 8), so a tuned layer may run w8a8 tiles at any
	// batch size; or picked by rule under NoAutotune and off CUDA (the w8a8
	// tiles from 9 rows per touched expert); Single and Dual run the same choice, so
	// they stay bitwise equal. An FP8 checkpoint's experts load as stored;
	// other weights are quantized at load (fp8.Quantize).
	// The router and correction bias stay as stored, the shared expert is
	// bf16 (dequantized from an FP8 checkpoint) for Single and Dual: the
	// routed experts are the bytes that matter. Where the shared expert can
	// be fused it is also held in FP8 as FusedShared's chunks (as stored, or
	// quantized at load; a chunk whose cut is not on a 128 block edge is
	// requantized), about ns*3*H*I more bytes; FusedShared runs them in the
	// w8a16 tiles at every batch size (never the w8a8 ones). Auto picks it
	// or Dual as for bf16, the faster when first timed per token bucket, but
	// under NoAutotune runs Dual at every size (on the H200 FusedShared was
	// never the faster for FP8); its results are the bits of the mode it
	// picked. It needs DType BF16 and sizes the tiles take, and refuses
	// NoFused, SmallBatchTokens > 0 and Tile (checkFP8).
	FP8 bool
	// FP8WeightOnly, with FP8, runs the routed experts in the w8a16 tiles
	// only (bf16 activations) at every batch size: never the w8a8 tiles, which
	// quantize the activations to E4M3 (their results lie 2-5% from the
	// float64 reference on the dequantized weights, the w8a16 tiles' within
	// about 1e-2). Slower where the w8a8 tiles win (on the H200, from about
	// 8 rows per touched expert; bench/RESULTS.md). Without FP8 it is an
	// error.
	FP8WeightOnly bool
	// Tokens, if set, are the batch sizes the caller expects to run: on CUDA
	// the fused tiles they will run or time (by the forced tile, the rule, the
	// tuning cache or tune's candidates) are compiled while the layer loads,
	// on several cores at once and alongside moe.cu, instead of at the first
	// forward. A hint only: any batch size still runs.
	Tokens []int
}

// Layer is one MoE block on a device: the stages of a forward (router,
// dispatch, routed experts, shared expert, combine; see core), each with its
// weights (experts fused as [E,2I,H] gate-then-up and [E,H,I] down), kernels
// and scratch buffers that grow as needed, a BLAS Context on the main stream
// and a view of it on the side stream, and the events that fork and join the
// side stream. A forward is planned first (plan), then run by one executor
// (enqueue), eagerly or as a captured graph.
//
// A Layer serialises its own calls with a mutex, so it is safe to call from
// several goroutines, but calls do not overlap: one forward is queued at a time.
type Layer struct {
	mu     sync.Mutex
	closed bool
	core

	mode    Mode
	thresh  int
	small   int  // SmallBatchTokens, resolved
	fusedOK bool // bf16, H and I multiples of 8, not NoFused
	ns      int  // shared-expert chunks fused as experts E.. (0: none)

	gc       graphCache
	tuner    tuner
	xio, yio *gpuctx.Buffer // Forward's input and output
	last     lastRouting    // the last routed forward (LastRouting)
	hook     func(*plan)    // tests: sees (and may change) each forward's plan before it runs
}

// NewLayer validates cfg and w, uploads the weights to dev in o.DType
// (synchronous copies that wait for nothing queued), compiles or looks up the
// MoE kernels, and makes the side stream, the events and the BLAS Context.
// Errors name the bad value: a nil device, an invalid config or weights, a
// dtype other than F32/BF16, FP8 options it cannot honour (see
// LayerOptions.FP8), more than MaxExperts experts or MaxTopK experts per
// token, a negative AutoThreshold, an unknown Mode, Mode FusedShared on a layer
// whose routed experts and shared-expert chunks pass MaxExperts, or a stream of
// another device. On error everything made so far is released. LoadLayer
// builds the same layer straight from a checkpoint.
func NewLayer(dev *gpuctx.Device, cfg *Config, w *Weights, o LayerOptions) (*Layer, error) {
	const op = "NewLayer"
	if dev == nil {
		return nil, fmt.Errorf("moe: %s: nil device: %w", op, gpuctx.ErrInvalid)
	}
	if err := w.Check(cfg); err != nil {
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	return buildLayer("moe: "+op, dev, cfg, memWeights{w}, o)
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
	if o.FP8WeightOnly && !o.FP8 {
		return fmt.Errorf("LayerOptions.FP8WeightOnly needs FP8 (it picks the FP8 experts' tiles): %w", gpuctx.ErrInvalid)
	}
	if o.FP8 {
		return checkFP8(cfg, o)
	}
	return nil
}

// buildLayer makes a layer of cfg on dev (not nil) with options o and fills
// its weight buffers from src, which holds weights valid for cfg. Errors are
// prefixed with prefix ("moe: NewLayer", "moe.LoadLayer"); on error everything
// made so far is released.
func buildLayer(prefix string, dev *gpuctx.Device, cfg *Config, src weightSource, o LayerOptions) (*Layer, error) {
	if err := checkLayerOptions(dev, cfg, o); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	l := &Layer{mode: o.Mode, thresh: o.AutoThreshold, gc: newGraphCache(!o.NoGraphs)}
	l.cfg = *cfg
	if l.thresh == 0 {
		l.thresh = DefaultAutoThreshold
	}
	l.fusedOK = o.DType == gpuctx.BF16 && !o.NoFused && cfg.HiddenSize%8 == 0 && cfg.Intermediate%8 == 0
	switch l.small = o.SmallBatchTokens; {
	case l.small == 0 && l.fusedOK:
		l.small = 0 // the fused path beat the small-batch kernels at every size measured
	case l.small == 0:
		l.small = DefaultSmallBatchTokens
	case l.small < 0:
		l.small = 0
	}
	if err := l.fusedSharedLimit(); err == nil {
		l.ns = sharedChunks(cfg, l.fusedOK)
	} else if o.Mode == FusedShared {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	if o.Tile != "" {
		t, err := parseTile(o.Tile)
		if err != nil {
			return nil, fmt.Errorf("%s: LayerOptions.Tile: %w", prefix, err)
		}
		l.tuner.forceTile = &t
	}
	l.tuner.autotune = !o.NoAutotune && (dev.Backend() == "cuda" || tuneAnyBackend)
	l.tuner.noTune, l.tuner.fp8Rule = o.NoAutotune, o.FP8
	l.tuner.tiles, l.tuner.fp8, l.tuner.autoModes = map[tileKey]tilePair{}, map[tileKey]fp8Pair{}, map[int]Mode{}
	if !o.NoAutotune && l.tuner.forceTile == nil {
		l.dt = o.DType // the key's dtype, before init sets it
		l.tuner.cache = newTuneCache(tuneCacheDir(tuneGetenv), tuneKeyText(dev, l, fp8FormOf(o)))
	}
	tokens := o.Tokens
	if o.FP8 {
		tokens = nil // no bf16 tiles to compile: the FP8 tiles load in init
	}
	wait := prefetchTiles(dev, l.expectedTiles(dev.Backend(), tokens))
	err := l.init(dev, cfg, o, src)
	wait()
	if err != nil {
		_ = l.release()
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	return l, nil
}

// init builds the stages and the tuner's events, and checks a forced tile.
func (l *Layer) init(dev *gpuctx.Device, cfg *Config, o LayerOptions, src weightSource) error {
	err := l.core.init(dev, cfg, coreSpec{dt: o.DType, stream: o.Stream, hi: cfg.NumExperts, ns: l.ns, fp8: o.FP8, w16only: o.FP8WeightOnly}, src)
	l.onGrow = l.gc.drop
	if err != nil {
		return err
	}
	for i := range l.tuner.evTune {
		if l.tuner.evTune[i], err = dev.NewEvent(true); err != nil {
			return err
		}
	}
	if t := l.tuner.forceTile; t != nil && t.Warpgroups > 0 && l.fusedOK {
		// Fail here, not at the first forward, on a GPU without sm_90a.
		p := forcedPair(*t)
		for _, c := range []moekernels.MoEGemm{p.up, p.down} {
			if _, _, err := l.experts.fusedKernels(c); err != nil {
				return fmt.Errorf("LayerOptions.Tile %s: %w", o.Tile, err)
			}
		}
	}
	return nil
}

// MainStream returns the stream ForwardDevice queues work on (LayerOptions.Stream
// or the layer's own stream). Safe for concurrent use.
func (l *Layer) MainStream() *gpuctx.Stream { return l.main }

// SideStream returns the stream Dual runs the shared expert on (for naming
// it in a trace).
func (l *Layer) SideStream() *gpuctx.Stream { return l.side }

// DType returns the layer's storage dtype (gpuctx.F32 or gpuctx.BF16); an
// FP8 layer (FP8) is BF16 but for its routed experts' weights.
func (l *Layer) DType() gpuctx.DType { return l.dt }

// FP8 reports whether the routed experts' weights are FP8 on the device
// (LayerOptions.FP8). Safe for concurrent use.
func (l *Layer) FP8() bool { return l.experts.q != nil }

// FusedSharedChunks returns the chunks of the routed width that the shared
// expert runs as in FusedShared (experts E .. E+n-1 of the fused kernels,
// held beside the routed experts' weights: bf16, or FP8 in an FP8 layer), or
// 0 where the layer cannot fuse it. Fixed when the layer is built; safe for
// concurrent use.
func (l *Layer) FusedSharedChunks() int { return l.ns }

// DeviceWeightBytes returns the bytes of device memory the layer's weights
// take (FP8 layers: the codes and their block scales included, and the FP8
// chunks of a fusable shared expert beside its bf16 copy), not counting
// scratch buffers (DeviceMemory counts everything); 0 once the layer is
// closed. It touches no device and is safe for concurrent use.
func (l *Layer) DeviceWeightBytes() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var n int64
	for _, b := range l.weightBufs {
		n += int64(b.Size())
	}
	return n
}

// Config returns a copy of the layer's configuration.
func (l *Layer) Config() Config { return l.cfg }

// WeightBytes returns the bytes of weights a batch of T tokens reads: the
// router (and correction bias), the shared expert (and its gate), and each
// distinct routed expert selected in idx (the T*K indices of LastRouting). With
// idx nil it assumes min(E, T*K) distinct experts. An FP8 layer's routed
// expert counts its codes and block scales. It touches no device and is safe
// for concurrent use.
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
	per := 3 * H * int64(c.Intermediate) * es
	if l.experts.q != nil { // one byte per weight, and the block scales
		sz := fp8Sizes(c, 1)
		per = int64(sz[0] + sz[1] + sz[2] + sz[3])
	}
	return n + experts*per
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
	return l.core.release([]**gpuctx.Buffer{&l.xio, &l.yio, &l.gc.gx, &l.gc.gy}, l.tuner.evTune[:], l.gc.close)
}

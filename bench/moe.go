package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"runtime/debug"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe"
)

// Progress is told about the steps of a long run: Begin once with their
// number, Step after each, End at the end. A nil Progress in an option struct
// reports nothing.
type Progress interface {
	Begin(total int, what string)
	Step(desc string)
	End()
}

type noProgress struct{}

func (noProgress) Begin(int, string) {}
func (noProgress) Step(string)       {}
func (noProgress) End()              {}

// Tracer records chosen forwards (moe bench --trace): Streams names the
// streams of the traced layer once, Forward runs one forward with the
// recording on.
type Tracer interface {
	Streams(main, side *gpuctx.Stream)
	Forward(name string, main *gpuctx.Stream, run func() error) error
}

// MoEOptions configures NewMoEBench.
type MoEOptions struct {
	Config *moe.Config
	// Weights returns the weights of set i (0 <= i < Sets); each set becomes
	// a Layer of its own, built before the next set's weights are asked for.
	Weights func(set int) (*moe.Weights, error)
	// Layer is the options of every Layer (DType, Mode and the paths); the
	// bench sets Stream: all the sets' layers share one main stream.
	Layer  moe.LayerOptions
	Modes  []moe.Mode
	Tokens []int
	// Iters timed forwards after Warmup untimed ones per measurement; the
	// forwards rotate over the Sets layers and inputs, so that no forward
	// finds its weights in L2.
	Iters, Warmup, Sets int
	Seed                uint64 // of the inputs
	// The ceilings: a CopyBytes device-to-device copy and a GemmN³ GEMM in
	// Layer.DType, GemmPerRound GEMMs per timed round.
	CopyBytes, GemmN, GemmPerRound int
	// CheckTol is the largest relative difference allowed between a mode's
	// timed output and the single-stream forward of the same input.
	CheckTol float64
	Progress Progress
	Tracer   Tracer // nil: no traced forwards
}

// MoEBench is an MoE layer bench on one device: a Layer per weight set on one
// main stream, the ceilings, and the passes measured so far.
type MoEBench struct {
	dev              *gpuctx.Device
	o                MoEOptions
	main             *gpuctx.Stream
	layers           []*moe.Layer
	timer            *Timer
	CopyBW, GemmRate float64
	passes           [][]MoERow
	prefix           string // of the progress steps ("round 2: ")
}

// NewMoEBench measures the two ceilings and builds a Layer per weight set;
// Close it.
func NewMoEBench(dev *gpuctx.Device, o MoEOptions) (_ *MoEBench, err error) {
	if o.Progress == nil {
		o.Progress = noProgress{}
	}
	o.Sets = max(o.Sets, 1)
	b := &MoEBench{dev: dev, o: o}
	defer func() {
		if err != nil {
			b.Close()
		}
	}()
	if b.CopyBW, err = CopyBandwidth(dev, o.CopyBytes, max(o.Iters, 5)); err != nil {
		return nil, err
	}
	o.Progress.Step("copy ceiling")
	if b.GemmRate, err = GemmRate(dev, o.GemmN, o.Layer.DType, o.GemmPerRound, min(max(o.Iters, 3), 10)); err != nil {
		return nil, err
	}
	o.Progress.Step("GEMM ceiling")
	if b.main, err = dev.NewStream(gpuctx.StreamOptions{}); err != nil {
		return nil, Fail("creating the layers' main stream", "", err)
	}
	if b.timer, err = NewTimer(dev, b.main); err != nil {
		return nil, Fail("creating timing events", "", err)
	}
	for set := range o.Sets {
		if err := b.addLayer(set); err != nil {
			return nil, err
		}
		o.Progress.Step(fmt.Sprintf("layer %d of %d built", set+1, o.Sets))
	}
	if o.Tracer != nil {
		o.Tracer.Streams(b.main, b.layers[0].SideStream())
	}
	return b, nil
}

// addLayer builds the layer of weight set `set`.
func (b *MoEBench) addLayer(set int) error {
	w, err := b.o.Weights(set)
	if err != nil {
		return err
	}
	lo := b.o.Layer
	lo.Stream = b.main
	l, err := moe.NewLayer(b.dev, b.o.Config, w, lo)
	if err != nil {
		return Fail(fmt.Sprintf("building the MoE layer of weight set %d on the device", set), "use fewer --sets or a smaller preset", err)
	}
	b.layers = append(b.layers, l)
	debug.FreeOSMemory() // the host copy of the weights is garbage now
	return nil
}

// Close releases the layers, the timer and the stream.
func (b *MoEBench) Close() {
	for _, l := range b.layers {
		l.Close()
	}
	if b.timer != nil {
		b.timer.Close()
	}
	if b.main != nil {
		b.main.Close()
	}
}

// stepsPerPass is the number of Progress steps of one Pass.
func stepsPerPass(o MoEOptions) int {
	parts := 1 // routed alone
	if o.Config.SharedIntermediate > 0 {
		parts++
	}
	return len(o.Tokens) * (1 + len(o.Modes) + parts)
}

// MoESteps is the number of Progress steps of NewMoEBench and RunRounds
// (rounds, with or without a peer) together.
func MoESteps(o MoEOptions, rounds int, peer bool) int {
	n := stepsPerPass(o)
	if peer {
		n++
	}
	return 2 + max(o.Sets, 1) + rounds*n
}

// TileChoices returns what the first layer's tile tuning chose.
func (b *MoEBench) TileChoices() []string { return b.layers[0].TileChoices() }

// Pass measures every token count once (every mode, the shared expert and
// the routed experts alone) and checks every mode's timed output.
func (b *MoEBench) Pass() ([]MoERow, error) {
	rows := make([]MoERow, 0, len(b.o.Tokens))
	for _, T := range b.o.Tokens {
		row, err := b.tokens(T, len(b.passes) == 0)
		if err != nil {
			return nil, err
		}
		rows = append(rows, row)
	}
	b.passes = append(b.passes, rows)
	return rows, nil
}

// Rows merges the passes so far (see MoERow) and sets the floor columns.
func (b *MoEBench) Rows() []MoERow {
	rows := mergePasses(b.passes)
	for i := range rows {
		rows[i].setFloor(b.CopyBW, b.GemmRate)
	}
	return rows
}

// Passes returns the rows of every pass so far, in order.
func (b *MoEBench) Passes() [][]MoERow { return b.passes }

// tokenRun is one token count's device buffers: per set an input, the output
// of the timed forwards and the single-stream reference output.
type tokenRun struct {
	T          int
	x, y, ref  []*gpuctx.Buffer
	refHost    [][]byte
	next       int // the set of the next forward
	bytesTotal int64
	experts    int
}

func (r *tokenRun) free() {
	for _, bs := range [][]*gpuctx.Buffer{r.x, r.y, r.ref} {
		for _, b := range bs {
			b.Free()
		}
	}
}

// newTokenRun allocates and fills the inputs of T tokens (set s from the PCG
// stream (Seed+s, T+1000): set 0 is the input of a one-set bench), runs the
// single-stream reference forward of each set, and records the routing.
func (b *MoEBench) newTokenRun(T int) (_ *tokenRun, err error) {
	dt, H := b.o.Layer.DType, b.o.Config.HiddenSize
	r := &tokenRun{T: T}
	defer func() {
		if err != nil {
			r.free()
		}
	}()
	for s, l := range b.layers {
		host := Encode(RandVec(rand.New(rand.NewPCG(b.o.Seed+uint64(s), uint64(T)+1000)), T*H), dt)
		bufs := make([]*gpuctx.Buffer, 3)
		for i := range bufs {
			if bufs[i], err = b.dev.Alloc(len(host)); err != nil {
				return nil, Fail(fmt.Sprintf("allocating the input and outputs for %d tokens", T), "use fewer --tokens or --sets", err)
			}
		}
		r.x, r.y, r.ref = append(r.x, bufs[0]), append(r.y, bufs[1]), append(r.ref, bufs[2])
		if err := bufs[0].CopyFromHost(host); err != nil {
			return nil, err
		}
		if err := l.ForwardDevice(bufs[0], bufs[2], T, moe.Single, moe.Whole); err != nil {
			return nil, Fail(fmt.Sprintf("the single-stream reference forward of %d tokens", T), "check 'gpuctx info'; try --backend cpu to compare", err)
		}
		if err := b.routing(l, r); err != nil {
			return nil, err
		}
		ref := make([]byte, len(host))
		if err := bufs[2].CopyToHost(ref); err != nil {
			return nil, err
		}
		r.refHost = append(r.refHost, ref)
	}
	return r, nil
}

// routing adds the weight bytes and the distinct experts of l's last forward
// to r.
func (b *MoEBench) routing(l *moe.Layer, r *tokenRun) error {
	idx, _, err := l.LastRouting()
	if err != nil {
		return Fail("reading the routing of the batch", "", err)
	}
	r.bytesTotal += l.WeightBytes(r.T, idx)
	seen := map[int32]bool{}
	for _, e := range idx {
		seen[e] = true
	}
	r.experts += len(seen)
	return nil
}

// warmup is the number of untimed forwards before a timing: Warmup, and with
// several sets at least two per set, so that each layer's first forwards of a
// shape (tile tuning, Auto's choice, the graph capture on the second run) are
// never timed.
func (b *MoEBench) warmup() int {
	if len(b.layers) == 1 {
		return b.o.Warmup
	}
	return max(b.o.Warmup, 2*len(b.layers))
}

// forward runs the next set's forward of r in mode m (part p).
func (b *MoEBench) forward(r *tokenRun, m moe.Mode, p moe.Part) error {
	s := r.next
	r.next = (r.next + 1) % len(b.layers)
	return b.layers[s].ForwardDevice(r.x[s], r.y[s], r.T, m, p)
}

// variant times mode m (part p) for r's token count and returns the median in
// microseconds.
func (b *MoEBench) variant(r *tokenRun, name string, m moe.Mode, p moe.Part) (float64, error) {
	r.next = 0
	sec, err := b.timer.Median(b.warmup(), b.o.Iters, func() error { return b.forward(r, m, p) })
	if err != nil {
		return 0, Fail(fmt.Sprintf("timing %s for %d tokens", name, r.T), "check 'gpuctx info'; try --backend cpu to compare", err)
	}
	b.o.Progress.Step(fmt.Sprintf("%sT=%d %s", b.prefix, r.T, name))
	return sec * 1e6, nil
}

// tokens measures T tokens: every mode (its output checked), then the
// shared expert and the routed experts alone; trace: one traced forward per
// mode (first pass only).
func (b *MoEBench) tokens(T int, first bool) (MoERow, error) {
	row := MoERow{Tokens: T, MedianUS: map[string]float64{}, CheckRelErr: map[string]float64{}, FLOPs: BatchFLOPs(b.o.Config, T)}
	r, err := b.newTokenRun(T)
	if err != nil {
		return row, err
	}
	defer r.free()
	n := len(b.layers)
	row.WeightBytes, row.ActiveExperts = r.bytesTotal/int64(n), float64(r.experts)/float64(n)
	b.o.Progress.Step(fmt.Sprintf("%sT=%d reference", b.prefix, T))
	for _, m := range b.o.Modes {
		us, err := b.variant(r, m.String(), m, moe.Whole)
		if err != nil {
			return row, err
		}
		row.MedianUS[m.String()] = us
		if row.CheckRelErr[m.String()], err = b.check(r, m); err != nil {
			return row, err
		}
	}
	if first && b.o.Tracer != nil {
		if err := b.trace(r); err != nil {
			return row, err
		}
	}
	if b.o.Config.SharedIntermediate > 0 {
		us, err := b.variant(r, "shared alone", moe.Single, moe.SharedOnly)
		if err != nil {
			return row, err
		}
		row.SharedUS = &us
	}
	if row.RoutedUS, err = b.variant(r, "routed alone", moe.Single, moe.RoutedOnly); err != nil {
		return row, err
	}
	row.derive()
	return row, nil
}

// check compares the output each set's layer last wrote in mode m (its last
// timed forward: warm-up and timed forwards together reach every set) with the
// set's single-stream reference, and fails when they differ by more than
// CheckTol (relative, Frobenius), or when either is not finite.
func (b *MoEBench) check(r *tokenRun, m moe.Mode) (float64, error) {
	if err := b.main.Synchronize(); err != nil {
		return 0, err
	}
	worst := 0.0
	got := make([]byte, len(r.refHost[0]))
	for s := range b.layers {
		if err := r.y[s].CopyToHost(got); err != nil {
			return 0, Fail("reading the timed output back", "", err)
		}
		e := RelDiff(got, r.refHost[s], b.o.Layer.DType)
		if !(e <= b.o.CheckTol) {
			return e, Fail(fmt.Sprintf("output check: the %s forward of %d tokens (weight set %d) differs from the single-stream forward by %.3g (relative, Frobenius) > %.3g",
				m, r.T, s, e, b.o.CheckTol), "this is a bug in the layer: report it with the command line", nil)
		}
		worst = max(worst, e)
	}
	return worst, nil
}

// trace runs one traced forward per mode on set 0.
func (b *MoEBench) trace(r *tokenRun) error {
	for _, m := range b.o.Modes {
		err := b.o.Tracer.Forward(fmt.Sprintf("moe forward T=%d %s", r.T, m), b.main, func() error {
			return b.layers[0].ForwardDevice(r.x[0], r.y[0], r.T, m, moe.Whole)
		})
		if err != nil {
			return Fail(fmt.Sprintf("the traced %s forward for %d tokens", m, r.T), "", err)
		}
	}
	return nil
}

// RelDiff returns ||got - want|| / ||want|| (Frobenius) of two arrays of dtype
// t; +Inf when either holds a NaN or an Inf or want is all zeros.
func RelDiff(got, want []byte, t gpuctx.DType) float64 {
	var d2, w2 float64
	for i := range len(want) / t.Size() {
		g, w := Decode(got, i, t), Decode(want, i, t)
		d2 += (g - w) * (g - w)
		w2 += w * w
	}
	if math.IsNaN(d2) || math.IsInf(d2, 0) || math.IsNaN(w2) || math.IsInf(w2, 0) || w2 == 0 {
		return math.Inf(1)
	}
	return math.Sqrt(d2 / w2)
}

package bench

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/gpuctx/gpuctx"
)

// GemmOptions configures NewGemmBench: C = A·B (row-major, M×K times K×N) in
// DType through Contexts with Policy, on Streams streams (a Context view
// each), Sets operand sets per stream rotated between GEMMs (0: enough to
// exceed 256 MiB, at most 8), Warmup untimed GEMMs per stream, then Repeats
// timed rounds of Iters GEMMs per stream; Check compares sampled entries of
// C with a float64 host reference.
type GemmOptions struct {
	M, N, K                               int
	DType                                 gpuctx.DType
	Flavour                               gpuctx.Flavour
	Lt                                    bool // cuBLASLt (Context.BlasLt) instead of cuBLAS
	Policy                                gpuctx.HandlePolicy
	Streams, Iters, Warmup, Repeats, Sets int
	Check                                 bool
	Progress                              Progress
}

// GemmResult is what a GEMM bench measured.
type GemmResult struct {
	TFLOPS    float64   // all streams together
	PerStream []float64 // TFLOP/s of each stream
	MedianUS  float64   // per GEMM on each stream
	MaxRelErr float64   // of the sampled entries (Check)
	Checked   int       // entries checked
}

// gemmSet is one stream's operands of one GEMM, with the host copies the
// check reads.
type gemmSet struct {
	a, b, c   *gpuctx.Buffer
	hostA, hB []byte
}

// GemmBench holds the streams, Context views and operands of a GEMM bench.
type GemmBench struct {
	dev     *gpuctx.Device
	o       GemmOptions
	r       *rand.Rand
	root    *gpuctx.Context
	streams []*gpuctx.Stream
	views   []*gpuctx.Context
	data    [][]gemmSet
}

// NewGemmBench creates the Context, the streams and their random operands;
// Close it.
func NewGemmBench(dev *gpuctx.Device, o GemmOptions) (_ *GemmBench, err error) {
	if o.Progress == nil {
		o.Progress = noProgress{}
	}
	g := &GemmBench{dev: dev, o: o, r: rand.New(rand.NewPCG(42, uint64(o.M*31+o.N*7+o.K)))}
	defer func() {
		if err != nil {
			g.Close()
		}
	}()
	if g.root, err = dev.NewContext(gpuctx.ContextOptions{Policy: o.Policy, AllowTF32: true}); err != nil {
		return nil, Fail("creating a Context", "", err)
	}
	es := o.DType.Size()
	aBytes, bBytes, cBytes := o.M*o.K*es, o.K*o.N*es, o.M*o.N*es
	if g.o.Sets == 0 {
		g.o.Sets = max(1, min(8, (256<<20)/(aBytes+bBytes+cBytes)+1))
	}
	for range o.Streams {
		if err := g.addStream(aBytes, bBytes, cBytes); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// addStream adds a stream, its Context view and its operand sets.
func (g *GemmBench) addStream(aBytes, bBytes, cBytes int) error {
	st, err := g.dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return Fail("creating a stream", "", err)
	}
	g.streams = append(g.streams, st)
	view, err := g.root.WithStream(st)
	if err != nil {
		return err
	}
	g.views = append(g.views, view)
	var sets []gemmSet
	defer func() { g.data = append(g.data, sets) }()
	for range g.o.Sets {
		var s gemmSet
		s.hostA = Encode(RandVec(g.r, g.o.M*g.o.K), g.o.DType)
		s.hB = Encode(RandVec(g.r, g.o.K*g.o.N), g.o.DType)
		if s.a, err = g.alloc(aBytes, s.hostA); err == nil {
			if s.b, err = g.alloc(bBytes, s.hB); err == nil {
				s.c, err = g.alloc(cBytes, nil)
			}
		}
		sets = append(sets, s)
		if err != nil {
			return err
		}
	}
	return nil
}

// alloc allocates n bytes and copies host into them (when not nil).
func (g *GemmBench) alloc(n int, host []byte) (*gpuctx.Buffer, error) {
	b, err := g.dev.Alloc(n)
	if err != nil {
		return nil, Fail(fmt.Sprintf("allocating %d MiB for operands", n>>20), "use smaller --m/--n/--k, fewer --streams or --sets", err)
	}
	if host != nil {
		if err := b.CopyFromHost(host); err != nil {
			b.Free()
			return nil, err
		}
	}
	return b, nil
}

// Close frees the operands and closes the views, the streams and the Context.
func (g *GemmBench) Close() {
	for _, sets := range g.data {
		for _, s := range sets {
			for _, b := range []*gpuctx.Buffer{s.a, s.b, s.c} {
				if b != nil {
					b.Free()
				}
			}
		}
	}
	for _, st := range g.streams {
		st.Close()
	}
	if g.root != nil {
		g.root.Close()
	}
}

// Streams returns the bench's streams, in order.
func (g *GemmBench) Streams() []*gpuctx.Stream { return g.streams }

// Sets returns the operand sets per stream.
func (g *GemmBench) Sets() int { return g.o.Sets }

// issue queues count GEMMs on stream s, rotating over its operand sets.
func (g *GemmBench) issue(s, count int) error {
	o := g.o
	for i := range count {
		d := g.data[s][i%len(g.data[s])]
		gm := gpuctx.Gemm{M: o.M, N: o.N, K: o.K, Alpha: 1, A: d.a, B: d.b, C: d.c, AB: o.DType, CType: o.DType}
		var err error
		if o.Lt {
			err = g.views[s].BlasLt(func(lt gpuctx.BlasLt) error { return lt.Matmul(gm) })
		} else {
			err = g.views[s].BlasFlavour(o.Flavour, func(h gpuctx.Blas) error { return h.Gemm(gm) })
		}
		if err != nil {
			return Fail("GEMM failed", "", err)
		}
	}
	return nil
}

// Round runs one round of Iters GEMMs per stream, each stream from its own
// goroutine, and returns the device time of all and of each stream in seconds.
func (g *GemmBench) Round() (float64, []float64, error) {
	return TimeRound(g.dev, g.streams, func(s int) error { return g.issue(s, g.o.Iters) })
}

// GemmSteps is the number of Progress steps of Run.
func GemmSteps(o GemmOptions) int {
	n := 1 + o.Repeats
	if o.Check {
		n++
	}
	return n
}

// Run warms up every stream, times Repeats rounds and, with Check, checks
// sampled entries of C.
func (g *GemmBench) Run() (GemmResult, error) {
	o := g.o
	for s := range o.Streams {
		if err := g.issue(s, o.Warmup); err != nil {
			return GemmResult{}, err
		}
	}
	if err := g.dev.Synchronize(); err != nil {
		return GemmResult{}, Fail("warm-up", "", err)
	}
	o.Progress.Step("warm-up")
	var totals []float64
	per := make([][]float64, o.Streams)
	for i := range o.Repeats {
		all, each, err := g.Round()
		if err != nil {
			return GemmResult{}, err
		}
		totals = append(totals, all)
		for s := range each {
			per[s] = append(per[s], each[s])
		}
		o.Progress.Step(fmt.Sprintf("timed round %d of %d", i+1, o.Repeats))
	}
	flop := 2 * float64(o.M) * float64(o.N) * float64(o.K) * float64(o.Iters)
	med := Median(totals)
	res := GemmResult{TFLOPS: flop * float64(o.Streams) / med / 1e12, MedianUS: med / float64(o.Iters) * 1e6}
	for s := range per {
		res.PerStream = append(res.PerStream, flop/Median(per[s])/1e12)
	}
	if o.Check {
		var err error
		if res.MaxRelErr, res.Checked, err = g.check(); err != nil {
			return res, err
		}
		o.Progress.Step("checked")
	}
	return res, nil
}

// check compares 8 sampled entries of every stream's last-written C sets
// with float64 dot products of the host operands (as stored on the device).
func (g *GemmBench) check() (float64, int, error) {
	o := g.o
	var worst float64
	checked := 0
	for s := range g.data {
		// Sets 0..written-1 were the operands of at least one GEMM.
		written := min(len(g.data[s]), max(o.Warmup, o.Iters))
		for _, d := range g.data[s][:written] {
			hc := make([]byte, d.c.Size())
			if err := d.c.CopyToHost(hc); err != nil {
				return 0, 0, Fail("reading C back", "", err)
			}
			for range 8 {
				worst = max(worst, g.entryErr(d, hc, g.r.IntN(o.M), g.r.IntN(o.N)))
				checked++
			}
		}
	}
	return worst, checked, nil
}

// entryErr is the error of C[i,j] relative to the sum of |terms| (the dot
// product's condition); +Inf for a NaN.
func (g *GemmBench) entryErr(d gemmSet, hc []byte, i, j int) float64 {
	o, t := g.o, g.o.DType
	var want, scale float64
	for p := range o.K {
		x := Decode(d.hostA, i*o.K+p, t) * Decode(d.hB, p*o.N+j, t)
		want += x
		scale += math.Abs(x)
	}
	got := Decode(hc, i*o.N+j, t)
	if math.IsNaN(got) {
		return math.Inf(1)
	}
	return math.Abs(got-want) / max(scale, 1e-30)
}

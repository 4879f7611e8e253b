// Package benchkit holds what gpuctx's benchmarks (moe bench, gemm) share:
// timing on the device with events (warm-up, then the median of timed runs),
// the two ceilings measured in the same run (device-to-device copy bandwidth
// and a large GEMM through a Context), the floor model of an MoE layer, and
// host-side helpers for random operands.
package benchkit

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/moe"
)

// Error is a failure with the advice to print after it (the CLI prints it as
// "what: cause: fix").
type Error struct {
	What, Fix string
	Err       error
}

func (e *Error) Error() string {
	s := e.What
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	if e.Fix != "" {
		s += ": " + e.Fix
	}
	return s
}

func (e *Error) Unwrap() error { return e.Err }

// Fail returns an *Error.
func Fail(what, fix string, err error) error { return &Error{What: what, Fix: fix, Err: err} }

// Timer times work queued on one stream with a pair of timing events.
type Timer struct {
	s          *gpuctx.Stream
	start, end *gpuctx.Event
}

// NewTimer returns a Timer on stream s of dev; Close it.
func NewTimer(dev *gpuctx.Device, s *gpuctx.Stream) (*Timer, error) {
	st, err := dev.NewEvent(true)
	if err != nil {
		return nil, err
	}
	en, err := dev.NewEvent(true)
	if err != nil {
		st.Close()
		return nil, err
	}
	return &Timer{s: s, start: st, end: en}, nil
}

// Close releases the events.
func (t *Timer) Close() { t.start.Close(); t.end.Close() }

// Median runs work warmup times untimed, then iters times between two events on
// t.s, and returns the median device time in seconds.
func (t *Timer) Median(warmup, iters int, work func() error) (float64, error) {
	for range warmup {
		if err := work(); err != nil {
			return 0, err
		}
	}
	if err := t.s.Synchronize(); err != nil {
		return 0, err
	}
	times := make([]float64, 0, iters)
	for range iters {
		if err := t.start.Record(t.s); err != nil {
			return 0, err
		}
		if err := work(); err != nil {
			return 0, err
		}
		if err := t.end.Record(t.s); err != nil {
			return 0, err
		}
		if err := t.end.Synchronize(); err != nil {
			return 0, err
		}
		d, err := t.end.Elapsed(t.start)
		if err != nil {
			return 0, err
		}
		times = append(times, max(d.Seconds(), 1e-9))
	}
	return Median(times), nil
}

// CopyBandwidth returns the device-to-device copy bandwidth in bytes (read +
// written) per second for an n-byte copy on a new stream.
func CopyBandwidth(dev *gpuctx.Device, n, iters int) (float64, error) {
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return 0, err
	}
	defer s.Close()
	src, err := dev.Alloc(n)
	if err != nil {
		return 0, Fail(fmt.Sprintf("allocating %d MiB for the copy ceiling", n>>20), "free device memory", err)
	}
	defer src.Free()
	dst, err := dev.Alloc(n)
	if err != nil {
		return 0, Fail(fmt.Sprintf("allocating %d MiB for the copy ceiling", n>>20), "free device memory", err)
	}
	defer dst.Free()
	if err := s.Memset(src, 0x5a); err != nil {
		return 0, err
	}
	t, err := NewTimer(dev, s)
	if err != nil {
		return 0, err
	}
	defer t.Close()
	sec, err := t.Median(2, iters, func() error { return s.CopyDtoD(dst, 0, src, 0, n) })
	if err != nil {
		return 0, Fail("timing the device-to-device copy", "", err)
	}
	return 2 * float64(n) / sec, nil
}

// GemmRate returns the rate in FLOP/s of an n³ GEMM in dt (output in dt, f32
// compute; bf16 through the TensorOp flavour, f32 through Default, as the layer
// uses them) through a Context on a new stream, perRound GEMMs per timed round.
func GemmRate(dev *gpuctx.Device, n int, dt gpuctx.DType, perRound, iters int) (float64, error) {
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return 0, err
	}
	defer s.Close()
	ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s})
	if err != nil {
		return 0, err
	}
	defer ctx.Close()
	bytes := n * n * dt.Size()
	// Random operands: a block of 2^19 random values tiled over the matrix.
	r := rand.New(rand.NewPCG(7, uint64(n)))
	block := Encode(RandVec(r, min(n*n, 1<<19)), dt)
	host := make([]byte, bytes)
	for off := 0; off < bytes; off += len(block) {
		copy(host[off:], block)
	}
	var bufs [3]*gpuctx.Buffer
	for i := range bufs {
		if bufs[i], err = dev.Alloc(bytes); err != nil {
			return 0, Fail(fmt.Sprintf("allocating %d MiB for the GEMM ceiling", bytes>>20), "free device memory", err)
		}
		defer bufs[i].Free()
		if i < 2 {
			if err := bufs[i].CopyFromHost(host); err != nil {
				return 0, err
			}
		}
	}
	g := gpuctx.Gemm{M: n, N: n, K: n, Alpha: 1, A: bufs[0], B: bufs[1], C: bufs[2], AB: dt, CType: dt}
	flavour := gpuctx.Default
	if dt == gpuctx.BF16 {
		flavour = gpuctx.TensorOp
	}
	t, err := NewTimer(dev, s)
	if err != nil {
		return 0, err
	}
	defer t.Close()
	sec, err := t.Median(1, iters, func() error {
		for range perRound {
			if err := ctx.BlasFlavour(flavour, func(h gpuctx.Blas) error { return h.Gemm(g) }); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return 0, Fail(fmt.Sprintf("timing the %s GEMM ceiling", dt), fmt.Sprintf("check 'gpuctx gemm --dtype %s'", dt), err)
	}
	return 2 * float64(n) * float64(n) * float64(n) * float64(perRound) / sec, nil
}

// Encode returns x in dtype t as little-endian bytes.
func Encode(x []float32, t gpuctx.DType) []byte {
	out := make([]byte, len(x)*t.Size())
	for i, v := range x {
		switch t {
		case gpuctx.F32:
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		case gpuctx.F64:
			binary.LittleEndian.PutUint64(out[8*i:], math.Float64bits(float64(v)))
		case gpuctx.BF16:
			binary.LittleEndian.PutUint16(out[2*i:], half.BF16(v))
		case gpuctx.F16:
			binary.LittleEndian.PutUint16(out[2*i:], half.F16(v))
		}
	}
	return out
}

// Decode reads element i of b in dtype t.
func Decode(b []byte, i int, t gpuctx.DType) float64 {
	switch t {
	case gpuctx.F32:
		return float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	case gpuctx.F64:
		return math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
	case gpuctx.BF16:
		return float64(half.FromBF16(binary.LittleEndian.Uint16(b[2*i:])))
	case gpuctx.F16:
		return float64(half.FromF16(binary.LittleEndian.Uint16(b[2*i:])))
	}
	return math.NaN()
}

// TimeRound forks all streams from one start event, runs work(s) on each from
// its own goroutine, and returns the device time from the start to the last
// stream's end, and each stream's own time, in seconds.
func TimeRound(dev *gpuctx.Device, streams []*gpuctx.Stream, work func(s int) error) (float64, []float64, error) {
	mk := func() (*gpuctx.Event, error) { return dev.NewEvent(true) }
	start, err := mk()
	if err != nil {
		return 0, nil, err
	}
	defer start.Close()
	if err := start.Record(streams[0]); err != nil {
		return 0, nil, err
	}
	begins, ends := make([]*gpuctx.Event, len(streams)), make([]*gpuctx.Event, len(streams))
	for s, st := range streams {
		if begins[s], err = mk(); err != nil {
			return 0, nil, err
		}
		defer begins[s].Close()
		if ends[s], err = mk(); err != nil {
			return 0, nil, err
		}
		defer ends[s].Close()
		if err := st.Wait(start); err != nil {
			return 0, nil, err
		}
		if err := begins[s].Record(st); err != nil {
			return 0, nil, err
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, len(streams))
	for s := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[s] = work(s); errs[s] == nil {
				errs[s] = ends[s].Record(streams[s])
			}
		}()
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return 0, nil, e
		}
	}
	var all float64
	each := make([]float64, len(streams))
	for s := range streams {
		if err := ends[s].Synchronize(); err != nil {
			return 0, nil, err
		}
		d, err := ends[s].Elapsed(start)
		if err != nil {
			return 0, nil, err
		}
		all = max(all, d.Seconds())
		own, err := ends[s].Elapsed(begins[s])
		if err != nil {
			return 0, nil, err
		}
		each[s] = max(own.Seconds(), float64(time.Nanosecond)/1e9)
	}
	return all, each, nil
}

// RandVec returns n standard normal values.
func RandVec(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return x
}

// Median returns the upper median of x (NaN for none).
func Median(x []float64) float64 {
	y := slices.Clone(x)
	slices.Sort(y)
	if len(y) == 0 {
		return math.NaN()
	}
	return y[len(y)/2]
}

// BatchFLOPs is the arithmetic of one forward of T tokens through the layer c:
// 2·T·H·E (router) + 2·T·K·3·H·I (routed) + 2·T·3·H·Is (shared).
func BatchFLOPs(c *moe.Config, T int) float64 {
	t, H, E, K, I, S := float64(T), float64(c.HiddenSize), float64(c.NumExperts), float64(c.TopK), float64(c.Intermediate), float64(c.SharedIntermediate)
	return 2*t*H*E + 2*t*K*3*H*I + 2*t*3*H*S
}

// Floor is the floor model of one forward: the larger of the time to read the
// weights it touches at the copy bandwidth and the time of its FLOPs at the
// GEMM rate.
type Floor struct {
	BytesUS, ComputeUS, US float64
	Bound                  string // "bytes" or "compute"
}

// NewFloor returns the floor of a forward touching weightBytes and doing
// flops, with the ceilings copyBW (bytes read + written per second) and
// gemmRate (FLOP/s).
func NewFloor(weightBytes int64, flops, copyBW, gemmRate float64) Floor {
	f := Floor{BytesUS: float64(weightBytes) / copyBW * 1e6, ComputeUS: flops / gemmRate * 1e6}
	f.US, f.Bound = f.BytesUS, "bytes"
	if f.ComputeUS > f.BytesUS {
		f.US, f.Bound = f.ComputeUS, "compute"
	}
	return f
}

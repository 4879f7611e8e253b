package bench

import (
	"math"
	"slices"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuctx/gpuctx"
)

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
	var g errgroup.Group
	for s := range streams {
		g.Go(func() error {
			if err := work(s); err != nil {
				return err
			}
			return ends[s].Record(streams[s])
		})
	}
	if err := g.Wait(); err != nil {
		return 0, nil, err
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

// Median returns the upper median of x (NaN for none).
func Median(x []float64) float64 {
	y := slices.Clone(x)
	slices.Sort(y)
	if len(y) == 0 {
		return math.NaN()
	}
	return y[len(y)/2]
}

package gpuctx

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Graph is work recorded from streams by BeginCapture/EndCapture (a CUDA graph
// on the CUDA backend) that can be launched many times with one call. Launching
// it costs one launch instead of one per recorded operation, which is what
// matters for small, latency-bound work. Its operations keep the buffers,
// kernels and arguments they were recorded with: the buffers must stay
// allocated, and their contents are read when the graph runs.
//
// BLAS calls recorded through a Context during the capture use workspaces that
// the Graph owns (one per stream of the capture, allocated during the capture
// and freed by Graph.Close), never a stream's own workspace. So the graph may be
// launched on any stream of its device, while any other BLAS work runs, and the
// capture's streams may be closed once EndCapture has returned.
//
// Launches of one graph are ordered: a launch waits (on the device, not the
// host) for the graph's previous launch to complete, whichever stream that was
// on, so two launches never run at once and never share the graph's workspaces.
type Graph struct {
	dev *Device
	g   hal.Graph
	ws  []*workspace // BLAS workspaces of the capture, freed at Close

	mu     sync.Mutex // held across a launch, so that launches are ordered
	closed bool
	last   hal.Event // recorded after the latest launch (nil: never launched)
	lastS  *Stream   // the stream of the latest launch
}

// capture is one capture begun with Stream.BeginCapture: its origin stream and
// the BLAS workspaces that calls recorded on each of its streams use (the
// streams of one capture run concurrently in the graph, so each has its own).
// Guarded by the device's blasState.mu.
type capture struct {
	origin *Stream
	ws     map[*Stream]*workspace // cuBLAS workspace per stream of the capture
	lt     map[*Stream]*workspace // cuBLASLt workspace per stream (grow-only)
	all    []*workspace           // every workspace allocated for it, grown-out ones included
}

// workspace returns the capture's cuBLAS workspace for s (bs.mu held).
func (c *capture) workspace(bs *blasState, s *Stream) (*workspace, error) {
	if w := c.ws[s]; w != nil {
		return w, nil
	}
	w, err := bs.alloc(bs.wsSize, "BLAS (graph capture)", s)
	if err != nil {
		return nil, err
	}
	c.ws[s] = w
	c.all = append(c.all, w)
	return w, nil
}

// ltWorkspace returns the capture's cuBLASLt workspace for s, at least n bytes
// (bs.mu held). A grown-out one stays with the graph: recorded nodes use it.
func (c *capture) ltWorkspace(bs *blasState, s *Stream, n int) (*workspace, error) {
	if w := c.lt[s]; w != nil && w.size >= n {
		return w, nil
	}
	w, err := bs.alloc(max(n, bs.wsSize), "cuBLASLt (graph capture)", s)
	if err != nil {
		return nil, err
	}
	c.lt[s] = w
	c.all = append(c.all, w)
	return w, nil
}

// takeAll hands over the capture's workspaces (bs.mu held); later calls get none.
func (c *capture) takeAll(*blasState) []*workspace {
	all := c.all
	c.all, c.ws, c.lt = nil, map[*Stream]*workspace{}, map[*Stream]*workspace{}
	return all
}

// noteRecord tracks events recorded on a stream of a capture: a stream that
// waits on one joins the capture (as in CUDA), and its BLAS calls then use the
// capture's workspaces too.
func (d *Device) noteRecord(e *Event, s *Stream) {
	bs := &d.blas
	if bs.ncapt.Load() == 0 {
		return
	}
	bs.mu.Lock()
	if c := bs.capt[s]; c != nil {
		bs.evCapt[e] = c
	} else {
		delete(bs.evCapt, e)
	}
	bs.mu.Unlock()
}

// noteWait makes s join the capture e was recorded in, if any.
func (d *Device) noteWait(s *Stream, e *Event) {
	bs := &d.blas
	if bs.ncapt.Load() == 0 {
		return
	}
	bs.mu.Lock()
	if c := bs.evCapt[e]; c != nil && bs.capt[s] == nil {
		bs.capt[s] = c
		bs.epoch.Add(1)
	}
	bs.mu.Unlock()
}

// endCapture removes c's streams and events from the tracking and returns its
// workspaces.
func (bs *blasState) endCapture(c *capture) []*workspace {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	for s, sc := range bs.capt {
		if sc == c {
			delete(bs.capt, s)
		}
	}
	for e, ec := range bs.evCapt {
		if ec == c {
			delete(bs.evCapt, e)
		}
	}
	bs.ncapt.Add(-1)
	bs.epoch.Add(1)
	return c.takeAll(bs)
}

// BeginCapture starts recording the work queued on s into a graph instead of
// running it. Until EndCapture, work queued on s is recorded; a stream that waits
// on an event recorded on s during the capture joins it and must be joined back
// (s waits on an event recorded on it) before EndCapture. While capturing,
// nothing may wait for s from the host (Synchronize, Query, host waits on events
// recorded during the capture): the backend reports an error. BLAS callbacks on
// s and on joined streams use the capture's own workspaces (see Graph). It
// queues nothing and waits for nothing.
func (s *Stream) BeginCapture() error {
	const op = "Stream.BeginCapture"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	hc, ok := s.hs.(hal.Capturer)
	if !ok {
		return fmt.Errorf("gpuctx: %s: the %s backend cannot capture streams: %w", op, s.dev.Backend(), ErrUnavailable)
	}
	bs := &s.dev.blas
	c := &capture{origin: s, ws: map[*Stream]*workspace{}, lt: map[*Stream]*workspace{}}
	bs.mu.Lock()
	if bs.capt[s] != nil {
		bs.mu.Unlock()
		return fmt.Errorf("gpuctx: %s: stream %d is already in a capture: %w", op, s.ID(), ErrInvalid)
	}
	bs.capt[s] = c
	bs.ncapt.Add(1)
	bs.epoch.Add(1) // handles bound to s leave the fast path: they re-check the workspace
	bs.mu.Unlock()
	if err := hc.BeginCapture(); err != nil {
		for _, w := range bs.endCapture(c) {
			_ = w.free(s.dev)
		}
		return err
	}
	return nil
}

// EndCapture ends the capture begun on s and returns the recorded work as a
// Graph. Nothing recorded has run.
func (s *Stream) EndCapture() (*Graph, error) {
	const op = "Stream.EndCapture"
	unlock, err := s.use(op)
	if err != nil {
		return nil, err
	}
	defer unlock()
	hc, ok := s.hs.(hal.Capturer)
	if !ok {
		return nil, fmt.Errorf("gpuctx: %s: the %s backend cannot capture streams: %w", op, s.dev.Backend(), ErrUnavailable)
	}
	bs := &s.dev.blas
	bs.mu.Lock()
	c := bs.capt[s]
	if c != nil && c.origin != s {
		c = nil // s joined a capture begun on another stream: the backend refuses
	}
	bs.mu.Unlock()
	g, err := hc.EndCapture()
	var ws []*workspace
	if c != nil {
		ws = bs.endCapture(c)
	}
	if err != nil {
		for _, w := range ws { // nothing recorded can run
			_ = w.free(s.dev)
		}
		return nil, fmt.Errorf("gpuctx: %s: %w", op, err)
	}
	gr := &Graph{dev: s.dev, g: g, ws: ws}
	s.dev.mu.Lock()
	s.dev.graphs[gr] = struct{}{}
	s.dev.mu.Unlock()
	return gr, nil
}

// Launch queues the whole graph on s, any stream of the graph's device: it
// starts after the work queued on s so far and after the graph's previous launch
// (on whatever stream) has completed, and work queued on s later waits for all
// of it. It does not block the host.
func (g *Graph) Launch(s *Stream) error {
	const op = "Graph.Launch"
	if g == nil {
		return fmt.Errorf("gpuctx: %s: nil graph: %w", op, ErrInvalid)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return fmt.Errorf("gpuctx: %s: graph: %w", op, ErrClosed)
	}
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if s.dev != g.dev {
		return fmt.Errorf("gpuctx: %s: graph of device %d on a stream of device %d: %w", op, g.dev.info.Index, s.dev.info.Index, ErrWrongDevice)
	}
	if g.last == nil {
		ev, err := g.dev.hd.NewEvent(false)
		if err != nil {
			return fmt.Errorf("gpuctx: %s: %w", op, err)
		}
		g.last = ev
	} else if g.lastS != s {
		// Order this launch after the previous one, which ran on another stream.
		if err := s.hs.Wait(g.last); err != nil {
			return fmt.Errorf("gpuctx: %s: waiting for the previous launch: %w", op, err)
		}
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.begin(s, g.traceName(), "graph", map[string]any{
			"note": "a graph replay runs its kernels without the host: traced as one span; run eagerly to see them"})()
	}
	if err := g.g.Launch(s.hs); err != nil {
		return err
	}
	if err := g.last.Record(s.hs); err != nil {
		return fmt.Errorf("gpuctx: %s: recording the launch: %w", op, err)
	}
	g.lastS = s
	return nil
}

// Close waits on the host for the graph's launches to complete, then releases
// the graph and its BLAS workspaces. Double Close is harmless.
func (g *Graph) Close() error {
	if g == nil {
		return fmt.Errorf("gpuctx: Graph.Close: nil graph: %w", ErrInvalid)
	}
	g.dev.mu.Lock()
	delete(g.dev.graphs, g)
	g.dev.mu.Unlock()
	return g.destroy()
}

func (g *Graph) destroy() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	var errs []error
	if g.last != nil {
		errs = append(errs, g.last.Synchronize(), g.last.Destroy())
	}
	errs = append(errs, g.g.Destroy())
	for _, w := range g.ws {
		errs = append(errs, w.free(g.dev))
	}
	g.ws = nil
	return errors.Join(errs...)
}

// traceName is the graph's span name in a trace: "graph (N nodes)", or
// "graph" when the backend cannot count its nodes.
func (g *Graph) traceName() string {
	if c, ok := g.g.(interface{ NodeCount() int }); ok && c.NodeCount() >= 0 {
		return fmt.Sprintf("graph (%d nodes)", c.NodeCount())
	}
	return "graph"
}

package gpuctx

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/internal/handlepool"
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
	ws  []*handlepool.Workspace // BLAS workspaces of the capture, freed at Close

	mu     sync.Mutex // held across a launch, so that launches are ordered
	closed bool
	last   hal.Event // recorded after the latest launch (nil: never launched)
	lastS  *Stream   // the stream of the latest launch
}

// noteRecord tracks events recorded on a stream of a capture: a stream that
// waits on one joins the capture (as in CUDA), and its BLAS calls then use the
// capture's workspaces too.
func (d *Device) noteRecord(e *Event, s *Stream) { d.blas.spaces.NoteRecord(e, s) }

// noteWait makes s join the capture e was recorded in, if any.
func (d *Device) noteWait(s *Stream, e *Event) { d.blas.spaces.NoteWait(s, e) }

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
	ws := &s.dev.blas.spaces
	// Handles bound to s leave the bind fast path: they re-check the workspace.
	if !ws.BeginCapture(s) {
		return fmt.Errorf("gpuctx: %s: stream %d is already in a capture: %w", op, s.ID(), ErrInvalid)
	}
	if err := hc.BeginCapture(); err != nil {
		_ = ws.Release(ws.EndCapture(s))
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
	g, err := hc.EndCapture()
	// nil when s joined a capture begun on another stream (the backend refuses).
	ws := s.dev.blas.spaces.EndCapture(s)
	if err != nil {
		_ = s.dev.blas.spaces.Release(ws) // nothing recorded can run
		return nil, fmt.Errorf("gpuctx: %s: %w", op, err)
	}
	gr := &Graph{dev: s.dev, g: g, ws: ws}
	s.dev.mu.Lock()
	s.dev.graphs[gr] = struct{}{}
	s.dev.mu.Unlock()
	return gr, nil
}

// Capture records the work fn queues on s (and on streams that join the
// capture, see BeginCapture) into a Graph: BeginCapture, fn, EndCapture. The
// capture is always ended: if fn fails, the recorded graph is closed and fn's
// error returned; otherwise the error is BeginCapture's or EndCapture's, as
// they return it (errors.Is(err, ErrUnavailable) when the backend cannot
// capture). Capture runs fn on the calling goroutine, queues nothing itself
// and waits for nothing; nothing recorded has run when it returns. Inside fn
// the rules between BeginCapture and EndCapture hold (no host waits on s).
func (s *Stream) Capture(fn func() error) (*Graph, error) {
	if err := s.BeginCapture(); err != nil {
		return nil, err
	}
	ferr := fn()
	g, err := s.EndCapture()
	if ferr != nil {
		if g != nil {
			_ = g.Close()
		}
		return nil, ferr
	}
	if err != nil {
		return nil, err
	}
	return g, nil
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
	errs = append(errs, g.dev.blas.spaces.Release(g.ws))
	g.ws = nil
	return errors.Join(errs...)
}

// WorkspaceBytes returns the bytes of device memory the graph's BLAS
// workspaces take (those of its capture, see Graph; 0 when no BLAS call was
// recorded, and once the graph is closed). Safe for concurrent use; it waits
// for a launch in progress on another goroutine to be queued.
func (g *Graph) WorkspaceBytes() int {
	if g == nil {
		return 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return handlepool.LiveBytes(g.ws)
}

// traceName is the graph's span name in a trace: "graph (N nodes)", or
// "graph" when the backend cannot count its nodes.
func (g *Graph) traceName() string {
	if c, ok := g.g.(interface{ NodeCount() int }); ok && c.NodeCount() >= 0 {
		return fmt.Sprintf("graph (%d nodes)", c.NodeCount())
	}
	return "graph"
}

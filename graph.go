package gpuctx

import (
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Graph is work recorded from streams by BeginCapture/EndCapture (a CUDA graph
// on the CUDA backend) that can be launched many times with one call. Launching
// it costs one launch instead of one per recorded operation, which is what
// matters for small, latency-bound work. Its operations keep the buffers,
// kernels and arguments they were recorded with: the buffers must stay
// allocated, and their contents are read when the graph runs. BLAS calls
// recorded through a Context use the capturing stream's workspace, so keep the
// streams of a capture open while its graph is used, and launch the graph on the
// stream it was captured from (another stream could run it while the capturing
// stream's own BLAS work uses the same workspace).
type Graph struct {
	dev *Device
	g   hal.Graph

	mu     sync.RWMutex
	closed bool
}

// BeginCapture starts recording the work queued on s into a graph instead of
// running it. Until EndCapture, work queued on s is recorded; a stream that waits
// on an event recorded on s during the capture joins it and must be joined back
// (s waits on an event recorded on it) before EndCapture. While capturing,
// nothing may wait for s from the host (Synchronize, Query, host waits on events
// recorded during the capture): the backend reports an error.
func (s *Stream) BeginCapture() error {
	const op = "Stream.BeginCapture"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	c, ok := s.hs.(hal.Capturer)
	if !ok {
		return fmt.Errorf("gpuctx: %s: the %s backend cannot capture streams: %w", op, s.dev.Backend(), ErrUnavailable)
	}
	return c.BeginCapture()
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
	c, ok := s.hs.(hal.Capturer)
	if !ok {
		return nil, fmt.Errorf("gpuctx: %s: the %s backend cannot capture streams: %w", op, s.dev.Backend(), ErrUnavailable)
	}
	g, err := c.EndCapture()
	if err != nil {
		return nil, fmt.Errorf("gpuctx: %s: %w", op, err)
	}
	gr := &Graph{dev: s.dev, g: g}
	s.dev.mu.Lock()
	s.dev.graphs[gr] = struct{}{}
	s.dev.mu.Unlock()
	return gr, nil
}

// Launch queues the whole graph on s: it starts after the work queued on s so
// far, and work queued on s later waits for all of it. It does not block.
func (g *Graph) Launch(s *Stream) error {
	const op = "Graph.Launch"
	if g == nil {
		return fmt.Errorf("%w: gpuctx: %s: nil graph", ErrInvalid, op)
	}
	g.mu.RLock()
	defer g.mu.RUnlock()
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
	return g.g.Launch(s.hs)
}

// Close releases the graph. Launches already queued still run. Double Close is
// harmless.
func (g *Graph) Close() error {
	if g == nil {
		return fmt.Errorf("%w: gpuctx: Graph.Close: nil graph", ErrInvalid)
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
	return g.g.Destroy()
}

package cpu

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// capture is one stream capture in progress: the work queued on the capturing
// stream and on every stream that joined it (by waiting on an event recorded
// during the capture), in the order the host queued it. That order respects
// every dependency of the captured graph (each wait follows its record), so the
// CPU backend replays a graph as that sequence: the same results as CUDA's
// graph, without its concurrency. Unlike CUDA it does not check that every
// joined stream was joined back before EndCapture.
type capture struct {
	origin *stream
	mu     sync.Mutex
	ops    []func() error
	ended  bool
}

func (c *capture) add(fn func() error) {
	c.mu.Lock()
	c.ops = append(c.ops, fn)
	c.mu.Unlock()
}

func (c *capture) isEnded() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ended
}

// BeginCapture starts recording the work queued on s instead of running it.
func (s *stream) BeginCapture() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fmt.Errorf("cpu: BeginCapture: stream %d is destroyed: %w", s.id, hal.ErrClosed)
	}
	if s.capt != nil {
		return fmt.Errorf("cpu: BeginCapture: stream %d is already capturing", s.id)
	}
	s.capt = &capture{origin: s}
	return nil
}

// EndCapture stops the capture begun on s and returns its work as a graph.
// Streams that joined the capture leave it.
func (s *stream) EndCapture() (hal.Graph, error) {
	s.mu.Lock()
	c := s.capt
	if c == nil || c.origin != s {
		s.mu.Unlock()
		return nil, fmt.Errorf("cpu: EndCapture: stream %d did not begin a capture", s.id)
	}
	s.capt = nil
	s.mu.Unlock()
	c.mu.Lock()
	c.ended = true
	ops := c.ops
	c.mu.Unlock()
	s.dev.mu.Lock()
	var joined []*stream
	for _, st := range s.dev.streams {
		joined = append(joined, st)
	}
	s.dev.mu.Unlock()
	for _, st := range joined {
		st.mu.Lock()
		if st.capt == c {
			st.capt = nil
		}
		st.mu.Unlock()
	}
	return &graph{dev: s.dev, ops: ops}, nil
}

// graph replays a capture's work in order.
type graph struct {
	dev       *device
	ops       []func() error
	destroyed atomic.Bool
}

// NodeCount returns the number of operations the capture recorded (gpuctx
// names a traced launch after it).
func (g *graph) NodeCount() int { return len(g.ops) }

// Launch queues the whole graph on s as one item.
func (g *graph) Launch(hs hal.Stream) error {
	s, ok := hs.(*stream)
	if !ok || s.dev != g.dev {
		return fmt.Errorf("cpu: Graph.Launch: the stream must come from the graph's device")
	}
	if g.destroyed.Load() {
		return fmt.Errorf("cpu: Graph.Launch: the graph is destroyed: %w", hal.ErrClosed)
	}
	return s.enqueueFn("Graph.Launch", func() error {
		for i, op := range g.ops {
			if err := runWork(op); err != nil {
				return fmt.Errorf("graph node %d: %w", i, err)
			}
		}
		return nil
	})
}

// Destroy releases the graph. Double Destroy is harmless.
func (g *graph) Destroy() error {
	g.destroyed.Store(true)
	return nil
}

var (
	_ hal.Capturer = (*stream)(nil)
	_ hal.Graph    = (*graph)(nil)
)

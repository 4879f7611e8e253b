package cuda

import (
	"fmt"
	"sync/atomic"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// captureModeRelaxed is CU_STREAM_CAPTURE_MODE_RELAXED: goroutines move
// between OS threads, so the thread-based capture modes (global, thread-local)
// would fault unrelated calls made from a thread that happened to start a
// capture.
const captureModeRelaxed = 2

func (s *stream) graphAPI(call string) error {
	a := s.d.api
	if a.cuStreamBeginCapture == nil || a.cuStreamEndCapture == nil || a.cuGraphInstantiateWithFlags == nil ||
		a.cuGraphLaunch == nil || a.cuGraphExecDestroy == nil || a.cuGraphDestroy == nil {
		return fmt.Errorf("cuda: %s: this driver lacks the stream-capture API (CUDA >= 11.4): %w", call, hal.ErrUnavailable)
	}
	return nil
}

// BeginCapture starts recording the work queued on s into a graph
// (cuStreamBeginCapture_v2, relaxed mode). Until EndCapture, work queued on s
// (and on streams that join by waiting on events recorded during the capture)
// is recorded, not run.
func (s *stream) BeginCapture() error {
	if err := s.graphAPI("BeginCapture"); err != nil {
		return err
	}
	return s.do("BeginCapture", func() error {
		return check(s.d.api, "cuStreamBeginCapture_v2", s.d.api.cuStreamBeginCapture(s.h, captureModeRelaxed))
	})
}

// EndCapture ends the capture (cuStreamEndCapture) and instantiates the graph
// (cuGraphInstantiateWithFlags). The template graph is destroyed at once; the
// executable graph lives until Destroy.
func (s *stream) EndCapture() (hal.Graph, error) {
	if err := s.graphAPI("EndCapture"); err != nil {
		return nil, err
	}
	var exec uintptr
	nodes := -1
	err := s.do("EndCapture", func() error {
		var g uintptr
		if err := check(s.d.api, "cuStreamEndCapture", s.d.api.cuStreamEndCapture(s.h, &g)); err != nil {
			return err
		}
		defer s.d.api.cuGraphDestroy(g)
		var n uintptr
		if s.d.api.cuGraphGetNodes != nil && s.d.api.cuGraphGetNodes(g, nil, &n) == 0 {
			nodes = int(n)
		}
		return check(s.d.api, "cuGraphInstantiateWithFlags", s.d.api.cuGraphInstantiateWithFlags(&exec, g, 0))
	})
	if err != nil {
		return nil, err
	}
	return &graph{d: s.d, exec: exec, nodes: nodes}, nil
}

// graph is an executable CUDA graph (CUgraphExec).
type graph struct {
	d         *device
	exec      uintptr
	nodes     int // -1: unknown
	destroyed atomic.Bool
}

// NodeCount returns the number of nodes in the captured graph, or -1 when the
// driver could not say (gpuctx names a traced launch after it).
func (g *graph) NodeCount() int { return g.nodes }

// Launch queues the graph on s (cuGraphLaunch).
func (g *graph) Launch(hs hal.Stream) error {
	s, ok := hs.(*stream)
	if !ok || s.d != g.d {
		return fmt.Errorf("cuda: Graph.Launch: the stream must come from the graph's device")
	}
	if g.destroyed.Load() {
		return fmt.Errorf("cuda: Graph.Launch: %w", hal.ErrClosed)
	}
	return s.do("Graph.Launch", func() error {
		return check(g.d.api, "cuGraphLaunch", g.d.api.cuGraphLaunch(g.exec, s.h))
	})
}

// Destroy releases the executable graph (cuGraphExecDestroy). Double Destroy
// is harmless.
func (g *graph) Destroy() error {
	if !g.destroyed.CompareAndSwap(false, true) {
		return nil
	}
	return g.d.Do(func() error {
		return check(g.d.api, "cuGraphExecDestroy", g.d.api.cuGraphExecDestroy(g.exec))
	})
}

var (
	_ hal.Capturer = (*stream)(nil)
	_ hal.Graph    = (*graph)(nil)
)

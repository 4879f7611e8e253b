package moe

import (
	"errors"
	"fmt"

	"github.com/gpuctx/gpuctx"
)

// graphCache holds a layer's captured forwards: by key on the layer's staging
// buffers gx and gy, and by (key, x, y) on callers' buffers (direct).
type graphCache struct {
	use        bool                        // capture and replay where possible
	graphs     map[graphKey]*gpuctx.Graph  // captured forwards
	seen       map[graphKey]int            // forwards run per shape (the first is eager)
	gx, gy     *gpuctx.Buffer              // the graphs' staging input and output
	direct     map[directKey]*gpuctx.Graph // graphs captured on callers' x and y
	directSeen map[directKey]bool          // (shape, x, y) run once through staging
}

// maxDirectGraphs bounds the graphs captured on callers' buffers.
const maxDirectGraphs = 8

// directKey identifies a graph captured on the caller's x and y.
type directKey struct {
	graphKey
	x, y *gpuctx.Buffer
}

func newGraphCache(use bool) graphCache {
	return graphCache{use: use, graphs: map[graphKey]*gpuctx.Graph{}, seen: map[graphKey]int{},
		direct: map[directKey]*gpuctx.Graph{}, directSeen: map[directKey]bool{}}
}

// staging grows the staging buffers to n bytes.
func (g *graphCache) staging(e *env, n int) error {
	synced := false
	if err := e.grow(&g.gx, n, &synced); err != nil {
		return err
	}
	return e.grow(&g.gy, n, &synced)
}

// dropDirect closes the graphs captured on callers' buffers.
func (g *graphCache) dropDirect() {
	for k, gr := range g.direct {
		_ = gr.Close()
		delete(g.direct, k)
	}
}

// drop closes every captured graph (their buffers are about to change).
func (g *graphCache) drop() {
	for k, gr := range g.graphs {
		_ = gr.Close()
		delete(g.graphs, k)
	}
	g.dropDirect()
}

// close closes every graph for good, reporting errors to keep.
func (g *graphCache) close(keep func(error)) {
	for _, gr := range g.graphs {
		keep(gr.Close())
	}
	g.graphs = nil
	for _, gr := range g.direct {
		keep(gr.Close())
	}
	g.direct = nil
}

// capture records the forward of p over xv into yv on the main stream as a
// graph (the plan marked capturing: no tuning, no host waits). unavailable
// reports that the backend cannot capture (nothing was queued).
func (l *Layer) capture(p *plan, xv, yv *gpuctx.Buffer) (g *gpuctx.Graph, unavailable bool, err error) {
	cp := *p
	cp.capturing = true
	var qerr error
	g, err = l.main.Capture(func() error {
		qerr = l.enqueue(&cp, xv, yv)
		return qerr
	})
	if err != nil {
		unavailable = qerr == nil && errors.Is(err, gpuctx.ErrUnavailable)
		return nil, unavailable, fmt.Errorf("moe: capturing the forward of %d tokens: %w", p.T, err)
	}
	return g, false, nil
}

// forwardGraph runs a forward that needs no host wait (the small-batch or
// fused path, or the shared expert alone) as a captured graph, and reports
// whether it did: x is copied into the layer's staging input, the graph
// runs, and the staging output is copied to y, all on the main stream. The
// first forward of each shape is left to run eagerly (ran false), so that
// library handles, workspaces and heuristics are set up outside any capture;
// the second captures the graph; later ones only launch it. Graphs are
// dropped when scratch buffers grow (their pointers are baked in). A backend
// that cannot capture leaves every forward to run eagerly.
func (l *Layer) forwardGraph(p *plan, x, y *gpuctx.Buffer) (ran bool, err error) {
	gc, key, n := &l.gc, p.key(), p.n
	if gc.seen[key] == 0 {
		gc.seen[key]++
		return false, nil
	}
	// The same x and y again: a graph captured on them needs no staging copies
	// (if they are aligned for the kernels' 16-byte accesses).
	dk := directKey{key, x, y}
	if g := gc.direct[dk]; !p.staged && (g != nil || gc.directSeen[dk]) {
		return true, l.forwardDirect(p, x, y, dk)
	}
	if len(gc.directSeen) >= maxDirectGraphs {
		clear(gc.directSeen)
	}
	gc.directSeen[dk] = true
	if err := gc.staging(&l.env, n); err != nil {
		return false, err
	}
	gx, err := gc.gx.Slice(0, n)
	if err != nil {
		return false, err
	}
	gy, err := gc.gy.Slice(0, n)
	if err != nil {
		return false, err
	}
	g := gc.graphs[key]
	if g == nil {
		var unavailable bool
		if g, unavailable, err = l.capture(p, gx, gy); unavailable { // this backend cannot capture: stay eager
			gc.use = false
			return false, nil
		}
		if err != nil {
			return false, err
		}
		gc.graphs[key] = g
	}
	if err := l.main.CopyDtoD(gx, 0, x, 0, n); err != nil {
		return true, err
	}
	if err := g.Launch(l.main); err != nil {
		return true, err
	}
	return true, l.main.CopyDtoD(y, 0, gy, 0, n)
}

// forwardDirect replays (capturing it first if needed) the forward of p
// captured on x and y themselves, so no staging copies run: for callers that
// pass the same buffers every time (a serving loop's activations, a benchmark).
// x and y are checked first, so a freed buffer is an error, never a replay on
// freed memory.
func (l *Layer) forwardDirect(p *plan, x, y *gpuctx.Buffer, dk directKey) error {
	xv, err := x.Slice(0, p.n)
	if err != nil {
		return err
	}
	yv, err := y.Slice(0, p.n)
	if err != nil {
		return err
	}
	g := l.gc.direct[dk]
	if g == nil {
		if len(l.gc.direct) >= maxDirectGraphs {
			l.gc.dropDirect()
		}
		if g, _, err = l.capture(p, xv, yv); err != nil {
			return err
		}
		l.gc.direct[dk] = g
	}
	return g.Launch(l.main)
}

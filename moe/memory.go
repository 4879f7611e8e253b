package moe

import "github.com/gpuctx/gpuctx"

// MemoryUse is the memory a Layer (or an ExpertShard) holds now, in bytes,
// as its buffers' sizes say (Layer.DeviceMemory). The fields do not overlap
// except where noted: FP8Codes and FP8Scales are parts of Weights. The JSON
// names end in _bytes.
type MemoryUse struct {
	// Weights is every weight buffer on the device (DeviceWeightBytes): the
	// router and correction bias, the shared expert (and its gate), the
	// routed experts, and the shared expert's FusedShared chunks where the
	// layer can fuse it. It does not change after the layer is built.
	Weights int64 `json:"weights_bytes"`
	// FP8Codes is the part of Weights that is E4M3 codes (an FP8 layer's
	// routed experts and its shared expert's FP8 chunks); 0 in bf16 and f32.
	FP8Codes int64 `json:"fp8_codes_bytes"`
	// FP8Scales is the part of Weights that is the float32 scales of the
	// codes' 128x128 blocks; 0 in bf16 and f32.
	FP8Scales int64 `json:"fp8_block_scales_bytes"`
	// Scratch is the device buffers a forward works in (router logits and
	// routing, the sort and permutation, the experts' intermediates, the FP8
	// layer's quantized activations and their scales, the shared expert's
	// outputs, Forward's input and output, the graphs' staging buffers): the
	// live ones the layer holds now. They grow with the largest batch run so
	// far (with a quarter of headroom when a buffer regrows) and are never
	// shrunk; 0 before the first forward.
	Scratch int64 `json:"scratch_bytes"`
	// BlasWorkspaces is the device memory of the BLAS workspaces of the
	// streams the layer made (the side stream, and the main stream unless
	// LayerOptions.Stream gave it: a caller's stream's workspace is the
	// caller's, gpuctx.Stream.WorkspaceBytes) and of its captured graphs
	// (gpuctx.Graph.WorkspaceBytes). A stream's is allocated by its first
	// GEMM; graphs are dropped, with their workspaces, when scratch regrows.
	BlasWorkspaces int64 `json:"blas_workspaces_bytes"`
	// PinnedHost is the page-locked host memory the layer holds (the
	// routing's per-expert counts it reads back). Host memory, not device
	// memory: a GPU's MemInfo does not see it (the CPU backend's does).
	PinnedHost int64 `json:"pinned_host_bytes"`
}

// Device returns the device bytes: Weights + Scratch + BlasWorkspaces.
func (m MemoryUse) Device() int64 { return m.Weights + m.Scratch + m.BlasWorkspaces }

// Total returns Device() + PinnedHost: on the CPU backend exactly what the
// layer takes from Device.MemInfo's free bytes. On a GPU MemInfo also sees
// what no buffer records (the kernels' code, library handles, graphs'
// instantiations, the allocator's rounding), and not PinnedHost.
func (m MemoryUse) Total() int64 { return m.Device() + m.PinnedHost }

// memory returns the memory c holds, with the graphs' and the extra pinned
// buffers' (nil ones skipped). The owner's lock must be held.
func (c *core) memory(graphs []*gpuctx.Graph, pinned ...*gpuctx.HostBuffer) MemoryUse {
	var m MemoryUse
	for _, b := range c.weightBufs {
		m.Weights += int64(b.Size())
	}
	if q := c.experts.q; q != nil && q.gu != nil {
		m.FP8Codes = int64(q.gu.Size() + q.down.Size())
		m.FP8Scales = int64(q.gus.Size() + q.downs.Size())
	}
	m.Scratch = c.scratchBytes
	ws := c.side.WorkspaceBytes()
	if c.ownMain {
		ws += c.main.WorkspaceBytes()
	}
	for _, g := range graphs {
		ws += g.WorkspaceBytes()
	}
	m.BlasWorkspaces = int64(ws)
	for _, h := range append(pinned, c.dispatch.countsHost) {
		m.PinnedHost += int64(h.Size())
	}
	return m
}

// DeviceMemory returns the memory the layer holds now (see MemoryUse): its
// weights, its scratch buffers as large as the largest batch so far made
// them, the BLAS workspaces of its own streams and graphs, and its pinned
// host memory; zero once the layer is closed. It touches no device and is
// safe for concurrent use (it waits for a forward being queued).
func (l *Layer) DeviceMemory() MemoryUse {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return MemoryUse{}
	}
	graphs := make([]*gpuctx.Graph, 0, len(l.gc.graphs)+len(l.gc.direct))
	for _, g := range l.gc.graphs {
		graphs = append(graphs, g)
	}
	for _, g := range l.gc.direct {
		graphs = append(graphs, g)
	}
	return l.memory(graphs)
}

// DeviceMemory returns the memory the shard holds now, as Layer.DeviceMemory
// does (a shard captures no graphs); zero once it is closed. Safe for
// concurrent use.
func (s *ExpertShard) DeviceMemory() MemoryUse {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return MemoryUse{}
	}
	return s.memory(nil, s.idxHost)
}

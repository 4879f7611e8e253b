package bench

import (
	"fmt"
	"slices"

	"github.com/gpuctx/gpuctx/moe"
)

// LayerMemory is a layer's memory in a report: moe.Layer.DeviceMemory's
// parts (their JSON names end in _bytes) and their total.
type LayerMemory struct {
	moe.MemoryUse
	// TotalBytes is MemoryUse.Total: the device bytes and the pinned host
	// memory, what the CPU backend's MemInfo sees the layer take.
	TotalBytes int64 `json:"total_bytes"`
}

// NewLayerMemory returns m with its total.
func NewLayerMemory(m moe.MemoryUse) LayerMemory {
	return LayerMemory{MemoryUse: m, TotalBytes: m.Total()}
}

// Text describes m as a sum: "22.62 GiB = weights 21.90 GiB (FP8 codes
// 11.23 GiB + block scales 2.8 MiB + bf16 10.67 GiB) + scratch 40.0 MiB +
// BLAS workspaces 64.0 MiB + pinned host 1.0 KiB" (the weights' parts only
// for an FP8 layer).
func (m LayerMemory) Text() string {
	weights := ByteSize(m.Weights)
	if m.FP8Codes > 0 {
		weights += fmt.Sprintf(" (FP8 codes %s + block scales %s + bf16 %s)",
			ByteSize(m.FP8Codes), ByteSize(m.FP8Scales), ByteSize(m.Weights-m.FP8Codes-m.FP8Scales))
	}
	return fmt.Sprintf("%s = weights %s + scratch %s + BLAS workspaces %s + pinned host %s",
		ByteSize(m.TotalBytes), weights, ByteSize(m.Scratch), ByteSize(m.BlasWorkspaces), ByteSize(m.PinnedHost))
}

// ByteSize formats n bytes in binary units: "512 B", "1.5 KiB", "40.0 MiB",
// "22.62 GiB".
func ByteSize(n int64) string {
	f := float64(n)
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.1f KiB", f/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.1f MiB", f/(1<<20))
	}
	return fmt.Sprintf("%.2f GiB", f/(1<<30))
}

// MoEMemory is a bench's device memory per layer: weight set 0's layer
// after the rounds, its scratch grown by the largest batch.
type MoEMemory struct {
	LayerMemory
	// Tokens is the largest batch the layers ran.
	Tokens int `json:"largest_batch_tokens"`
	// MainStreamWorkspace is the BLAS workspace of the main stream that every
	// set's layer runs on (the bench's, so in no layer's BlasWorkspaces).
	MainStreamWorkspace int64 `json:"main_stream_workspace_bytes"`
}

// Note is the report's note line about m for a bench of sets weight sets.
func (m *MoEMemory) Note(sets int) string {
	return fmt.Sprintf("device memory per layer (weight set 0) after the largest batch (%d tokens): %s; besides, the main stream that the %d layer(s) share holds a BLAS workspace of %s",
		m.Tokens, m.Text(), sets, ByteSize(m.MainStreamWorkspace))
}

// Memory returns the device memory of weight set 0's layer now (after the
// rounds: its scratch as the largest batch grew it).
func (b *MoEBench) Memory() *MoEMemory {
	m := &MoEMemory{LayerMemory: NewLayerMemory(b.layers[0].DeviceMemory()), MainStreamWorkspace: int64(b.main.WorkspaceBytes())}
	if len(b.o.Tokens) > 0 {
		m.Tokens = slices.Max(b.o.Tokens)
	}
	return m
}

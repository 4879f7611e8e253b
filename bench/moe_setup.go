package bench

import (
	"fmt"
	"math"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/internal/sysmem"
	"github.com/gpuctx/gpuctx/moe"
)

// The CPU backend's scaled-down layer shape (ScaleDown), and the host memory
// a full-size preset may take there (f32 host weights plus the simulated
// device copy).
const (
	CPUHidden, CPUExperts, CPUIntermediate = 256, 16, 64
	FullSizeCPULimit                       = 16 << 30
)

// ScaleDown returns a copy of c with the CPU backend's small shape, keeping its
// routing rules and the ratio of its shared expert's width to a routed one's.
func ScaleDown(c *moe.Config) (*moe.Config, error) {
	s := *c
	ratio := 0
	if c.SharedIntermediate > 0 {
		ratio = max(1, int(math.Round(float64(c.SharedIntermediate)/float64(c.Intermediate))))
	}
	s.HiddenSize, s.NumExperts, s.Intermediate = CPUHidden, CPUExperts, CPUIntermediate
	s.SharedIntermediate = ratio * CPUIntermediate
	s.TopK = min(c.TopK, s.NumExperts)
	if s.NumGroups > 1 && s.NumExperts%s.NumGroups != 0 {
		s.NumGroups, s.TopKGroups = 1, 1
	}
	if err := s.Validate(); err != nil {
		return nil, Fail("scaling the preset down for the CPU backend", "pass --full-size, or report this", err)
	}
	return &s, nil
}

// LayerElems returns the element count of a layer's weights.
func LayerElems(c *moe.Config) int64 {
	H, E, I, S := int64(c.HiddenSize), int64(c.NumExperts), int64(c.Intermediate), int64(c.SharedIntermediate)
	n := E*H + E*3*H*I + 3*H*S
	if c.SharedGate {
		n += H
	}
	return n
}

// GiB formats a byte count in GiB.
func GiB(b float64) string { return fmt.Sprintf("%.1f GiB", b/(1<<30)) }

// CheckMemory refuses a preset whose random weights cannot fit (one set's f32
// host copy at a time, sets device copies in dt), and returns a note about
// large ones.
func CheckMemory(dev *gpuctx.Device, c *moe.Config, dt gpuctx.DType, name string, sets int) (string, error) {
	elems := float64(LayerElems(c))
	host, device := 4*elems, float64(dt.Size())*elems*float64(max(sets, 1))
	fix := "use --model DIR (weights read from disk), a smaller preset or fewer --sets"
	if dev.Backend() == "cpu" && host+device > FullSizeCPULimit {
		return "", Fail(fmt.Sprintf("preset %s at full size needs ~%s of host memory for its f32 random weights plus ~%s of simulated device memory on the CPU backend",
			name, GiB(host), GiB(device)), "drop --full-size (the CPU backend then runs a scaled-down shape) or run on a GPU", nil)
	}
	if avail := sysmem.Field("MemAvailable"); avail > 0 && host > 0.9*float64(avail) {
		return "", Fail(fmt.Sprintf("preset %s needs ~%s of host memory for its f32 random weights; %s is available", name, GiB(host), GiB(float64(avail))), fix, nil)
	}
	if free, _, err := dev.MemInfo(); err == nil && dev.Backend() != "cpu" && device > 0.9*float64(free) {
		return "", Fail(fmt.Sprintf("preset %s needs ~%s of device memory in %s for %d weight set(s); %s is free", name, GiB(device), dt, sets, GiB(float64(free))), fix, nil)
	}
	if host > 4<<30 {
		return fmt.Sprintf("random weights take ~%s of host memory (f32, one set at a time) and ~%s of device memory (%s, %d set(s))", GiB(host), GiB(device), dt, sets), nil
	}
	return "", nil
}

// CheckTol is the largest relative difference moe bench allows between a
// mode's output and the single-stream forward in dt: the peer's tolerance
// (2e-2) for bf16, where the modes round partial sums differently, and 1e-4
// for f32.
func CheckTol(dt gpuctx.DType) float64 {
	if dt == gpuctx.BF16 {
		return 2e-2
	}
	return 1e-4
}

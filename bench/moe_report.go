package bench

import (
	"fmt"
	"maps"
	"math"
	"slices"
)

// MoEShape is the layer shape a bench ran.
type MoEShape struct {
	Family       string `json:"model_type"`
	Hidden       int    `json:"hidden_size"`
	Experts      int    `json:"experts"`
	TopK         int    `json:"top_k"`
	Intermediate int    `json:"intermediate"`
	Shared       int    `json:"shared_intermediate"`
}

// MoERow is one token count's results. Latencies are in microseconds: the
// median of the timed forwards of a pass, then the median over the passes
// (one per round); nil means not measured (no shared expert).
type MoERow struct {
	Tokens         int                `json:"tokens"`
	MedianUS       map[string]float64 `json:"median_us"` // per mode: single, dual, auto, fused
	SharedUS       *float64           `json:"shared_alone_us"`
	RoutedUS       float64            `json:"routed_alone_us"`
	Overlap        *float64           `json:"overlap_efficiency"`       // (single-dual)/min(shared,routed)
	FusedOverlap   *float64           `json:"fused_overlap_efficiency"` // (single-fused)/min(shared,routed)
	WeightBytes    int64              `json:"weight_bytes"`             // mean over the weight sets
	ActiveExperts  float64            `json:"active_experts"`           // distinct routed experts touched, mean over the weight sets
	FLOPs          float64            `json:"flops"`
	BytesFloorUS   float64            `json:"bytes_floor_us"`
	ComputeFloorUS float64            `json:"compute_floor_us"`
	FloorUS        float64            `json:"floor_us"`
	Bound          string             `json:"bound"` // "bytes" or "compute"
	Best           string             `json:"best_mode"`
	PctOfFloor     float64            `json:"pct_of_floor"` // 100*floor/best
	// CheckRelErr is, per mode, the largest relative (Frobenius) difference
	// over the weight sets between the output of the mode's last timed
	// forward and a single-stream forward of the same input, over the passes.
	CheckRelErr map[string]float64 `json:"check_rel_err"`

	// With a peer: the peer's median per mode (over the rounds), its best
	// mode, the experts its batches touched, and peer best / gpuctx best
	// (>1: gpuctx faster): the median over the rounds of each round's ratio,
	// with the smallest and largest. Absent without a peer result for this
	// token count.
	PeerUS            map[string]float64 `json:"peer_us,omitempty"`
	PeerBestUS        *float64           `json:"peer_best_us,omitempty"`
	PeerBestMode      string             `json:"peer_best_mode,omitempty"`
	PeerActiveExperts *float64           `json:"peer_active_experts,omitempty"`
	SpeedupVsPeer     *float64           `json:"speedup_vs_peer,omitempty"`
	SpeedupMin        *float64           `json:"speedup_min,omitempty"`
	SpeedupMax        *float64           `json:"speedup_max,omitempty"`
	RoundSpeedups     []float64          `json:"round_speedups,omitempty"`
}

// MoEReport is a whole moe bench: what ran where, the ceilings, a row per
// token count, and the peer's run when there was one.
type MoEReport struct {
	Backend    string   `json:"backend"`
	Device     string   `json:"device"`
	DType      string   `json:"dtype"`
	Date       string   `json:"date"`
	Commit     string   `json:"commit"`
	Command    string   `json:"command"`
	Preset     string   `json:"preset,omitempty"`
	Model      string   `json:"model,omitempty"`
	Layer      *int     `json:"layer,omitempty"`
	ScaledDown bool     `json:"scaled_down"`
	Seed       uint64   `json:"seed"`
	WeightDist string   `json:"weight_dist"` // uniform or normal (random weights), "" for a checkpoint
	Sets       int      `json:"weight_sets"` // weight and input sets rotated between forwards
	Rounds     int      `json:"rounds"`
	Shape      MoEShape `json:"shape"`
	Modes      []string `json:"modes"`
	Iters      int      `json:"iters"`
	Warmup     int      `json:"warmup"`
	MoECeilings
	Notes []string    `json:"notes"`
	Rows  []MoERow    `json:"rows"`
	Peer  *PeerReport `json:"peer,omitempty"`
	// Memory is the device memory per layer after the rounds (also a note).
	Memory *MoEMemory `json:"device_memory,omitempty"`
}

// MoECeilings is what a bench measured its ceilings with, and their values
// (their JSON fields are MoEReport's own).
type MoECeilings struct {
	CopyBytes int     `json:"copy_bytes"`
	CopyBW    float64 `json:"copy_bytes_per_s"` // read + written
	GemmN     int     `json:"gemm_n"`
	GemmRate  float64 `json:"gemm_flop_per_s"`
}

// Tokens returns the token counts of the rows.
func (r *MoEReport) Tokens() []int {
	ts := make([]int, len(r.Rows))
	for i, row := range r.Rows {
		ts[i] = row.Tokens
	}
	return ts
}

// FmtSpeedup formats a speed ratio: "1.23x".
func FmtSpeedup(s float64) string { return fmt.Sprintf("%.2fx", s) }

// PeerSummary is the one-line summary of the speed against the peer ("" with
// no peer), naming the precision the peer ran and saying when it is not
// gpuctx's.
func (r *MoEReport) PeerSummary() string {
	p := r.Peer
	if p == nil {
		return ""
	}
	n := 0
	for _, row := range r.Rows {
		if row.SpeedupVsPeer != nil {
			n++
		}
	}
	name := p.Name
	if p.DType != "" {
		name += " " + p.DType
	}
	var s string
	switch {
	case p.MinSpeedup == nil:
		s = fmt.Sprintf("speed vs peer (%s, preset %s): no token count to compare", name, p.Preset)
	default:
		s = fmt.Sprintf("speed vs peer (%s, preset %s): %s to %s over %d of %d token counts (peer best / gpuctx best, median of %d round(s); >1 = gpuctx faster)",
			name, p.Preset, FmtSpeedup(*p.MinSpeedup), FmtSpeedup(*p.MaxSpeedup), n, len(r.Rows), max(r.Rounds, 1))
	}
	if p.DType != "" && p.DType != r.DType {
		s += fmt.Sprintf("; not like for like: the peer ran %s, gpuctx %s", p.DType, r.DType)
	}
	if !p.OK {
		s += "; the peer FAILED: " + p.Error
	}
	return s
}

// mergePasses returns one row per token count from the passes (one per
// round, each with the same token counts in the same order): medians over the
// passes of every timing, the largest check error, and the derived columns
// (best mode, overlaps) recomputed from the medians.
func mergePasses(passes [][]MoERow) []MoERow {
	out := make([]MoERow, len(passes[0]))
	for i := range out {
		row := passes[0][i]
		row.MedianUS, row.CheckRelErr = map[string]float64{}, map[string]float64{}
		var routed, shared []float64
		for _, p := range passes {
			routed = append(routed, p[i].RoutedUS)
			if p[i].SharedUS != nil {
				shared = append(shared, *p[i].SharedUS)
			}
			for m, e := range p[i].CheckRelErr {
				row.CheckRelErr[m] = max(row.CheckRelErr[m], e)
			}
		}
		for m := range passes[0][i].MedianUS {
			var v []float64
			for _, p := range passes {
				v = append(v, p[i].MedianUS[m])
			}
			row.MedianUS[m] = Median(v)
		}
		row.RoutedUS = Median(routed)
		if len(shared) > 0 {
			s := Median(shared)
			row.SharedUS = &s
		}
		row.derive()
		out[i] = row
	}
	return out
}

// derive sets the best mode and the overlaps from the timings.
func (row *MoERow) derive() {
	row.Best = ""
	for _, m := range slices.Sorted(maps.Keys(row.MedianUS)) {
		if row.Best == "" || row.MedianUS[m] < row.MedianUS[row.Best] {
			row.Best = m
		}
	}
	row.Overlap, row.FusedOverlap = nil, nil
	single, ok := row.MedianUS["single"]
	if !ok || row.SharedUS == nil {
		return
	}
	hidden := min(*row.SharedUS, row.RoutedUS)
	if dual, ok := row.MedianUS["dual"]; ok {
		ov := (single - dual) / hidden
		row.Overlap = &ov
	}
	if fused, ok := row.MedianUS["fused"]; ok {
		ov := (single - fused) / hidden
		row.FusedOverlap = &ov
	}
}

// setFloor sets the floor columns of row from the ceilings.
func (row *MoERow) setFloor(copyBW, gemmRate float64) {
	f := NewFloor(row.WeightBytes, row.FLOPs, copyBW, gemmRate)
	row.BytesFloorUS, row.ComputeFloorUS, row.FloorUS, row.Bound = f.BytesUS, f.ComputeUS, f.US, f.Bound
	row.PctOfFloor = 100 * row.FloorUS / row.MedianUS[row.Best]
}

// minMedMax returns the smallest, the median and the largest of x.
func minMedMax(x []float64) (lo, med, hi float64) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, v := range x {
		lo, hi = min(lo, v), max(hi, v)
	}
	return lo, Median(x), hi
}

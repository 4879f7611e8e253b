package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/moe"
)

// The text of moe bench: the markdown header and table that --out writes and
// the command prints.

// fmtUS formats microseconds with about three significant digits.
func fmtUS(v float64) string {
	switch {
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	case v < 1000:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

// writeTable writes rows (the first is the header) as an aligned markdown
// table: the first column left-aligned, the others right-aligned.
func writeTable(w io.Writer, rows [][]string) {
	width := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			width[i] = max(width[i], len([]rune(c)), 3)
		}
	}
	pad := func(s string, n int, left bool) string {
		gap := strings.Repeat(" ", n-len([]rune(s)))
		if left {
			return s + gap
		}
		return gap + s
	}
	for ri, r := range rows {
		cells := make([]string, len(r))
		for i, c := range r {
			cells[i] = pad(c, width[i], i == 0)
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		if ri == 0 {
			for i := range cells {
				if i == 0 {
					cells[i] = strings.Repeat("-", width[i])
				} else {
					cells[i] = strings.Repeat("-", width[i]-1) + ":"
				}
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		}
	}
}

// markdown renders the header and the aligned table.
func markdown(r *moeBenchReport) string {
	var b strings.Builder
	markdownHeader(&b, r)
	cpu := r.Backend == "cpu"
	cols := tableColumns(r)
	rows := [][]string{cols.head()}
	for _, row := range r.Rows {
		rows = append(rows, cols.line(row))
	}
	writeTable(&b, rows)
	if cpu {
		b.WriteString("\nfloor = max(weight bytes touched / copy bandwidth, FLOPs / GEMM rate); * = best mode; experts = distinct routed experts a batch touched (mean over the weight sets).\n")
	} else {
		b.WriteString("\nfloor = max(weight bytes touched / copy bandwidth, FLOPs / GEMM rate); % of floor = floor / best mode (*); " +
			"overlap = (single - dual) / min(shared, routed), 1 = the shared expert fully hidden; fused overlap = (single - fused) / min(shared, routed); " +
			"experts = distinct routed experts a batch touched (mean over the weight sets).\n")
	}
	if r.Peer != nil {
		b.WriteString("peer µs = the peer's fastest mode (median over its runs); experts: gpuctx / peer; vs peer = peer best / gpuctx best (*) per round, >1 = gpuctx faster: median (min-max over the rounds).\n")
		b.WriteString(r.PeerSummary() + "\n")
	}
	return b.String()
}

// markdownHeader writes the title and the list that says what ran.
func markdownHeader(b *strings.Builder, r *moeBenchReport) {
	name := r.Preset
	if r.Model != "" {
		name = fmt.Sprintf("%s layer %d", r.Model, *r.Layer)
	} else if r.ScaledDown {
		name += " (scaled down for the CPU backend)"
	}
	s := r.Shape
	fmt.Fprintf(b, "### MoE layer: %s, %s, %s\n\n", name, r.DType, r.Device)
	fmt.Fprintf(b, "- device: %s (backend %s)\n", r.Device, r.Backend)
	fmt.Fprintf(b, "- date: %s; commit: %s\n", r.Date, r.Commit)
	fmt.Fprintf(b, "- command: `%s`\n", r.Command)
	weights := fmt.Sprintf("random (seed %d; %s)", r.Seed, moeDistDescription(r.WeightDist))
	if r.Model != "" {
		weights = "from " + r.Model
	}
	fmt.Fprintf(b, "- layer: %s, H=%d, E=%d, top-%d, I=%d, shared=%d; weights %s; dtype %s\n",
		s.Family, s.Hidden, s.Experts, s.TopK, s.Intermediate, s.Shared, weights, r.DType)
	gemmType := r.DType
	if gemmType == "fp8" {
		gemmType = "bf16" // the w8a16 tiles multiply in bf16
	}
	fmt.Fprintf(b, "- ceilings measured in this run: copy %.3g GB/s (%d MiB device-to-device, read+write), GEMM %.3g TFLOP/s (%s %d³ through a Context)\n",
		r.CopyBW/1e9, r.CopyBytes>>20, r.GemmRate/1e12, gemmType, r.GemmN)
	warm := r.Warmup
	if r.Sets > 1 {
		warm = max(warm, 2*r.Sets) // two per set (bench.MoEBench)
	}
	fmt.Fprintf(b, "- latency: median of %d forwards after %d warm-up, rotating over %d weight and input set(s) (a Layer each), device events around Layer.ForwardDevice on the layers' main stream, in µs; the median over %d round(s)\n",
		r.Iters, warm, max(r.Sets, 1), max(r.Rounds, 1))
	fmt.Fprintf(b, "- output check: every mode's last timed outputs against a single-stream forward of the same inputs, at every token count: %s\n", checkSummary(r))
	for _, n := range r.Notes {
		fmt.Fprintf(b, "- note: %s\n", n)
	}
	// On the CPU backend the "streams" of single and dual mode take turns on
	// the same cores and the ceilings are the host's: overlap and % of floor
	// come out as numbers that mean nothing (negative, or far above 100%).
	if r.Backend == "cpu" {
		b.WriteString("- note: CPU backend: the overlap and % of floor columns are left out: the side stream's work shares the same host cores and the ceilings are the host's, so they would be meaningless numbers (--json keeps them)\n")
	}
	if p := r.Peer; p != nil {
		status := "ok"
		if !p.OK {
			status = "FAILED: " + p.Error
		}
		fmt.Fprintf(b, "- peer: %s, %s, %d run(s) alternating with gpuctx's (gpuctx first in odd rounds, the peer first in even ones): `%s`; %s\n",
			p.Name, bench.PeerDTypeText(p.DType), p.Runs, p.Command, status)
	}
	b.WriteString("\n")
}

// moeDistDescription says what the weight distribution named d draws.
func moeDistDescription(d string) string {
	dist, err := moe.ParseInitDist(d)
	if err != nil {
		return "distribution " + d
	}
	return dist.Describe()
}

// checkSummary is the largest relative difference of the output check.
func checkSummary(r *moeBenchReport) string {
	worst, n := 0.0, 0
	for _, row := range r.Rows {
		for _, e := range row.CheckRelErr {
			worst, n = max(worst, e), n+1
		}
	}
	if n == 0 {
		return "none ran"
	}
	return fmt.Sprintf("passed, largest relative difference %.2g (tolerance %.2g)", worst, benchCheckTol(map[string]gpuctx.DType{"bf16": gpuctx.BF16, "fp8": gpuctx.BF16}[r.DType], r.DType == "fp8"))
}

// benchColumns says which optional columns the table has.
type benchColumns struct {
	modes            []string
	cpu, fused, peer bool
}

func tableColumns(r *moeBenchReport) benchColumns {
	c := benchColumns{modes: r.Modes, cpu: r.Backend == "cpu", peer: r.Peer != nil}
	for _, row := range r.Rows {
		c.fused = c.fused || row.FusedOverlap != nil
	}
	return c
}

func (c benchColumns) head() []string {
	head := []string{"tokens", "floor µs", "bound"}
	for _, m := range c.modes {
		head = append(head, m+" µs")
	}
	head = append(head, "shared µs", "routed µs")
	if !c.cpu {
		head = append(head, "overlap")
		if c.fused {
			head = append(head, "fused overlap")
		}
		head = append(head, "% of floor")
	}
	head = append(head, "experts", "weights MiB", "GFLOP")
	if c.peer {
		head = append(head, "peer µs (best mode)", "vs peer")
	}
	return head
}

// optFloat formats *v with format, "-" for nil.
func optFloat(format string, v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf(format, *v)
}

func (c benchColumns) line(row benchRow) []string {
	line := []string{strconv.Itoa(row.Tokens), fmtUS(row.FloorUS), row.Bound}
	for _, m := range c.modes {
		v := fmtUS(row.MedianUS[m])
		if m == row.Best && len(c.modes) > 1 {
			v += "*"
		}
		line = append(line, v)
	}
	sh := "-"
	if row.SharedUS != nil {
		sh = fmtUS(*row.SharedUS)
	}
	line = append(line, sh, fmtUS(row.RoutedUS))
	if !c.cpu {
		line = append(line, optFloat("%.2f", row.Overlap))
		if c.fused {
			line = append(line, optFloat("%.2f", row.FusedOverlap))
		}
		line = append(line, fmt.Sprintf("%.1f%%", row.PctOfFloor))
	}
	experts := fmt.Sprintf("%.1f", row.ActiveExperts)
	if c.peer {
		experts += " / " + optFloat("%.1f", row.PeerActiveExperts)
	}
	line = append(line, experts, fmt.Sprintf("%.1f", float64(row.WeightBytes)/(1<<20)), fmt.Sprintf("%.3g", row.FLOPs/1e9))
	if c.peer {
		line = append(line, peerCells(row)...)
	}
	return line
}

// peerCells are the peer's two cells of row: its best time (mode) and the
// ratio, median (min-max) when there were several rounds.
func peerCells(row benchRow) []string {
	pu, sp := "-", "-"
	if row.PeerBestUS != nil {
		pu = fmtUS(*row.PeerBestUS) + " (" + row.PeerBestMode + ")"
	}
	if row.SpeedupVsPeer != nil {
		sp = bench.FmtSpeedup(*row.SpeedupVsPeer)
		if len(row.RoundSpeedups) > 1 {
			sp += fmt.Sprintf(" (%.2f-%.2f)", *row.SpeedupMin, *row.SpeedupMax)
		}
	}
	return []string{pu, sp}
}

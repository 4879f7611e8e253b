package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
)

// PeerSpec says how to run the peer: the script, the Python interpreter, the
// peer's preset and its number of weight sets; ErrOut receives the peer's
// stderr and its progress lines.
type PeerSpec struct {
	Script, Python, Preset string
	Sets                   int
	ErrOut                 io.Writer
}

// Args is the peer's command line (after the interpreter) for tokens with
// the same iteration and warm-up counts as gpuctx, and p.Sets weight sets.
func (p *PeerSpec) Args(tokens []int, iters, warmup int) []string {
	ts := make([]string, len(tokens))
	for i, t := range tokens {
		ts[i] = strconv.Itoa(t)
	}
	return []string{p.Script, "--preset", p.Preset, "--tokens", strings.Join(ts, ","),
		"--iters", strconv.Itoa(iters), "--warmup", strconv.Itoa(warmup), "--sets", strconv.Itoa(p.Sets)}
}

// Command is the peer's whole command line, for reports.
func (p *PeerSpec) Command(tokens []int, iters, warmup int) string {
	return p.Python + " " + strings.Join(p.Args(tokens, iters, warmup), " ")
}

// Run runs the peer once and returns its passing rows, the number of weight
// sets it rotated and the precision it ran (see runPeer).
func (p *PeerSpec) Run(ctx context.Context, tokens []int, iters, warmup int) (PeerRun, error) {
	return runPeer(ctx, p.Python, p.Args(tokens, iters, warmup), tokens, p.ErrOut)
}

// RunRounds runs rounds of one gpuctx pass and one peer run each (without a
// peer, passes only), alternating the order: gpuctx first in the first
// round, the peer first in the next, and so on. It sets rep.Rows (medians
// over the passes, floors) and, with a peer, rep.Peer's runs and precision
// (a note when it is not rep.DType: PeerDTypeNote) and every row's peer
// columns. A peer failure stops the peer's later runs (gpuctx's passes go
// on) and comes back as peerErr; err is gpuctx's own failure.
func (b *MoEBench) RunRounds(ctx context.Context, peer *PeerSpec, rounds int, rep *MoEReport) (peerErr, err error) {
	var runs []map[int]PeerRow
	runPeer := func(r int) {
		if peer == nil || peerErr != nil {
			return
		}
		fmt.Fprintf(peer.ErrOut, "moe bench: round %d of %d: running the peer: %s\n", r+1, rounds, peer.Command(b.o.Tokens, b.o.Iters, b.o.Warmup))
		run, perr := peer.Run(ctx, b.o.Tokens, b.o.Iters, b.o.Warmup)
		runs = append(runs, run.Rows)
		if run.Sets > 0 && run.Sets != len(b.layers) {
			rep.Notes = append(rep.Notes, fmt.Sprintf("round %d: the peer rotated %d weight set(s), gpuctx %d (the peer drops sets that do not fit in 60%% of its free device memory)", r+1, run.Sets, len(b.layers)))
		}
		if run.DType != "" && rep.Peer != nil {
			rep.Peer.DType = run.DType
		}
		if perr != nil {
			peerErr = perr
		}
		b.o.Progress.Step(fmt.Sprintf("round %d: peer", r+1))
	}
	for r := range rounds {
		if r%2 == 1 {
			runPeer(r)
		}
		b.prefix = ""
		if rounds > 1 {
			b.prefix = fmt.Sprintf("round %d: ", r+1)
		}
		if _, err := b.Pass(); err != nil {
			return peerErr, err
		}
		if r%2 == 0 {
			runPeer(r)
		}
	}
	rep.Rows = b.Rows()
	rep.Memory = b.Memory()
	rep.Notes = append(rep.Notes, rep.Memory.Note(len(b.layers)))
	if rep.Peer != nil {
		rep.Peer.Runs = len(runs)
		applyPeer(rep, b.passes, runs)
		if note := PeerDTypeNote(rep.DType, rep.Peer.DType); note != "" {
			rep.Notes = append(rep.Notes, note)
		}
	}
	return peerErr, nil
}

// applyPeer adds the peer's columns to rep's rows: per token count the
// peer's median per mode over its runs, its best mode, its active experts,
// and the ratio peer best / gpuctx best of each round (run i of the peer
// against pass i of gpuctx, >1: gpuctx faster) as min, median and max; and
// the range of the median ratios to rep.Peer.
func applyPeer(rep *MoEReport, passes [][]MoERow, runs []map[int]PeerRow) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for i := range rep.Rows {
		row := &rep.Rows[i]
		merged := PeerRow{US: map[string]float64{}}
		var ratios, bests []float64
		perMode := map[string][]float64{}
		for r, run := range runs {
			p, ok := run[row.Tokens]
			if !ok {
				continue
			}
			_, us, ok := p.best()
			if !ok {
				continue
			}
			for m, v := range p.US {
				perMode[m] = append(perMode[m], v)
			}
			bests = append(bests, us)
			if merged.ActiveExperts == nil {
				merged.ActiveExperts = p.ActiveExperts
			}
			if r < len(passes) {
				if ours := passes[r][i].MedianUS[passes[r][i].Best]; ours > 0 {
					ratios = append(ratios, us/ours)
				}
			}
		}
		if len(bests) == 0 {
			continue
		}
		for m, v := range perMode {
			merged.US[m] = Median(v)
		}
		mode, _, _ := merged.best()
		best := Median(bests)
		row.PeerUS, row.PeerBestUS, row.PeerBestMode, row.PeerActiveExperts = merged.US, &best, mode, merged.ActiveExperts
		if len(ratios) > 0 {
			mn, med, mx := minMedMax(ratios)
			row.SpeedupVsPeer, row.SpeedupMin, row.SpeedupMax, row.RoundSpeedups = &med, &mn, &mx, ratios
			lo, hi = min(lo, med), max(hi, med)
		}
	}
	if lo <= hi {
		rep.Peer.MinSpeedup, rep.Peer.MaxSpeedup = &lo, &hi
	}
}

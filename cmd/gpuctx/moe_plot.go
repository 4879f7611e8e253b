package main

import (
	"bytes"
	"fmt"
	"image/color"
	"math"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/gpuctx/gpuctx/internal/atomicfile"
)

// Log-axis padding: the data range is widened by these factors on each side
// so that no point sits on the frame and a single point still has a range.
const plotPadX, plotPadY = 1.4, 1.3

// plotLegendShare is the share of the frame's height above the data, where
// the legend goes.
const plotLegendShare = 0.3

// plotSeries is one line of the plot.
type plotSeries struct {
	name   string
	value  func(benchRow) (float64, bool)
	dashed bool
}

// series returns the plot's lines: one per mode, the shared expert alone, the
// routed experts alone, the floor and, when a peer ran, the peer's best mode.
func series(r *moeBenchReport) []plotSeries {
	var all []plotSeries
	for _, m := range r.Modes {
		all = append(all, plotSeries{name: m, value: func(b benchRow) (float64, bool) { v, ok := b.MedianUS[m]; return v, ok }})
	}
	all = append(all,
		plotSeries{name: "shared alone", value: func(b benchRow) (float64, bool) {
			if b.SharedUS == nil {
				return 0, false
			}
			return *b.SharedUS, true
		}},
		plotSeries{name: "routed alone", value: func(b benchRow) (float64, bool) { return b.RoutedUS, true }},
		plotSeries{name: "floor", value: func(b benchRow) (float64, bool) { return b.FloorUS, true }, dashed: true})
	if r.Peer != nil {
		all = append(all, plotSeries{name: "peer: " + r.Peer.Name + " (best mode)", value: func(b benchRow) (float64, bool) {
			if b.PeerBestUS == nil {
				return 0, false
			}
			return *b.PeerBestUS, true
		}})
	}
	return all
}

// logRange returns [lo/pad, hi*pad] of the positive values in vs, and false
// when there are none.
func logRange(vs []float64, pad float64) (lo, hi float64, ok bool) {
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, v := range vs {
		if v > 0 && !math.IsInf(v, 0) && !math.IsNaN(v) {
			lo, hi = min(lo, v), max(hi, v)
		}
	}
	if lo > hi {
		return 0, 0, false
	}
	return lo / pad, hi * pad, true
}

// tokenTicks labels the x axis at the token counts that ran.
func tokenTicks(tokens []int) plot.Ticker {
	return plot.TickerFunc(func(lo, hi float64) []plot.Tick {
		var ts []plot.Tick
		for _, t := range tokens {
			if v := float64(t); v >= lo && v <= hi {
				ts = append(ts, plot.Tick{Value: v, Label: strconv.Itoa(t)})
			}
		}
		return ts
	})
}

// latencyTicks marks 1, 2 and 5 times the powers of ten inside [lo, hi]. All
// are labelled when the range spans at most two decades, else only the powers
// of ten (the others are minor ticks); a range with no such value gets its ends.
func latencyTicks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	few := hi/lo <= 100
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, e)
			if v < lo || v > hi {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || few {
				t.Label = strconv.FormatFloat(v, 'g', -1, 64)
			}
			ts = append(ts, t)
		}
	}
	labelled := 0
	for _, t := range ts {
		if t.Label != "" {
			labelled++
		}
	}
	if labelled < 2 {
		ts = append(ts, plot.Tick{Value: lo, Label: fmtUS(lo)}, plot.Tick{Value: hi, Label: fmtUS(hi)})
	}
	return ts
}

// plotTitle is the plot's title; on the CPU backend a second line says that
// the times say nothing about a GPU.
func plotTitle(r *moeBenchReport) string {
	name := r.Preset
	if r.Model != "" {
		name = r.Model
	}
	if r.ScaledDown {
		name += " (scaled down)"
	}
	t := fmt.Sprintf("MoE layer %s, %s, %s", name, r.DType, r.Device)
	if r.Backend == "cpu" {
		t += "\nCPU backend: these times only show that the pipeline runs; they say nothing about a GPU"
	}
	return t
}

// writePlot draws latency against tokens on log-log axes, one line per mode
// plus the shared expert alone, the routed experts alone, the floor and the
// peer, and writes it as a PNG to path atomically.
func writePlot(r *moeBenchReport, path string) error {
	if !strings.HasSuffix(strings.ToLower(path), ".png") {
		return fmt.Errorf("--plot %s: only PNG is written; name the file *.png", path)
	}
	p := plot.New()
	p.Title.Text = plotTitle(r)
	p.X.Label.Text = "tokens"
	p.Y.Label.Text = "latency (µs)"
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())

	palette := []color.Color{
		color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 255}, color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 255},
		color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 255}, color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 255},
		color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 255}, color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 255},
		color.RGBA{R: 0x17, G: 0xbe, B: 0xcf, A: 255}, color.RGBA{R: 0xe3, G: 0x77, B: 0xc2, A: 255},
	}
	var xs, ys []float64
	var tokens []int
	for _, row := range r.Rows {
		tokens = append(tokens, row.Tokens)
		xs = append(xs, float64(row.Tokens))
	}
	for i, s := range series(r) {
		var xys plotter.XYs
		for _, row := range r.Rows {
			if v, ok := s.value(row); ok && v > 0 && !math.IsInf(v, 0) {
				xys = append(xys, plotter.XY{X: float64(row.Tokens), Y: v})
				ys = append(ys, v)
			}
		}
		if len(xys) == 0 {
			continue
		}
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return err
		}
		c := palette[i%len(palette)]
		if s.dashed {
			c = color.Black
			line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		}
		line.Color, points.Color = c, c
		points.Shape = draw.CircleGlyph{}
		p.Add(line, points)
		p.Legend.Add(s.name, line, points)
	}
	// Explicit, padded ranges: gonum widens an empty range by ±1, which a log
	// axis cannot take (one token count, or one latency), and without padding
	// the extreme points sit on the frame.
	xlo, xhi, okx := logRange(xs, plotPadX)
	ylo, yhi, oky := logRange(ys, plotPadY)
	if !okx || !oky {
		return fmt.Errorf("nothing to plot: no positive latency was measured")
	}
	// the top quarter of the frame is left to the legend
	yhi = ylo * math.Pow(yhi/ylo, 1/(1-plotLegendShare))
	p.X.Min, p.X.Max, p.Y.Min, p.Y.Max = xlo, xhi, ylo, yhi
	p.X.Tick.Marker = tokenTicks(tokens)
	p.Y.Tick.Marker = plot.TickerFunc(latencyTicks)

	wt, err := p.WriterTo(8*vg.Inch, 5*vg.Inch, "png")
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if _, err := wt.WriteTo(&buf); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, buf.Bytes())
}

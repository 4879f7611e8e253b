package main

import (
	"bytes"
	"fmt"
	"image/color"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// writePlot draws latency against tokens on log-log axes, one line per mode
// plus the shared expert alone, the routed experts alone and the floor, and
// writes it as a PNG to path atomically.
func (r *moeBenchReport) writePlot(path string) error {
	if !strings.HasSuffix(strings.ToLower(path), ".png") {
		return fmt.Errorf("--plot %s: only PNG is written; name the file *.png", path)
	}
	p := plot.New()
	title := r.Preset
	if r.Model != "" {
		title = r.Model
	}
	if r.ScaledDown {
		title += " (scaled down)"
	}
	p.Title.Text = fmt.Sprintf("MoE layer %s, %s, %s", title, r.DType, r.Device)
	p.X.Label.Text = "tokens"
	p.Y.Label.Text = "latency (µs)"
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.X.Tick.Marker, p.Y.Tick.Marker = plot.LogTicks{Prec: -1}, plot.LogTicks{Prec: -1}
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())

	type series struct {
		name   string
		value  func(benchRow) (float64, bool)
		dashed bool
	}
	var all []series
	for _, m := range r.Modes {
		all = append(all, series{name: m, value: func(b benchRow) (float64, bool) { v, ok := b.MedianUS[m]; return v, ok }})
	}
	all = append(all,
		series{name: "shared alone", value: func(b benchRow) (float64, bool) {
			if b.SharedUS == nil {
				return 0, false
			}
			return *b.SharedUS, true
		}},
		series{name: "routed alone", value: func(b benchRow) (float64, bool) { return b.RoutedUS, true }},
		series{name: "floor", value: func(b benchRow) (float64, bool) { return b.FloorUS, true }, dashed: true})
	palette := []color.Color{
		color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 255}, color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 255},
		color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 255}, color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 255},
		color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 255}, color.RGBA{A: 255},
	}
	for i, s := range all {
		var xys plotter.XYs
		for _, row := range r.Rows {
			if v, ok := s.value(row); ok && v > 0 {
				xys = append(xys, plotter.XY{X: float64(row.Tokens), Y: v})
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
	wt, err := p.WriterTo(8*vg.Inch, 5*vg.Inch, "png")
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if _, err := wt.WriteTo(&buf); err != nil {
		return err
	}
	return safetensors.WriteFileAtomic(path, buf.Bytes())
}

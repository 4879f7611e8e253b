package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// allocWeights allocates every weight buffer of the stages and returns the
// copies that fill them. With ns fused shared-expert chunks the experts'
// gu and down hold ns more experts after the routed ones: chunk j of the
// shared expert's width as expert E+j.
func (c *core) allocWeights(ns int) ([]weightCopy, error) {
	cfg := &c.cfg
	E, H, I, Is, es := cfg.NumExperts, cfg.HiddenSize, cfg.Intermediate, cfg.SharedIntermediate, c.es
	r, x, s := &c.router, &c.experts, &c.shared
	for _, b := range []struct {
		dst **gpuctx.Buffer
		n   int
		ok  bool
	}{{&r.weight, E * H * es, true}, {&r.bias, 4 * E, true},
		{&x.gu, (x.hi - x.lo + ns) * 2 * I * H * es, x.q == nil}, {&x.down, (x.hi - x.lo + ns) * H * I * es, x.q == nil},
		{&s.gu, 2 * Is * H * es, Is > 0}, {&s.down, H * Is * es, Is > 0},
		{&s.gate, H * es, cfg.SharedGate}} {
		if b.ok {
			nb, err := c.dev.Alloc(b.n)
			if err != nil {
				return nil, err
			}
			c.weightBufs = append(c.weightBufs, nb)
			*b.dst = nb
		}
	}
	if x.q != nil { // FP8: the shared expert's chunks too (fp8Experts.uploadShared)
		if err := x.q.alloc(&c.env, x.hi-x.lo+ns); err != nil {
			return nil, err
		}
	}
	if !cfg.HasBias() {
		if err := r.bias.CopyFromHost(make([]byte, 4*E)); err != nil { // zeros
			return nil, err
		}
	}
	return c.weightCopies(ns)
}

// weightCopies lists the copies that fill the weight buffers (see allocWeights).
func (c *core) weightCopies(ns int) ([]weightCopy, error) {
	cfg := &c.cfg
	E, H, I, Is := cfg.NumExperts, cfg.HiddenSize, cfg.Intermediate, cfg.SharedIntermediate
	r, x, s := &c.router, &c.experts, &c.shared
	var copies []weightCopy
	var err error
	put := func(b *gpuctx.Buffer, off int, wc weightCopy) { // off: elements of b
		es := c.es
		if wc.f32 {
			es = 4
		}
		if err == nil {
			wc.dst, err = b.Slice(off*es, (wc.r1-wc.r0)*(wc.c1-wc.c0)*es)
			copies = append(copies, wc)
		}
	}
	whole := func(p weightPart, e, rows, cols int) weightCopy {
		return weightCopy{part: p, expert: e, cols: cols, r1: rows, c1: cols}
	}
	put(r.weight, 0, whole(wRouter, 0, E, H))
	if cfg.HasBias() {
		b := whole(wBias, 0, 1, E)
		b.f32 = true
		put(r.bias, 0, b)
	}
	for j := 0; j < ns && x.q == nil; j++ { // FP8 experts: fp8Experts.uploadShared
		g, u := whole(wSharedGateProj, 0, (j+1)*I, H), whole(wSharedUpProj, 0, (j+1)*I, H)
		g.r0, u.r0 = j*I, j*I
		put(x.gu, (E+j)*2*I*H, g)
		put(x.gu, (E+j)*2*I*H+I*H, u)
		// Columns j*I.. of the [H, Is] down projection.
		d := whole(wSharedDownProj, 0, H, Is)
		d.c0, d.c1 = j*I, (j+1)*I
		put(x.down, (E+j)*H*I, d)
	}
	for e := x.lo; e < x.hi && x.q == nil; e++ { // FP8 experts: fp8Experts.upload
		put(x.gu, (e-x.lo)*2*I*H, whole(wGate, e, I, H))
		put(x.gu, (e-x.lo)*2*I*H+I*H, whole(wUp, e, I, H))
		put(x.down, (e-x.lo)*H*I, whole(wDown, e, H, I))
	}
	if Is > 0 && x.q == nil { // FP8 experts: sharedStage.uploadFP8
		put(s.gu, 0, whole(wSharedGateProj, 0, Is, H))
		put(s.gu, Is*H, whole(wSharedUpProj, 0, Is, H))
		put(s.down, 0, whole(wSharedDownProj, 0, H, Is))
	}
	if cfg.SharedGate {
		put(s.gate, 0, whole(wSharedExpertGate, 0, 1, H))
	}
	return copies, err
}

// weightPart names one weight tensor of a layer, as core.init asks a
// weightSource for it. Each is a row-major matrix (a vector is one row).
type weightPart uint8

const (
	wRouter           weightPart = iota // router [E, H]
	wBias                               // correction bias [1, E]
	wGate                               // routed expert's gate projection [I, H]
	wUp                                 // routed expert's up projection [I, H]
	wDown                               // routed expert's down projection [H, I]
	wSharedGateProj                     // shared expert's gate projection [Is, H]
	wSharedUpProj                       // shared expert's up projection [Is, H]
	wSharedDownProj                     // shared expert's down projection [H, Is]
	wSharedExpertGate                   // Qwen2-MoE shared_expert_gate [1, H]
)

// weightCopy is one copy core.init asks of a weightSource: rows [r0, r1) and
// columns [c0, c1) of weight part (of routed expert `expert` for wGate, wUp
// and wDown), a row-major matrix of cols columns, written row after row to
// dst, which holds exactly (r1-r0)*(c1-c0) elements, in the layer's dtype, or
// in f32 when f32 is set (the correction bias).
type weightCopy struct {
	part           weightPart
	expert         int
	cols           int
	r0, r1, c0, c1 int
	dst            *gpuctx.Buffer
	f32            bool
}

// full reports whether c takes whole rows (its source elements are contiguous).
func (c *weightCopy) full() bool { return c.c0 == 0 && c.c1 == c.cols }

// weightSource supplies a layer's weights to core.init: memWeights (NewLayer)
// or fileWeights (LoadLayer). The values it writes for a part are those of
// the part in float32 (Weights), converted to the destination's dtype.
type weightSource interface {
	// upload performs copies with synchronous host-to-device copies that wait
	// for nothing queued, in any order, and returns the first error.
	upload(e *env, copies []weightCopy) error
	// fp8Weight returns part p (wGate, wUp or wDown) of routed expert e, or
	// the shared expert's wSharedGateProj, wSharedUpProj or wSharedDownProj
	// (e unused), rows x cols, in FP8 with 128x128 block scales: as stored,
	// or quantized (fp8.Quantize).
	fp8Weight(p weightPart, e, rows, cols int) (*fp8.Weight, error)
}

// memWeights is a weightSource over *Weights (checked against the config).
type memWeights struct{ w *Weights }

// part returns the values of part p (of routed expert e).
func (m memWeights) part(p weightPart, e int) []float32 {
	w := m.w
	switch p {
	case wRouter:
		return w.Router
	case wBias:
		return w.Bias
	case wGate:
		return w.Experts[e].Gate
	case wUp:
		return w.Experts[e].Up
	case wDown:
		return w.Experts[e].Down
	case wSharedGateProj:
		return w.Shared.Gate
	case wSharedUpProj:
		return w.Shared.Up
	case wSharedDownProj:
		return w.Shared.Down
	case wSharedExpertGate:
		return w.SharedGate
	}
	panic(fmt.Sprintf("moe: unknown weight part %d", p))
}

// upload converts each copy's values to its dtype (bf16 rounds to nearest
// even) and copies them, one copy at a time, on the calling goroutine.
func (m memWeights) upload(e *env, copies []weightCopy) error {
	for i := range copies {
		c := &copies[i]
		v := m.part(c.part, c.expert)
		if c.full() {
			v = v[c.r0*c.cols : c.r1*c.cols]
		} else {
			w := make([]float32, 0, (c.r1-c.r0)*(c.c1-c.c0))
			for r := c.r0; r < c.r1; r++ {
				w = append(w, v[r*c.cols+c.c0:r*c.cols+c.c1]...)
			}
			v = w
		}
		b := f32Bytes(v)
		if !c.f32 {
			b = e.encode(v)
		}
		if err := c.dst.CopyFromHost(b); err != nil {
			return err
		}
	}
	return nil
}

// fp8Weight of memWeights quantizes part p (of routed expert e), rows x cols,
// in 128x128 blocks (fp8.Quantize).
func (m memWeights) fp8Weight(p weightPart, e, rows, cols int) (*fp8.Weight, error) {
	w, err := fp8.Quantize(m.part(p, e), rows, cols, [2]int{fp8.BlockSize, fp8.BlockSize})
	if err != nil && p >= wSharedGateProj {
		return nil, fmt.Errorf("%s: %w", p, err)
	} else if err != nil {
		return nil, fmt.Errorf("%s of expert %d: %w", p, e, err)
	}
	return w, nil
}

// String names a weight part in errors.
func (p weightPart) String() string {
	names := [...]string{"router", "correction bias", "gate_proj", "up_proj", "down_proj",
		"shared gate_proj", "shared up_proj", "shared down_proj", "shared_expert_gate"}
	if int(p) < len(names) {
		return names[p]
	}
	return fmt.Sprintf("weightPart(%d)", p)
}

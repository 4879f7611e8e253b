package moe

// planRecorder keeps the plan of the last forward of a layer (tests).
type planRecorder struct{ last plan }

// recordPlans has l record each forward's plan; change, if not nil, may
// change the plan first (as a test-only knob, e.g. early = 0: the up kernel
// reads the fused shared rows from the sort after its wait, like the others).
func recordPlans(l *Layer, change func(*plan)) *planRecorder {
	r := &planRecorder{}
	l.hook = func(p *plan) {
		if change != nil {
			change(p)
		}
		r.last = *p
	}
	return r
}

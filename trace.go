package gpuctx

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Tracer records a timeline of the work queued on one device's streams, for
// viewing in ui.perfetto.dev or chrome://tracing: one track per stream, one
// span per kernel launch, copy, memset, BLAS library call and graph launch,
// and one flow arrow per fork/join (an Event recorded on one stream that
// another stream waits on).
//
// Tracing is opt-in: attach a Tracer with Device.SetTracer. While none is
// attached every traced operation costs one atomic pointer load. While one is
// attached, each operation is bracketed by two timing events recorded on its
// stream, so spans carry device timestamps (CUDA: GPU time, about 0.5 us
// resolution; CPU backend: the wall clock when the stream's goroutine reached
// each event). Recording events adds a few microseconds of host time per
// operation and keeps every event until WriteJSON, so trace a few forwards,
// not a benchmark loop.
//
// Work queued on a stream that is being captured into a Graph is not traced
// (it does not run); a Graph.Launch is traced as one span named
// "graph (N nodes)": a CUDA graph replay runs its kernels on the device without
// the host seeing them, so they cannot be bracketed one by one. To see the
// kernels, run the work eagerly while tracing.
//
// All methods are safe for concurrent use.
type Tracer struct {
	mu      sync.Mutex
	dev     *Device
	base    hal.Event // time zero: recorded before the first traced operation
	spans   []*traceSpan
	marks   map[*Event]*traceSpan // the latest traced Record of each event
	flows   []traceFlow
	meta    map[string]string
	names   map[uint64]string // stream track names
	events  []hal.Event       // every event made, destroyed by Close
	dropped int               // operations whose events could not be recorded
	closed  bool
}

// traceSpan is one operation on one stream between two timing events.
type traceSpan struct {
	name, cat  string
	tid        uint64
	start, end hal.Event
	args       map[string]any
	keep       bool // record marks are written only when some stream waited on them
}

// traceFlow links a Record span (from) to a Wait span (to).
type traceFlow struct {
	id       int
	from, to *traceSpan
}

// NewTracer returns a Tracer attached to no device.
func NewTracer() *Tracer {
	return &Tracer{marks: map[*Event]*traceSpan{}, meta: map[string]string{}, names: map[uint64]string{}}
}

// SetTracer attaches t to d: from now on work queued on d's streams is traced
// into t. A nil t detaches the current tracer (the spans already recorded stay
// in it). A Tracer belongs to one device: attaching it to a second is ErrInvalid.
func (d *Device) SetTracer(t *Tracer) error {
	if err := d.check("Device.SetTracer"); err != nil {
		return err
	}
	if t != nil {
		t.mu.Lock()
		switch {
		case t.closed:
			t.mu.Unlock()
			return fmt.Errorf("gpuctx: Device.SetTracer: tracer: %w", ErrClosed)
		case t.dev != nil && t.dev != d:
			t.mu.Unlock()
			return fmt.Errorf("gpuctx: Device.SetTracer: the tracer belongs to device %d: %w", t.dev.info.Index, ErrInvalid)
		}
		t.dev = d
		t.mu.Unlock()
	}
	d.tracer.Store(t)
	return nil
}

// Tracer returns the tracer attached to d, or nil.
func (d *Device) Tracer() *Tracer { return d.tracer.Load() }

// SetMetadata adds key: value to the trace's metadata ("otherData" in the
// JSON), for example how the traced work was run.
func (t *Tracer) SetMetadata(key, value string) {
	t.mu.Lock()
	t.meta[key] = value
	t.mu.Unlock()
}

// NameStream names s's track in the trace (default "stream <ID>").
func (t *Tracer) NameStream(s *Stream, name string) {
	t.mu.Lock()
	t.names[s.ID()] = name
	t.mu.Unlock()
}

// capturing reports whether s's work is being recorded into a graph.
func (s *Stream) capturing() bool { return s.dev.blas.spaces.Capturing(s) }

// mark records a new timing event on s (s read-locked by the caller). On
// failure it returns nil and counts the operation as dropped.
func (t *Tracer) mark(s *Stream) hal.Event {
	ev, err := s.dev.hd.NewEvent(true)
	if err == nil {
		if err = ev.Record(s.hs); err != nil {
			_ = ev.Destroy()
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil || t.closed {
		t.dropped++
		if err == nil {
			_ = ev.Destroy()
		}
		return nil
	}
	t.events = append(t.events, ev)
	return ev
}

// begin records the start of an operation named name on s (s read-locked by
// the caller) and returns the function that records its end, to be called
// once the operation has been queued. It records nothing on a capturing
// stream.
func (t *Tracer) begin(s *Stream, name, cat string, args map[string]any) func() {
	if s.capturing() {
		return func() {}
	}
	t.ensureBase(s)
	start := t.mark(s)
	if start == nil {
		return func() {}
	}
	return func() {
		end := t.mark(s)
		if end == nil {
			return
		}
		t.mu.Lock()
		t.spans = append(t.spans, &traceSpan{name: name, cat: cat, tid: s.ID(), start: start, end: end, args: args, keep: true})
		t.mu.Unlock()
	}
}

// ensureBase records time zero on s before the first traced operation.
func (t *Tracer) ensureBase(s *Stream) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.base != nil || t.closed {
		return
	}
	ev, err := s.dev.hd.NewEvent(true)
	if err != nil {
		return
	}
	if err := ev.Record(s.hs); err != nil {
		_ = ev.Destroy()
		return
	}
	t.base = ev
	t.events = append(t.events, ev)
}

// recorded notes that e was recorded on s (s read-locked by the caller): a
// stream that later waits on e draws a flow from here.
func (t *Tracer) recorded(e *Event, s *Stream) {
	if s.capturing() {
		t.mu.Lock()
		delete(t.marks, e)
		t.mu.Unlock()
		return
	}
	t.ensureBase(s)
	m := t.mark(s)
	t.mu.Lock()
	defer t.mu.Unlock()
	if m == nil {
		delete(t.marks, e)
		return
	}
	sp := &traceSpan{name: "event record", cat: "sync", tid: s.ID(), start: m, end: m}
	t.spans = append(t.spans, sp)
	t.marks[e] = sp
}

// waitBegin is begin for Stream.Wait: the span covers the time s spent
// blocked on e, and a flow joins it to e's latest traced Record.
func (t *Tracer) waitBegin(s *Stream, e *Event) func() {
	t.mu.Lock()
	from := t.marks[e]
	t.mu.Unlock()
	if from == nil || from.tid == s.ID() || s.capturing() { // a wait on its own stream's event is a no-op
		return func() {}
	}
	start := t.mark(s)
	if start == nil {
		return func() {}
	}
	return func() {
		end := t.mark(s)
		if end == nil {
			return
		}
		t.mu.Lock()
		defer t.mu.Unlock()
		to := &traceSpan{name: "stream wait", cat: "sync", tid: s.ID(), start: start, end: end, keep: true,
			args: map[string]any{"from stream": from.tid}}
		from.keep = true
		t.spans = append(t.spans, to)
		t.flows = append(t.flows, traceFlow{id: len(t.flows) + 1, from: from, to: to})
	}
}

// Range opens a span named name on s's track that encloses the work queued on
// s until the returned function is called (call it once, after queueing that
// work, from any goroutine), for labelling a step such as one forward. It
// queues two timing events on s; on a capturing or closed stream it records
// nothing.
func (t *Tracer) Range(s *Stream, name string) (end func()) {
	unlock, err := s.use("Tracer.Range")
	if err != nil {
		return func() {}
	}
	begin := t.begin(s, name, "range", nil)
	unlock()
	return func() {
		if unlock, err := s.use("Tracer.Range"); err == nil {
			begin()
			unlock()
		}
	}
}

// traceEvent is one entry of the trace-event format's traceEvents array.
type traceEvent struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat,omitempty"`
	Ph   string         `json:"ph"`
	Ts   float64        `json:"ts"`
	Dur  *float64       `json:"dur,omitempty"`
	Pid  int            `json:"pid"`
	Tid  uint64         `json:"tid"`
	ID   int            `json:"id,omitempty"`
	BP   string         `json:"bp,omitempty"`
	Args map[string]any `json:"args,omitempty"`
}

// WriteJSON writes the trace in the Chrome trace-event JSON format
// ({"traceEvents": [...], "otherData": {...}}), which ui.perfetto.dev and
// chrome://tracing open. It blocks the host until every traced operation has
// completed on the device (it reads their events), so call it after the work;
// it does not detach t. Timestamps are microseconds from the earliest span.
func (t *Tracer) WriteJSON(w io.Writer) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("gpuctx: Tracer.WriteJSON: %w", ErrClosed)
	}
	out, lo, err := t.timeSpans()
	if err != nil {
		return err
	}
	pid, evs := t.trackEvents(out)
	// By start, and an enclosing span (a Range) before the spans it encloses.
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].start != out[j].start {
			return out[i].start < out[j].start
		}
		return out[i].end > out[j].end
	})
	pos := make(map[*traceSpan]int, len(out))
	for i, o := range out {
		pos[o.sp] = i
	}
	flowEvs, anchor := t.flowEvents(out, pos, pid, lo)
	for _, o := range out {
		if o.sp.name == "event record" && !anchor[o.sp] {
			continue
		}
		dur := o.end - o.start
		evs = append(evs, traceEvent{Name: o.sp.name, Cat: o.sp.cat, Ph: "X", Ts: o.start - lo, Dur: &dur,
			Pid: pid, Tid: o.sp.tid, Args: o.sp.args})
	}
	evs = append(evs, flowEvs...)
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	if err := enc.Encode(struct {
		TraceEvents     []traceEvent      `json:"traceEvents"`
		DisplayTimeUnit string            `json:"displayTimeUnit"`
		OtherData       map[string]string `json:"otherData"`
	}{evs, "ns", t.otherData()}); err != nil {
		return fmt.Errorf("gpuctx: Tracer.WriteJSON: %w", err)
	}
	return bw.Flush()
}

// timedSpan is a kept span with its start and end in microseconds from the
// tracer's base event.
type timedSpan struct {
	sp         *traceSpan
	start, end float64
}

// eventTime waits for ev and returns its time in microseconds from t.base.
func (t *Tracer) eventTime(ev hal.Event) (float64, error) {
	if err := ev.Synchronize(); err != nil {
		return 0, err
	}
	d, err := ev.Elapsed(t.base)
	if err != nil { // a backend that refuses a negative interval: measure it the other way
		if r, err2 := t.base.Elapsed(ev); err2 == nil {
			d, err = -r, nil
		}
	}
	return float64(d) / float64(time.Microsecond), err
}

// timeSpans reads the times of the kept spans (t.mu held), in recording
// order, and the earliest start (0 when there is none).
func (t *Tracer) timeSpans() (out []timedSpan, lo float64, err error) {
	lo = math.Inf(1)
	for _, sp := range t.spans {
		if !sp.keep {
			continue
		}
		s, err := t.eventTime(sp.start)
		if err != nil {
			return nil, 0, fmt.Errorf("gpuctx: Tracer.WriteJSON: reading the start of %s on stream %d: %w", sp.name, sp.tid, err)
		}
		e, err := t.eventTime(sp.end)
		if err != nil {
			return nil, 0, fmt.Errorf("gpuctx: Tracer.WriteJSON: reading the end of %s on stream %d: %w", sp.name, sp.tid, err)
		}
		out = append(out, timedSpan{sp, s, max(e, s)})
		lo = min(lo, s)
	}
	if len(out) == 0 {
		lo = 0
	}
	return out, lo, nil
}

// trackEvents returns the process ID and the metadata events that name the
// process (the device) and one track per stream of out, by stream ID.
func (t *Tracer) trackEvents(out []timedSpan) (pid int, evs []traceEvent) {
	devName := "device"
	if t.dev != nil {
		pid = t.dev.info.Index
		devName = fmt.Sprintf("%s device %d: %s", t.dev.Backend(), pid, t.dev.info.Name)
	}
	evs = append(evs, traceEvent{Name: "process_name", Ph: "M", Pid: pid, Args: map[string]any{"name": devName}})
	tids := map[uint64]bool{}
	for _, o := range out {
		tids[o.sp.tid] = true
	}
	ids := make([]uint64, 0, len(tids))
	for id := range tids {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	for i, id := range ids {
		name := t.names[id]
		if name == "" {
			name = fmt.Sprintf("stream %d", id)
		}
		evs = append(evs, traceEvent{Name: "thread_name", Ph: "M", Pid: pid, Tid: id, Args: map[string]any{"name": name}},
			traceEvent{Name: "thread_sort_index", Ph: "M", Pid: pid, Tid: id, Args: map[string]any{"sort_index": i}})
	}
	return pid, evs
}

// flowEvents returns the fork/join arrows of t.flows over out (sorted by
// start; pos maps each span to its index) and the "event record" spans that
// must be written because an arrow starts at them. A flow starts inside the
// operation that the recorded event follows (the producer: the last span of
// that track to end by the record) and ends inside the wait span just before
// the waiting stream was released. The zero-length "event record" span is
// written only where there is no producer to anchor the arrow to.
func (t *Tracer) flowEvents(out []timedSpan, pos map[*traceSpan]int, pid int, lo float64) ([]traceEvent, map[*traceSpan]bool) {
	var flowEvs []traceEvent
	anchor := map[*traceSpan]bool{}
	for _, f := range t.flows {
		rec, to := out[pos[f.from]], out[pos[f.to]]
		sTs := rec.start
		if prod := producer(out, pos[f.from]); prod >= 0 {
			sTs = (out[prod].start + out[prod].end) / 2
		} else {
			anchor[rec.sp] = true
		}
		fe := traceEvent{Name: "fork/join", Cat: "flow", Ph: "f", BP: "e", Ts: to.start + 0.99*(to.end-to.start) - lo, Pid: pid, Tid: f.to.tid, ID: f.id}
		if to.end <= to.start {
			fe.BP, fe.Ts = "", to.end-lo // binds to the next span of the waiting stream
		}
		flowEvs = append(flowEvs,
			traceEvent{Name: "fork/join", Cat: "flow", Ph: "s", Ts: sTs - lo, Pid: pid, Tid: f.from.tid, ID: f.id}, fe)
	}
	return flowEvs, anchor
}

// producer returns the index in out (sorted by start) of the span that the
// event record out[at] follows on its track: the latest to end, by the
// record's start, of the non-empty spans before it; -1 when there is none.
func producer(out []timedSpan, at int) int {
	rec := out[at]
	prod := -1
	for i := at - 1; i >= 0; i-- {
		if o := out[i]; o.sp.tid == rec.sp.tid && o.sp != rec.sp && o.sp.name != "event record" && o.end <= rec.start && o.end > o.start {
			if prod < 0 || o.end > out[prod].end {
				prod = i
			}
			if o.end < rec.start-1e3 { // spans are sorted by start: nothing later ends closer
				break
			}
		}
	}
	return prod
}

// otherData is the trace's metadata: the producer, t's metadata and the
// number of operations dropped (t.mu held).
func (t *Tracer) otherData() map[string]string {
	meta := map[string]string{"producer": "gpuctx"}
	for k, v := range t.meta {
		meta[k] = v
	}
	if t.dropped > 0 {
		meta["dropped operations"] = fmt.Sprint(t.dropped)
	}
	return meta
}

// WriteFile writes the trace (see WriteJSON) to the named file.
func (t *Tracer) WriteFile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("gpuctx: Tracer.WriteFile: %w", err)
	}
	if err := t.WriteJSON(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Spans returns how many operations t has recorded so far.
func (t *Tracer) Spans() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, sp := range t.spans {
		if sp.keep {
			n++
		}
	}
	return n
}

// Close detaches t from its device if attached, waits for the traced work and
// releases its events. Double Close is harmless.
func (t *Tracer) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	evs := t.events
	t.events, t.spans, t.flows, t.base = nil, nil, nil, nil
	t.marks = map[*Event]*traceSpan{}
	d := t.dev
	t.mu.Unlock()
	if d != nil {
		d.tracer.CompareAndSwap(t, nil)
	}
	if d != nil && d.check("Tracer.Close") != nil {
		return nil // Device.Close released everything of the device
	}
	var errs []error
	for _, ev := range evs {
		errs = append(errs, ev.Synchronize(), ev.Destroy())
	}
	return errors.Join(errs...)
}

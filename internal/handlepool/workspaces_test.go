package handlepool

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// fakeStream stands in for a stream; fakeEvent for an event recorded on one.
type fakeStream struct {
	id     int
	closed atomic.Bool
}

type fakeEvent struct {
	done      atomic.Bool
	destroyed atomic.Bool
}

func (e *fakeEvent) Record(hal.Stream) error                  { return nil }
func (e *fakeEvent) Synchronize() error                       { return nil }
func (e *fakeEvent) Query() (bool, error)                     { return e.done.Load(), nil }
func (e *fakeEvent) Elapsed(hal.Event) (time.Duration, error) { return 0, nil }
func (e *fakeEvent) Destroy() error                           { e.destroyed.Store(true); return nil }

// fakeMem is an allocator that knows which addresses are live and fails on
// a double free.
type fakeMem struct {
	mu       sync.Mutex
	next     hal.Ptr
	live     map[hal.Ptr]int
	failNext bool
	events   []*fakeEvent
	noEvent  bool // Event fails (the stream is closing)
}

func (m *fakeMem) config(size int) WorkspaceConfig[*fakeStream] {
	m.live, m.next = map[hal.Ptr]int{}, 0x1000
	return WorkspaceConfig[*fakeStream]{
		Size: size,
		Alloc: func(s *fakeStream, n int, what string) (hal.Ptr, error) {
			m.mu.Lock()
			defer m.mu.Unlock()
			if m.failNext {
				m.failNext = false
				return 0, fmt.Errorf("allocating %d bytes (%s) for stream %d: fake out of memory", n, what, s.id)
			}
			p := m.next
			m.next += hal.Ptr(n)
			m.live[p] = n
			return p, nil
		},
		Free: func(p hal.Ptr) error {
			m.mu.Lock()
			defer m.mu.Unlock()
			if _, ok := m.live[p]; !ok {
				return fmt.Errorf("free of %#x: not allocated", p)
			}
			delete(m.live, p)
			return nil
		},
		Event: func(s *fakeStream) (hal.Event, error) {
			m.mu.Lock()
			defer m.mu.Unlock()
			if m.noEvent || s.closed.Load() {
				return nil, errors.New("fake: stream closing")
			}
			e := &fakeEvent{}
			m.events = append(m.events, e)
			return e, nil
		},
		Closed: func(s *fakeStream) bool { return s.closed.Load() },
	}
}

func (m *fakeMem) nlive() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.live)
}

type fakeWS = Workspaces[*fakeStream, int]

func newWS(t *testing.T, size int) (*fakeWS, *fakeMem) {
	t.Helper()
	m := &fakeMem{}
	w := new(fakeWS)
	w.Init(m.config(size))
	return w, m
}

func mustFor(t *testing.T, w *fakeWS, s *fakeStream) *Workspace {
	t.Helper()
	x, err := w.For(s)
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func overlap(a, b *Workspace) bool {
	return a.Ptr < b.Ptr+hal.Ptr(b.Size) && b.Ptr < a.Ptr+hal.Ptr(a.Size)
}

// Each stream has its own workspace, kept across calls; no two overlap.
func TestWorkspacePerStream(t *testing.T) {
	w, m := newWS(t, 1000)
	s1, s2 := &fakeStream{id: 1}, &fakeStream{id: 2}
	a, b := mustFor(t, w, s1), mustFor(t, w, s2)
	if a == b || overlap(a, b) {
		t.Fatalf("two streams share workspace memory: %+v %+v", a, b)
	}
	if a.Size != 1024 {
		t.Errorf("size %d, want 1000 rounded up to 1024", a.Size)
	}
	if again := mustFor(t, w, s1); again != a {
		t.Errorf("stream 1 got a new workspace on its second call")
	}
	if n, _, _ := w.Counts(); n != 2 || w.Eager(s1) != a {
		t.Errorf("counts %d / eager %v, want 2 / stream 1's", n, w.Eager(s1))
	}
	e := w.Epoch()
	if err := w.StreamClosed(s1); err != nil {
		t.Fatal(err)
	}
	if w.Epoch() == e {
		t.Error("closing a stream did not change the epoch")
	}
	if n, _, _ := w.Counts(); n != 1 || m.nlive() != 1 {
		t.Errorf("after closing stream 1: %d workspaces, %d live allocations; want 1, 1", n, m.nlive())
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if m.nlive() != 0 {
		t.Errorf("%d allocations left after Close", m.nlive())
	}
}

func TestWorkspaceAllocError(t *testing.T) {
	w, m := newWS(t, 256)
	m.failNext = true
	s := &fakeStream{id: 7}
	if _, err := w.For(s); err == nil {
		t.Fatal("no error from a failing allocator")
	}
	if n, _, _ := w.Counts(); n != 0 {
		t.Fatalf("a failed allocation left %d workspaces", n)
	}
	mustFor(t, w, s) // the next call retries
}

// A cuBLASLt workspace only grows; a grown-out one is retired by the last
// LtExit with an event on its stream and freed once that event completes.
func TestLtGrowRetireSweep(t *testing.T) {
	w, m := newWS(t, 256)
	s := &fakeStream{id: 1}
	w.LtEnter(s)
	small, err := w.Lt(s, 0)
	if err != nil || small.Size != 256 {
		t.Fatalf("Lt(0) = %+v, %v; want the 256-byte default", small, err)
	}
	if x, _ := w.Lt(s, 100); x != small {
		t.Error("Lt(100) grew a 256-byte workspace")
	}
	big, err := w.Lt(s, 4096)
	if err != nil || big.Size != 4096 || overlap(big, small) {
		t.Fatalf("Lt(4096) = %+v, %v", big, err)
	}
	w.LtEnter(s) // a second callback on s
	if err := w.LtExit(s); err != nil {
		t.Fatal(err)
	}
	if len(m.events) != 0 || m.nlive() != 2 {
		t.Fatalf("retired while a callback was still active (%d events, %d live)", len(m.events), m.nlive())
	}
	if err := w.LtExit(s); err != nil {
		t.Fatal(err)
	}
	if _, lt, ret := w.Counts(); len(m.events) != 1 || lt != 1 || ret != 1 {
		t.Fatalf("after the last exit: %d events, %d Lt, %d retired; want 1, 1, 1", len(m.events), lt, ret)
	}
	if m.nlive() != 2 {
		t.Fatal("freed before the stream passed its work")
	}
	if n := w.Bytes(s); n != 256+4096 {
		t.Errorf("Bytes = %d with the retired one, want %d", n, 256+4096)
	}
	m.events[0].done.Store(true)
	w.LtEnter(s)
	if err := w.LtExit(s); err != nil { // sweeps
		t.Fatal(err)
	}
	if _, _, ret := w.Counts(); ret != 0 || m.nlive() != 1 || !m.events[0].destroyed.Load() {
		t.Fatalf("after the event completed: %d retired, %d live, event destroyed %v", ret, m.nlive(), m.events[0].destroyed.Load())
	}
	if x, _ := w.Lt(s, 0); x != big {
		t.Error("the grown workspace was not kept")
	}
	if n := w.Bytes(s); n != 4096 {
		t.Errorf("Bytes = %d after the sweep, want 4096", n)
	}
	if err := w.StreamClosed(s); err != nil {
		t.Fatal(err)
	}
	if m.nlive() != 0 || w.Bytes(s) != 0 {
		t.Errorf("%d allocations (Bytes %d) left after closing the stream", m.nlive(), w.Bytes(s))
	}
}

// When no event can be recorded (the stream is closing), grown-out workspaces
// wait for StreamClosed, which frees them; none is freed twice.
func TestLtRetireOnClosingStream(t *testing.T) {
	w, m := newWS(t, 256)
	s := &fakeStream{id: 1}
	w.LtEnter(s)
	if _, err := w.Lt(s, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Lt(s, 1024); err != nil {
		t.Fatal(err)
	}
	m.noEvent = true
	if err := w.LtExit(s); err != nil {
		t.Fatal(err)
	}
	if m.nlive() != 2 {
		t.Fatalf("%d live, want 2 (the old one kept for StreamClosed)", m.nlive())
	}
	s.closed.Store(true)
	if err := w.StreamClosed(s); err != nil {
		t.Fatal(err)
	}
	if m.nlive() != 0 {
		t.Errorf("%d allocations left", m.nlive())
	}
	w.LtEnter(s) // after StreamClosed: keeps no entry for the closed stream
	if _, lt, _ := w.Counts(); lt != 0 {
		t.Errorf("LtEnter on a closed stream made an entry")
	}
}

// Close frees retired workspaces whatever their events say (the device is idle).
func TestCloseFreesRetired(t *testing.T) {
	w, m := newWS(t, 256)
	s := &fakeStream{id: 1}
	w.LtEnter(s)
	_, _ = w.Lt(s, 0)
	_, _ = w.Lt(s, 2048)
	_ = w.LtExit(s)
	if _, _, ret := w.Counts(); ret != 1 {
		t.Fatalf("%d retired, want 1", ret)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if m.nlive() != 0 || !m.events[0].destroyed.Load() {
		t.Errorf("%d live after Close; event destroyed %v", m.nlive(), m.events[0].destroyed.Load())
	}
}

// During a capture the capturing stream and the streams that join it get the
// capture's own workspaces (one per stream), never their eager ones; the
// graph owns them after EndCapture and they outlive the streams.
func TestCaptureWorkspaces(t *testing.T) {
	w, m := newWS(t, 512)
	main, side, other := &fakeStream{id: 1}, &fakeStream{id: 2}, &fakeStream{id: 3}
	eagerMain, eagerSide := mustFor(t, w, main), mustFor(t, w, side)
	e := w.Epoch()
	if !w.BeginCapture(main) {
		t.Fatal("BeginCapture refused")
	}
	if w.BeginCapture(main) {
		t.Fatal("a second BeginCapture on the same stream was accepted")
	}
	if w.Epoch() == e {
		t.Error("BeginCapture did not change the epoch")
	}
	capMain := mustFor(t, w, main)
	if capMain == eagerMain || overlap(capMain, eagerMain) {
		t.Fatal("a captured call got the stream's eager workspace")
	}
	// side joins the capture by waiting on an event recorded on main.
	w.NoteRecord(10, main)
	w.NoteRecord(11, other)
	w.NoteWait(side, 10)
	w.NoteWait(other, 11) // recorded outside the capture: no join
	capSide := mustFor(t, w, side)
	if capSide == eagerSide || capSide == capMain || overlap(capSide, capMain) {
		t.Fatal("the joined stream did not get a capture workspace of its own")
	}
	if mustFor(t, w, other) == capMain {
		t.Fatal("a stream outside the capture got its workspace")
	}
	ltCap, err := w.Lt(side, 0)
	if err != nil {
		t.Fatal(err)
	}
	ltCap2, _ := w.Lt(side, 4096) // grown: the graph keeps both
	if ltCap2 == ltCap {
		t.Fatal("no growth")
	}
	if got := w.EndCapture(side); got != nil {
		t.Fatal("EndCapture on a joined stream ended the capture")
	}
	if n := w.Bytes(side); n != eagerSide.Size {
		t.Errorf("Bytes(side) = %d during the capture, want its eager %d only", n, eagerSide.Size)
	}
	ws := w.EndCapture(main)
	if len(ws) != 4 {
		t.Fatalf("the graph got %d workspaces, want 4 (two cuBLAS, two cuBLASLt)", len(ws))
	}
	if n := LiveBytes(ws); n != 3*512+4096 {
		t.Errorf("LiveBytes of the graph's workspaces = %d, want %d", n, 3*512+4096)
	}
	if mustFor(t, w, main) != eagerMain || mustFor(t, w, side) != eagerSide {
		t.Fatal("after EndCapture the streams do not get their eager workspaces back")
	}
	// The streams close; the graph's workspaces stay until Release.
	for _, s := range []*fakeStream{main, side, other} {
		if err := w.StreamClosed(s); err != nil {
			t.Fatal(err)
		}
	}
	if m.nlive() != 4 {
		t.Fatalf("%d live after closing the streams, want the graph's 4", m.nlive())
	}
	if err := w.Release(ws); err != nil {
		t.Fatal(err)
	}
	if err := w.Release(ws); err != nil {
		t.Fatalf("a second Release: %v", err)
	}
	if n := LiveBytes(ws); n != 0 {
		t.Errorf("LiveBytes = %d after Release", n)
	}
	if m.nlive() != 0 {
		t.Errorf("%d live after Release", m.nlive())
	}
}

// A capture whose origin stream closes can never end: its workspaces are
// freed with the stream.
func TestCaptureOriginClosed(t *testing.T) {
	w, m := newWS(t, 256)
	s := &fakeStream{id: 1}
	w.BeginCapture(s)
	mustFor(t, w, s)
	if err := w.StreamClosed(s); err != nil {
		t.Fatal(err)
	}
	if m.nlive() != 0 {
		t.Errorf("%d live after the capturing stream closed", m.nlive())
	}
	if ws := w.EndCapture(s); ws != nil {
		t.Error("EndCapture after the stream closed returned workspaces")
	}
}

// Streams used from many goroutines at once never share a workspace (run with
// -race); closing streams meanwhile frees exactly what they held.
func TestWorkspacesConcurrent(t *testing.T) {
	w, m := newWS(t, 256)
	const n = 8
	streams := make([]*fakeStream, n)
	for i := range streams {
		streams[i] = &fakeStream{id: i + 1}
	}
	got := make([]*Workspace, n)
	var wg sync.WaitGroup
	for i, s := range streams {
		wg.Go(func() {
			for range 200 {
				x, err := w.For(s)
				if err != nil {
					t.Error(err)
					return
				}
				if got[i] != nil && got[i] != x {
					t.Errorf("stream %d changed workspace", s.id)
				}
				got[i] = x
				w.LtEnter(s)
				if _, err := w.Lt(s, 256); err != nil {
					t.Error(err)
				}
				if err := w.LtExit(s); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	for i := range got {
		for j := i + 1; j < n; j++ {
			if overlap(got[i], got[j]) {
				t.Fatalf("streams %d and %d share workspace memory", i+1, j+1)
			}
		}
	}
	for _, s := range streams {
		wg.Go(func() {
			if err := w.StreamClosed(s); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if m.nlive() != 0 {
		t.Errorf("%d allocations left after closing every stream", m.nlive())
	}
}

package handlepool

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// fakeHandle stands in for a cuBLAS handle: it records the stream it is bound
// to and whether it was destroyed.
type fakeHandle struct {
	id        int
	stream    uint64 // bound stream (0: none)
	closed    bool   // the bound stream was closed
	destroyed bool
}

type fakeLib struct {
	made atomic.Int64
	fail atomic.Bool
}

func (l *fakeLib) config(limit int, done <-chan struct{}) Config[fakeHandle] {
	return Config[fakeHandle]{
		Limit: limit,
		Done:  done,
		New: func(h *fakeHandle) error {
			if l.fail.Load() {
				return errors.New("fake: out of handles")
			}
			h.id = int(l.made.Add(1))
			return nil
		},
		Destroy: func(h *fakeHandle) error { h.destroyed = true; return nil },
		Stale:   func(h *fakeHandle) bool { return h.stream == 0 || h.closed },
	}
}

// bind binds sl to stream id as gpuctx does: under the slot's lock.
func bind(sl *Slot[fakeHandle], id uint64) {
	sl.Handle.stream, sl.Handle.closed = id, false
	sl.SetBoundID(id)
}

func newPool(t *testing.T, limit int) (*Pool[fakeHandle], *fakeLib, chan struct{}) {
	t.Helper()
	lib, done := &fakeLib{}, make(chan struct{})
	p := new(Pool[fakeHandle])
	p.Init(lib.config(limit, done))
	return p, lib, done
}

func TestAcquirePrefersBoundHandle(t *testing.T) {
	p, lib, _ := newPool(t, 4)
	// Two streams, one after the other: each gets a handle of its own, and
	// then always the same one, with no rebind.
	ids := map[uint64]int{}
	for range 3 {
		for _, s := range []uint64{1, 2} {
			sl, info, err := p.Acquire(s)
			if err != nil {
				t.Fatal(err)
			}
			if sl.BoundID() != s {
				if !info.Created {
					t.Fatalf("stream %d: a rebind of handle %d while under the limit", s, sl.Handle.id)
				}
				bind(sl, s)
			}
			if prev, ok := ids[s]; ok && prev != sl.Handle.id {
				t.Fatalf("stream %d: handle %d, then %d", s, prev, sl.Handle.id)
			}
			ids[s] = sl.Handle.id
			p.Release(sl)
		}
	}
	if n := lib.made.Load(); n != 2 {
		t.Fatalf("made %d handles for 2 streams, want 2", n)
	}
}

func TestAcquireRebindsStaleFirst(t *testing.T) {
	p, lib, _ := newPool(t, 2)
	a, _, _ := p.Acquire(1)
	bind(a, 1)
	b, _, _ := p.Acquire(2)
	bind(b, 2)
	b.Handle.closed = true // stream 2 closed
	p.Release(a)
	p.Release(b)
	sl, info, err := p.Acquire(3)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release(sl)
	if info.Created || lib.made.Load() != 2 {
		t.Fatalf("created a handle over the limit")
	}
	if sl != b {
		t.Fatalf("rebound the live stream's handle, not the closed stream's")
	}
}

func TestAcquireNewFails(t *testing.T) {
	p, lib, _ := newPool(t, 1)
	lib.fail.Store(true)
	if _, _, err := p.Acquire(1); err == nil {
		t.Fatal("Acquire succeeded although New failed")
	}
	lib.fail.Store(false)
	// The failed Acquire gave its token back.
	sl, _, err := p.Acquire(1)
	if err != nil {
		t.Fatal(err)
	}
	p.Release(sl)
}

func TestAcquireAfterDone(t *testing.T) {
	p, _, done := newPool(t, 1)
	sl, _, err := p.Acquire(1)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, _, err := p.Acquire(1) // waits: the only handle is held
		errc <- err
	}()
	close(done)
	if err := <-errc; !errors.Is(err, hal.ErrClosed) {
		t.Fatalf("waiter after Done: %v, want ErrClosed", err)
	}
	p.Release(sl)
	if _, _, err := p.Acquire(1); !errors.Is(err, hal.ErrClosed) {
		t.Fatalf("Acquire after Done: %v, want ErrClosed", err)
	}
	if n := len(p.Drain()); n != 1 {
		t.Fatalf("Drain returned %d slots, want 1", n)
	}
}

// TestPoolReleaseBeforeWaiterSleeps places a release exactly in the window that
// lost wakeups with the old Cond and counter: a caller has found no free handle
// (limit 1, held by another caller) and, before it goes to sleep, the holder
// releases. The caller must still get the handle; the deadline fails the test
// instead of hanging.
func TestPoolReleaseBeforeWaiterSleeps(t *testing.T) {
	p, _, _ := newPool(t, 1)
	holder, _, err := p.Acquire(1)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	testHookBeforeWait = func() {
		once.Do(func() { p.Release(holder) }) // the holder is gone before this caller sleeps
	}
	defer func() { testHookBeforeWait = nil }()
	done := make(chan error, 1)
	go func() {
		sl, _, err := p.Acquire(1)
		if err == nil {
			p.Release(sl)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting caller was never woken: lost wakeup")
	}
}

// TestPoolBound: many goroutines on few handles never hold one handle at once,
// never exceed the limit, and all finish (no lost wakeup), across limit changes.
func TestPoolBound(t *testing.T) {
	for _, limit := range []int{1, 2, 3} {
		p, lib, _ := newPool(t, limit)
		var inUse [16]atomic.Int32
		var wg sync.WaitGroup
		for g := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 200 {
					s := uint64(g%4 + 1)
					sl, _, err := p.Acquire(s)
					if err != nil {
						t.Error(err)
						return
					}
					if inUse[sl.Handle.id].Add(1) != 1 {
						t.Errorf("handle %d lent twice at once", sl.Handle.id)
					}
					if sl.BoundID() != s {
						bind(sl, s)
					}
					inUse[sl.Handle.id].Add(-1)
					p.Release(sl)
					if g == 0 && i == 100 {
						p.SetLimit(limit + 1)
					}
				}
			}()
		}
		wg.Wait()
		if n := lib.made.Load(); n > int64(limit+1) {
			t.Fatalf("limit %d: made %d handles", limit, n)
		}
	}
}

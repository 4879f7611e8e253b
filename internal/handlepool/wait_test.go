package handlepool

import (
	"sync/atomic"
	"testing"
)

// Config.Wait runs, on the waiting goroutine, each time Acquire finds no free
// handle and is about to wait, and never on a path that does not wait: it is
// the sync point that lets a test know a caller is blocked on the pool (the
// binding contract tests of package gpuctx use it instead of timing). The
// package's own hook at the same point tells this test when to release.
func TestConfigWaitRunsBeforeWaiting(t *testing.T) {
	lib, done := &fakeLib{}, make(chan struct{})
	var waits atomic.Int64
	cfg := lib.config(1, done)
	cfg.Wait = func() { waits.Add(1) }
	p := new(Pool[fakeHandle])
	p.Init(cfg)
	held, _, err := p.Acquire(1)
	if err != nil {
		t.Fatal(err)
	}
	if n := waits.Load(); n != 0 {
		t.Fatalf("Wait ran %d times for an Acquire that did not wait", n)
	}
	about := make(chan struct{})
	testHookBeforeWait = func() { close(about) }
	defer func() { testHookBeforeWait = nil }()
	type got struct {
		sl  *Slot[fakeHandle]
		err error
	}
	res := make(chan got, 1)
	go func() {
		sl, _, err := p.Acquire(2)
		res <- got{sl, err}
	}()
	<-about // the second caller is about to wait: release the handle it waits for
	p.Release(held)
	r := <-res
	if r.err != nil || r.sl != held {
		t.Fatalf("second Acquire: slot %p (want %p), err %v", r.sl, held, r.err)
	}
	p.Release(r.sl)
	if n := waits.Load(); n != 1 {
		t.Errorf("Wait ran %d times for one Acquire that waited, want 1", n)
	}
}

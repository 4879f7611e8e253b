package gpuctx

import (
	"sync"
	"testing"
	"time"
)

// TestPoolReleaseBeforeWaiterSleeps places a release exactly in the window that
// lost wakeups with the old Cond and counter: a caller has found no free handle
// (limit 1, held by another callback) and, before it goes to sleep, the holder
// releases. The caller must still get the handle; the deadline fails the test
// instead of hanging.
func TestPoolReleaseBeforeWaiterSleeps(t *testing.T) {
	rt, err := OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetBlasHandleLimit(1); err != nil {
		t.Fatal(err)
	}
	c, err := d.NewContext(ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	holding, releaseNow, released := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	testHookBeforeWait = func() {
		once.Do(func() {
			close(releaseNow) // the holder returns its handle now ...
			<-released        // ... and is gone before this caller sleeps
		})
	}
	defer func() { testHookBeforeWait = nil }()
	go func() {
		_ = c.Blas(func(Blas) error {
			close(holding)
			<-releaseNow
			return nil
		})
		close(released)
	}()
	<-holding
	done := make(chan error, 1)
	go func() { done <- c.Blas(func(Blas) error { return nil }) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting callback was never woken: lost wakeup")
	}
}

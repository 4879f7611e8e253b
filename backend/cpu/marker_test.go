package cpu

import "testing"

// Once an event is seen complete, every earlier item of the stream it was
// recorded on is complete too (CUDA semantics). The CPU backend used to close
// the event before counting the item, so a stream that waited on the event could
// finish while the recording stream still reported work in flight.
func TestEventCompletesWithItsStream(t *testing.T) {
	d := newTestDevice(t)
	for i := range 300 {
		a, b := newTestStream(t, d), newTestStream(t, d)
		e, err := d.NewEvent(false)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Record(a); err != nil {
			t.Fatal(err)
		}
		if err := b.Wait(e); err != nil {
			t.Fatal(err)
		}
		if err := b.Synchronize(); err != nil {
			t.Fatal(err)
		}
		if done, err := a.Query(); err != nil || !done {
			t.Fatalf("iteration %d: the event recorded on A completed, yet A.Query = %v, %v", i, done, err)
		}
		if err := a.Synchronize(); err != nil {
			t.Fatal(err)
		}
		if done, err := e.Query(); err != nil || !done {
			t.Fatalf("iteration %d: A synchronised, yet its event reports %v, %v", i, done, err)
		}
	}
}

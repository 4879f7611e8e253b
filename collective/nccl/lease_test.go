package nccl

import (
	"errors"
	"runtime"
	"sync"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// call is one ncclSend or ncclRecv the fake library saw.
type call struct {
	op         string
	ptr, count uintptr
	peer       int32
}

// fakeLib is an NCCL whose group calls run the hooks and record the
// send/recv calls, for tests of the Comm's leases on the CPU backend.
func fakeLib(calls *[]call, inGroup func()) *Lib {
	l := &Lib{}
	l.s.ncclGroupStart = func() int32 { return 0 }
	l.s.ncclGroupEnd = func() int32 { inGroup(); return 0 }
	l.s.ncclSend = func(p, n uintptr, _ int32, peer int32, _, _ uintptr) int32 {
		*calls = append(*calls, call{"send", p, n, peer})
		return 0
	}
	l.s.ncclRecv = func(p, n uintptr, _ int32, peer int32, _, _ uintptr) int32 {
		*calls = append(*calls, call{"recv", p, n, peer})
		return 0
	}
	l.s.ncclCommDestroy = func(uintptr) int32 { return 0 }
	return l
}

// TestAllToAllVLeases: while the NCCL calls of an AllToAllV run, Free of its
// buffers fails with ErrInvalid (every run) and a Close of its stream returns
// only after the calls; the calls get the buffers' addresses at the right
// displacements.
func TestAllToAllVLeases(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	send, err := d.Alloc(96)
	if err != nil {
		t.Fatal(err)
	}
	recv, err := d.Alloc(96)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var order []string
	mark := func(s string) { mu.Lock(); order = append(order, s); mu.Unlock() }
	closed := make(chan error, 1)
	var calls []call
	lib := fakeLib(&calls, func() {
		for name, b := range map[string]*gpuctx.Buffer{"send": send, "recv": recv} {
			if err := b.Free(); !errors.Is(err, gpuctx.ErrInvalid) {
				t.Errorf("Free of %s during the NCCL calls = %v, want ErrInvalid", name, err)
			}
		}
		go func() {
			err := s.Close()
			mark("stream closed")
			closed <- err
		}()
		for range 100 {
			runtime.Gosched() // give a Close that does not wait every chance to finish first
		}
		mark("group ended")
	})
	own, err := d.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := &Comm{lib: lib, dev: d, rank: 0, size: 2, own: own}
	if err := c.AllToAllV(send, []int{32, 64}, recv, []int{16, 80}, s); err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if order[0] != "group ended" {
		t.Errorf("order %q: the stream closed while the NCCL calls ran", order)
	}
	sp, _ := send.Ptr()
	rp, _ := recv.Ptr()
	want := []call{{"send", uintptr(sp), 32, 0}, {"recv", uintptr(rp), 16, 0}, {"send", uintptr(sp) + 32, 64, 1}, {"recv", uintptr(rp) + 16, 80, 1}}
	if len(calls) != len(want) {
		t.Fatalf("calls %v, want %v", calls, want)
	}
	for i := range want {
		if calls[i] != want[i] {
			t.Errorf("call %d = %+v, want %+v", i, calls[i], want[i])
		}
	}
	if err := errors.Join(send.Free(), recv.Free(), c.Close()); err != nil {
		t.Errorf("after the exchange: %v", err)
	}
}

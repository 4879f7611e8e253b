package gpuctx

import (
	"errors"
	"runtime"
	"testing"
)

func cpuDevice(t *testing.T) *Device {
	t.Helper()
	rt, err := OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// closePending waits until closing (the result of a Close started in another
// goroutine) has either returned, which it reports as false, or is blocked
// waiting for s's lock (a writer is pending: TryRLock fails), reported as true.
// Either outcome is reached every run; no sleep or timeout decides it.
func closePending(s *Stream, closing <-chan error) bool {
	for {
		select {
		case <-closing:
			return false
		default:
		}
		if !s.mu.TryRLock() {
			return true
		}
		s.mu.RUnlock()
		runtime.Gosched()
	}
}

// TestWithNativeHoldsStream: a Stream.Close or Device.Close started while a
// WithNative callback runs waits for the callback to return (every run: the
// callback does not return until the Close is seen blocked on the stream).
func TestWithNativeHoldsStream(t *testing.T) {
	for _, tc := range []struct {
		name  string
		close func(d *Device, s *Stream) error
	}{
		{"Stream.Close", func(_ *Device, s *Stream) error { return s.Close() }},
		{"Device.Close", func(d *Device, _ *Stream) error { return d.Close() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := cpuDevice(t)
			s, err := d.NewStream(StreamOptions{})
			if err != nil {
				t.Fatal(err)
			}
			closing := make(chan error, 1)
			err = s.WithNative(nil, func(Native) error {
				go func() { closing <- tc.close(d, s) }()
				if !closePending(s, closing) {
					return errors.New("Close returned while the callback held the stream")
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := <-closing; err != nil {
				t.Fatalf("%s after the callback: %v", tc.name, err)
			}
			if err := s.WithNative(nil, func(Native) error { return nil }); !errors.Is(err, ErrClosed) {
				t.Errorf("WithNative after %s = %v, want ErrClosed", tc.name, err)
			}
		})
	}
}

// TestWithNativeRefusesFree: while a callback holds a buffer (or a view of
// it), Free of the buffer fails with ErrInvalid; afterwards it succeeds. A
// lease taken before a later buffer fails to lease is given back.
func TestWithNativeRefusesFree(t *testing.T) {
	d := cpuDevice(t)
	s, err := d.NewStream(StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	a, err := d.Alloc(256)
	if err != nil {
		t.Fatal(err)
	}
	view, err := a.Slice(64, 64)
	if err != nil {
		t.Fatal(err)
	}
	err = s.WithNative([]*Buffer{view, nil, a}, func(n Native) error {
		if err := a.Free(); !errors.Is(err, ErrInvalid) {
			t.Errorf("Free inside the callback = %v, want ErrInvalid", err)
		}
		if want := Ptr(a.ptr()) + 64; n.Ptrs[0] != want || n.Ptrs[1] != 0 || n.Ptrs[2] != Ptr(a.ptr()) {
			t.Errorf("Ptrs = %v, want [%#x 0 %#x]", n.Ptrs, want, a.ptr())
		}
		if n.Stream != 0 {
			t.Errorf("Stream = %#x on cpu, want 0", n.Stream)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	freed, err := d.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	if err := freed.Free(); err != nil {
		t.Fatal(err)
	}
	ran := false
	err = s.WithNative([]*Buffer{a, freed}, func(Native) error { ran = true; return nil })
	if !errors.Is(err, ErrFreed) || ran {
		t.Errorf("WithNative with a freed buffer: ran %v, err %v; want ErrFreed, not run", ran, err)
	}
	if err := a.Free(); err != nil {
		t.Errorf("Free after the callbacks: %v", err)
	}
}

// TestWithNativeErrors: bad arguments are refused without running fn, and
// fn's error is returned.
func TestWithNativeErrors(t *testing.T) {
	d, other := cpuDevice(t), cpuDevice(t)
	s, err := d.NewStream(StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	closed, err := d.NewStream(StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = closed.Close()
	foreign, err := other.Alloc(64)
	if err != nil {
		t.Fatal(err)
	}
	fnErr := errors.New("fn failed")
	for _, tc := range []struct {
		name    string
		s       *Stream
		bufs    []*Buffer
		fn      func(Native) error
		want    error
		wantRan bool
	}{
		{"nil stream", nil, nil, nil, ErrInvalid, false},
		{"nil callback", s, nil, nil, ErrInvalid, false},
		{"closed stream", closed, nil, nil, ErrClosed, false},
		{"buffer of another device", s, []*Buffer{foreign}, nil, ErrWrongDevice, false},
		{"fn's error", s, nil, func(Native) error { return fnErr }, fnErr, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ran := false
			fn := tc.fn
			if fn == nil && tc.name != "nil callback" {
				fn = func(Native) error { return nil }
			}
			var wrapped func(Native) error
			if fn != nil {
				wrapped = func(n Native) error { ran = true; return fn(n) }
			}
			if err := tc.s.WithNative(tc.bufs, wrapped); !errors.Is(err, tc.want) || ran != tc.wantRan {
				t.Errorf("err %v, ran %v; want %v, ran %v", err, ran, tc.want, tc.wantRan)
			}
		})
	}
	if err := foreign.Free(); err != nil {
		t.Errorf("the refused buffer's lease was not given back: %v", err)
	}
}

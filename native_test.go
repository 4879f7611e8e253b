package gpuctx_test

import (
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx"
)

func TestNativeCPU(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WithNative(nil, func(n gpuctx.Native) error {
		if n.Stream != 0 {
			t.Errorf("WithNative on cpu: stream handle %#x, want 0", n.Stream)
		}
		return nil
	}); err != nil {
		t.Errorf("WithNative on cpu: %v", err)
	}
	ran := false
	if err := d.OnThread(func() error { ran = true; return nil }); err != nil || !ran {
		t.Errorf("OnThread: ran %v, err %v", ran, err)
	}
	want := errors.New("x")
	if err := d.OnThread(func() error { return want }); err != want {
		t.Errorf("OnThread returned %v, want fn's error", err)
	}
	_ = s.Close()
	if err := s.WithNative(nil, func(gpuctx.Native) error { return nil }); !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
}

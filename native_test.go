package gpuctx_test

import (
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx"
)

func TestNativeHandleCPU(t *testing.T) {
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
	if _, err := s.NativeHandle(); !errors.Is(err, gpuctx.ErrUnavailable) {
		t.Errorf("NativeHandle on cpu: %v, want ErrUnavailable", err)
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
	if _, err := s.NativeHandle(); !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
}

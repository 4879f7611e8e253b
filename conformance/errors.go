package conformance

import (
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// errCase is one call that must fail with an error wrapping want.
type errCase struct {
	name string
	call func() error
	want error
}

func runErrCases(t *testing.T, cases []errCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			if !errors.Is(err, c.want) {
				t.Fatalf("got error %v; want one wrapping %q", err, c.want)
			}
			if err.Error() == c.want.Error() {
				t.Errorf("error %q carries no detail: it should name the call and the bad value", err)
			}
		})
	}
}

// openSecond opens a second Runtime of dev's backend and its device 0: a
// different *Device from dev even when it is the same hardware. The Runtime is
// closed at cleanup.
func openSecond(t *testing.T, dev *gpuctx.Device) (*gpuctx.Runtime, *gpuctx.Device) {
	t.Helper()
	rt, err := gpuctx.OpenBackend(dev.Backend())
	if err != nil {
		t.Fatalf("gpuctx.OpenBackend(%q) for a second runtime: %v", dev.Backend(), err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	d, err := rt.Device(0)
	if err != nil {
		t.Fatalf("second Runtime.Device(0): %v", err)
	}
	if d == dev {
		t.Fatalf("a second Runtime returned the same *Device as the first")
	}
	return rt, d
}

// TestErrors checks that every misuse returns an error wrapping the right
// sentinel (errors.Is), with detail: freed buffers (ErrFreed), objects of
// another device (ErrWrongDevice), sizes and ranges (ErrSize), closed streams,
// events, contexts, devices and runtimes (ErrClosed), bad kernel arguments and
// launch shapes (ErrInvalid), and a BLAS handle used after its callback
// (ErrHandleExpired). dev itself stays usable.
func TestErrors(t *testing.T, dev *gpuctx.Device) {
	const size = 256
	s := newStream(t, dev)
	live := alloc(t, dev, size)
	host := allocHost(t, dev, size)
	fill := kernel(t, dev, "gpuctx_fill_f32")
	empty := kernel(t, dev, "gpuctx_empty")
	ev := newEvent(t, dev, true)
	g, b := dim(1), dim(32)

	t.Run("Freed", func(t *testing.T) {
		fb := alloc(t, dev, size)
		view, err := fb.Slice(0, 16)
		must(t, "Slice", err)
		must(t, "Free", fb.Free())
		fh, err := dev.AllocHost(size)
		must(t, "AllocHost", err)
		must(t, "HostBuffer.Free", fh.Free())
		buf := make([]byte, size)
		runErrCases(t, []errCase{
			{"double free", fb.Free, gpuctx.ErrFreed},
			{"CopyFromHost", func() error { return fb.CopyFromHost(buf) }, gpuctx.ErrFreed},
			{"CopyToHost", func() error { return fb.CopyToHost(buf) }, gpuctx.ErrFreed},
			{"CopyFrom freed source", func() error { return live.CopyFrom(fb) }, gpuctx.ErrFreed},
			{"CopyFrom into freed", func() error { return fb.CopyFrom(live) }, gpuctx.ErrFreed},
			{"Slice", func() error { _, err := fb.Slice(0, 1); return err }, gpuctx.ErrFreed},
			{"Ptr", func() error { _, err := fb.Ptr(); return err }, gpuctx.ErrFreed},
			{"view of freed buffer", func() error { return view.CopyToHost(buf[:16]) }, gpuctx.ErrFreed},
			{"Stream.CopyHtoD", func() error { return s.CopyHtoD(fb, 0, host, 0, 1) }, gpuctx.ErrFreed},
			{"Stream.CopyDtoH", func() error { return s.CopyDtoH(host, 0, fb, 0, 1) }, gpuctx.ErrFreed},
			{"Stream.CopyDtoD source", func() error { return s.CopyDtoD(live, 0, fb, 0, 1) }, gpuctx.ErrFreed},
			{"Stream.CopyDtoD destination", func() error { return s.CopyDtoD(fb, 0, live, 0, 1) }, gpuctx.ErrFreed},
			{"Stream.Memset", func() error { return s.Memset(fb, 0) }, gpuctx.ErrFreed},
			{"Stream.Launch argument", func() error { return s.Launch(fill, g, b, 0, fb, float32(1), int64(1)) }, gpuctx.ErrFreed},
			{"Stream.Launch view argument", func() error { return s.Launch(fill, g, b, 0, view, float32(1), int64(1)) }, gpuctx.ErrFreed},
			{"HostBuffer double free", fh.Free, gpuctx.ErrFreed},
			{"Stream.CopyHtoD freed host", func() error { return s.CopyHtoD(live, 0, fh, 0, 1) }, gpuctx.ErrFreed},
			{"Stream.CopyDtoH freed host", func() error { return s.CopyDtoH(fh, 0, live, 0, 1) }, gpuctx.ErrFreed},
		})
		if fh.Bytes() != nil {
			t.Errorf("HostBuffer.Bytes after Free is not nil")
		}
	})

	t.Run("WrongDevice", func(t *testing.T) {
		_, dev2 := openSecond(t, dev)
		other := alloc(t, dev2, size)
		s2 := newStream(t, dev2)
		ev2 := newEvent(t, dev2, true)
		k2 := kernel(t, dev2, "gpuctx_empty")
		ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s})
		must(t, "NewContext", err)
		t.Cleanup(func() { _ = ctx.Close() })
		runErrCases(t, []errCase{
			{"CopyFrom", func() error { return live.CopyFrom(other) }, gpuctx.ErrWrongDevice},
			{"Stream.CopyDtoD source", func() error { return s.CopyDtoD(live, 0, other, 0, 1) }, gpuctx.ErrWrongDevice},
			{"Stream.CopyDtoD destination", func() error { return s.CopyDtoD(other, 0, live, 0, 1) }, gpuctx.ErrWrongDevice},
			{"Stream.CopyHtoD", func() error { return s.CopyHtoD(other, 0, host, 0, 1) }, gpuctx.ErrWrongDevice},
			{"Stream.CopyDtoH", func() error { return s.CopyDtoH(host, 0, other, 0, 1) }, gpuctx.ErrWrongDevice},
			{"Stream.Memset", func() error { return s.Memset(other, 0) }, gpuctx.ErrWrongDevice},
			{"Stream.Launch argument", func() error { return s.Launch(fill, g, b, 0, other, float32(1), int64(1)) }, gpuctx.ErrWrongDevice},
			{"Stream.Launch kernel", func() error { return s.Launch(k2, g, b, 0) }, gpuctx.ErrWrongDevice},
			{"Event.Record", func() error { return ev2.Record(s) }, gpuctx.ErrWrongDevice},
			{"Event.Record other stream", func() error { return ev.Record(s2) }, gpuctx.ErrWrongDevice},
			{"Stream.Wait", func() error { return s.Wait(ev2) }, gpuctx.ErrWrongDevice},
			{"Event.Elapsed", func() error { _, err := ev.Elapsed(ev2); return err }, gpuctx.ErrWrongDevice},
			{"Context.SetStream", func() error { _, err := ctx.SetStream(s2); return err }, gpuctx.ErrWrongDevice},
			{"NewContext", func() error {
				c, err := dev.NewContext(gpuctx.ContextOptions{Stream: s2})
				if err == nil {
					_ = c.Close()
				}
				return err
			}, gpuctx.ErrWrongDevice},
		})
		if ctx.Stream() != s {
			t.Errorf("a refused SetStream changed the Context's stream")
		}
		// Both devices still work after all that.
		must(t, "dev stream Synchronize", s.Synchronize())
		must(t, "dev2 stream Synchronize", s2.Synchronize())
	})

	t.Run("Size", func(t *testing.T) {
		small := make([]byte, size-1)
		large := make([]byte, size+1)
		half := alloc(t, dev, size/2)
		runErrCases(t, []errCase{
			{"Alloc(0)", func() error { _, err := dev.Alloc(0); return err }, gpuctx.ErrSize},
			{"Alloc(-1)", func() error { _, err := dev.Alloc(-1); return err }, gpuctx.ErrSize},
			{"AllocHost(0)", func() error { _, err := dev.AllocHost(0); return err }, gpuctx.ErrSize},
			{"CopyFromHost short", func() error { return live.CopyFromHost(small) }, gpuctx.ErrSize},
			{"CopyFromHost long", func() error { return live.CopyFromHost(large) }, gpuctx.ErrSize},
			{"CopyToHost short", func() error { return live.CopyToHost(small) }, gpuctx.ErrSize},
			{"CopyToHost long", func() error { return live.CopyToHost(large) }, gpuctx.ErrSize},
			{"CopyFrom size mismatch", func() error { return live.CopyFrom(half) }, gpuctx.ErrSize},
			{"Slice past end", func() error { _, err := live.Slice(1, size); return err }, gpuctx.ErrSize},
			{"Slice negative offset", func() error { _, err := live.Slice(-1, 1); return err }, gpuctx.ErrSize},
			{"Slice negative length", func() error { _, err := live.Slice(0, -1); return err }, gpuctx.ErrSize},
			{"Slice at end", func() error { _, err := live.Slice(size, 1); return err }, gpuctx.ErrSize},
			{"CopyHtoD device range", func() error { return s.CopyHtoD(live, size-1, host, 0, 2) }, gpuctx.ErrSize},
			{"CopyHtoD host range", func() error { return s.CopyHtoD(live, 0, host, size-1, 2) }, gpuctx.ErrSize},
			{"CopyHtoD negative", func() error { return s.CopyHtoD(live, 0, host, 0, -1) }, gpuctx.ErrSize},
			{"CopyDtoH device range", func() error { return s.CopyDtoH(host, 0, live, 1, size) }, gpuctx.ErrSize},
			{"CopyDtoH host range", func() error { return s.CopyDtoH(host, 1, live, 0, size) }, gpuctx.ErrSize},
			{"CopyDtoH negative offset", func() error { return s.CopyDtoH(host, -1, live, 0, 1) }, gpuctx.ErrSize},
			{"CopyDtoD destination range", func() error { return s.CopyDtoD(half, 0, live, 0, size) }, gpuctx.ErrSize},
			{"CopyDtoD source range", func() error { return s.CopyDtoD(live, 0, half, 1, size/2) }, gpuctx.ErrSize},
			{"CopyDtoD negative", func() error { return s.CopyDtoD(live, 0, half, 0, -4) }, gpuctx.ErrSize},
		})
	})

	t.Run("Closed", func(t *testing.T) {
		cs, err := dev.NewStream(gpuctx.StreamOptions{})
		must(t, "NewStream", err)
		must(t, "Stream.Close", cs.Close())
		must(t, "Stream.Close again (harmless)", cs.Close())
		ce, err := dev.NewEvent(true)
		must(t, "NewEvent", err)
		must(t, "Event.Record", ce.Record(s))
		must(t, "Event.Close", ce.Close())
		must(t, "Event.Close again (harmless)", ce.Close())
		cctx, err := dev.NewContext(gpuctx.ContextOptions{})
		must(t, "NewContext", err)
		must(t, "Context.Close", cctx.Close())
		must(t, "Context.Close again (harmless)", cctx.Close())
		octx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s})
		must(t, "NewContext", err)
		t.Cleanup(func() { _ = octx.Close() })

		// A device of its own Runtime, closed here; dev stays open.
		rt3, dev3 := openSecond(t, dev)
		b3, err := dev3.Alloc(size)
		must(t, "dev3 Alloc", err)
		s3, err := dev3.NewStream(gpuctx.StreamOptions{})
		must(t, "dev3 NewStream", err)
		e3, err := dev3.NewEvent(false)
		must(t, "dev3 NewEvent", err)
		must(t, "dev3 Close", dev3.Close())
		must(t, "dev3 Close again (harmless)", dev3.Close())
		rt4, err := gpuctx.OpenBackend(dev.Backend())
		must(t, "OpenBackend", err)
		must(t, "Runtime.Close", rt4.Close())
		must(t, "Runtime.Close again (harmless)", rt4.Close())

		buf := make([]byte, size)
		runErrCases(t, []errCase{
			{"Stream.CopyHtoD", func() error { return cs.CopyHtoD(live, 0, host, 0, 1) }, gpuctx.ErrClosed},
			{"Stream.CopyDtoH", func() error { return cs.CopyDtoH(host, 0, live, 0, 1) }, gpuctx.ErrClosed},
			{"Stream.CopyDtoD", func() error { return cs.CopyDtoD(live, 0, live, 1, 1) }, gpuctx.ErrClosed},
			{"Stream.Memset", func() error { return cs.Memset(live, 0) }, gpuctx.ErrClosed},
			{"Stream.Launch", func() error { return cs.Launch(empty, g, b, 0) }, gpuctx.ErrClosed},
			{"Stream.Wait", func() error { return cs.Wait(ev) }, gpuctx.ErrClosed},
			{"Stream.Synchronize", cs.Synchronize, gpuctx.ErrClosed},
			{"Stream.Query", func() error { _, err := cs.Query(); return err }, gpuctx.ErrClosed},
			{"Event.Record on closed stream", func() error { return ev.Record(cs) }, gpuctx.ErrClosed},
			{"Context.SetStream closed stream", func() error { _, err := octx.SetStream(cs); return err }, gpuctx.ErrClosed},
			{"NewContext closed stream", func() error {
				c, err := dev.NewContext(gpuctx.ContextOptions{Stream: cs})
				if err == nil {
					_ = c.Close()
				}
				return err
			}, gpuctx.ErrClosed},
			{"Event.Record", func() error { return ce.Record(s) }, gpuctx.ErrClosed},
			{"Event.Synchronize", ce.Synchronize, gpuctx.ErrClosed},
			{"Event.Query", func() error { _, err := ce.Query(); return err }, gpuctx.ErrClosed},
			{"Stream.Wait closed event", func() error { return s.Wait(ce) }, gpuctx.ErrClosed},
			{"Event.Elapsed closed end", func() error { _, err := ce.Elapsed(ev); return err }, gpuctx.ErrClosed},
			{"Event.Elapsed closed start", func() error { _, err := ev.Elapsed(ce); return err }, gpuctx.ErrClosed},
			{"Context.Blas", func() error { return cctx.Blas(func(gpuctx.Blas) error { return nil }) }, gpuctx.ErrClosed},
			{"Context.SetStream", func() error { _, err := cctx.SetStream(s); return err }, gpuctx.ErrClosed},
			{"Device.Alloc", func() error { _, err := dev3.Alloc(size); return err }, gpuctx.ErrClosed},
			{"Device.AllocHost", func() error { _, err := dev3.AllocHost(size); return err }, gpuctx.ErrClosed},
			{"Device.NewStream", func() error { _, err := dev3.NewStream(gpuctx.StreamOptions{}); return err }, gpuctx.ErrClosed},
			{"Device.NewEvent", func() error { _, err := dev3.NewEvent(false); return err }, gpuctx.ErrClosed},
			{"Device.NewContext", func() error { _, err := dev3.NewContext(gpuctx.ContextOptions{}); return err }, gpuctx.ErrClosed},
			{"Device.Kernel", func() error { _, err := dev3.Kernel("gpuctx_empty"); return err }, gpuctx.ErrClosed},
			{"Device.Synchronize", dev3.Synchronize, gpuctx.ErrClosed},
			{"Device.MemInfo", func() error { _, _, err := dev3.MemInfo(); return err }, gpuctx.ErrClosed},
			{"stream of closed device", s3.Synchronize, gpuctx.ErrClosed},
			{"event of closed device", e3.Synchronize, gpuctx.ErrClosed},
			// Device.Close documents ErrClosed for every object made from the device.
			{"buffer of closed device", func() error { return b3.CopyToHost(buf) }, gpuctx.ErrClosed},
			{"Runtime.Device after Runtime.Close", func() error { _, err := rt4.Device(0); return err }, gpuctx.ErrClosed},
		})
		must(t, "Runtime of the closed device: Close", rt3.Close())
		// dev is still fully usable.
		must(t, "dev.Synchronize after closing another runtime's device", dev.Synchronize())
		must(t, "live stream Synchronize", s.Synchronize())
	})

	t.Run("Invalid", func(t *testing.T) {
		view, err := live.Slice(0, 8)
		must(t, "Slice", err)
		runErrCases(t, []errCase{
			{"Launch Go int argument", func() error { return s.Launch(fill, g, b, 0, live, float32(1), 1) }, gpuctx.ErrInvalid},
			{"Launch int8 argument", func() error { return s.Launch(fill, g, b, 0, live, float32(1), int8(1)) }, gpuctx.ErrInvalid},
			{"Launch string argument", func() error { return s.Launch(fill, g, b, 0, "y", float32(1), int64(1)) }, gpuctx.ErrInvalid},
			{"Launch HostBuffer argument", func() error { return s.Launch(fill, g, b, 0, host, float32(1), int64(1)) }, gpuctx.ErrInvalid},
			{"Launch nil kernel", func() error { return s.Launch(nil, g, b, 0) }, gpuctx.ErrInvalid},
			{"Launch zero grid", func() error { return s.Launch(empty, gpuctx.Dim3{}, b, 0) }, gpuctx.ErrInvalid},
			{"Launch grid Y=0", func() error { return s.Launch(empty, gpuctx.Dim3{X: 1, Y: 0, Z: 1}, b, 0) }, gpuctx.ErrInvalid},
			{"Launch negative grid", func() error { return s.Launch(empty, dim(-1), b, 0) }, gpuctx.ErrInvalid},
			{"Launch zero block", func() error { return s.Launch(empty, g, gpuctx.Dim3{X: 32, Y: 1}, 0) }, gpuctx.ErrInvalid},
			{"Free a view", view.Free, gpuctx.ErrInvalid},
			{"NewStream priority out of range", func() error {
				least, greatest := dev.PriorityRange()
				st, err := dev.NewStream(gpuctx.StreamOptions{Priority: min(least, greatest) - 100})
				if err == nil {
					_ = st.Close()
				}
				return err
			}, gpuctx.ErrInvalid},
			{"Elapsed of non-timing events", func() error {
				e1, e2 := newEvent(t, dev, false), newEvent(t, dev, false)
				if err := e1.Record(s); err != nil {
					return err
				}
				if err := e2.Record(s); err != nil {
					return err
				}
				if err := e2.Synchronize(); err != nil {
					return err
				}
				_, err := e2.Elapsed(e1)
				return err
			}, gpuctx.ErrInvalid},
			{"OpenBackend unknown", func() error { _, err := gpuctx.OpenBackend("no-such-backend"); return err }, gpuctx.ErrInvalid},
			{"Runtime.Device index out of range", func() error {
				rt, err := gpuctx.OpenBackend(dev.Backend())
				if err != nil {
					return err
				}
				defer rt.Close()
				_, err = rt.Device(rt.DeviceCount())
				return err
			}, gpuctx.ErrInvalid},
		})
		if _, err := dev.Kernel("gpuctx_no_such_kernel"); err == nil {
			t.Errorf("Device.Kernel of an unknown name returned no error")
		}
		// The stream is still usable after every refused call.
		must(t, "Launch after refused launches", s.Launch(empty, g, b, 0))
		must(t, "Synchronize", s.Synchronize())
	})

	t.Run("HandleExpired", func(t *testing.T) {
		ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s})
		must(t, "NewContext", err)
		t.Cleanup(func() { _ = ctx.Close() })
		var escaped gpuctx.Blas
		must(t, "Context.Blas", ctx.Blas(func(h gpuctx.Blas) error {
			if h.Stream() != s {
				t.Errorf("Blas handle bound to stream %d, want the Context's stream %d", h.Stream().ID(), s.ID())
			}
			escaped = h
			return nil
		}))
		runErrCases(t, []errCase{
			{"Gemm after callback", func() error { return escaped.Gemm(gpuctx.Gemm{}) }, gpuctx.ErrHandleExpired},
		})
	})
}

package gpuctx_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// A Tracer sees the eager work of its device only: a captured kernel is not
// traced, a graph launch is one "graph (N nodes)" span, a copy is a
// "memcpy ..." span, a detached tracer records nothing more, and a closed one
// refuses to write.
func TestTracer(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		s := newStream(t, d)
		a := upload(t, d, make([]float32, 64))
		axpby, err := d.Kernel("gpuctx_axpby_f32")
		if err != nil {
			t.Fatal(err)
		}
		one, blk := gpuctx.Dim3{X: 1, Y: 1, Z: 1}, gpuctx.Dim3{X: 64, Y: 1, Z: 1}
		launch := func() error { return s.Launch(axpby, one, blk, 0, a, a, float32(1), float32(1), int64(64)) }
		tr := gpuctx.NewTracer()
		tr.NameStream(s, "main")
		if err := d.SetTracer(tr); err != nil {
			t.Fatal(err)
		}
		if d.Tracer() != tr {
			t.Fatal("Device.Tracer does not return the attached tracer")
		}
		if err := s.BeginCapture(); err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if err := launch(); err != nil {
				t.Fatal(err)
			}
		}
		g, err := s.EndCapture()
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		if n := tr.Spans(); n != 0 {
			t.Fatalf("%d spans recorded during a capture, want 0", n)
		}
		if err := launch(); err != nil {
			t.Fatal(err)
		}
		if err := g.Launch(s); err != nil {
			t.Fatal(err)
		}
		if err := s.CopyDtoD(a, 0, a, 128, 128); err != nil {
			t.Fatal(err)
		}
		if err := d.SetTracer(nil); err != nil {
			t.Fatal(err)
		}
		if err := launch(); err != nil { // detached: not traced
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if err := tr.WriteJSON(&buf); err != nil {
			t.Fatal(err)
		}
		var tf struct {
			TraceEvents []struct {
				Name, Ph string
				Tid      uint64
				Args     map[string]any
			} `json:"traceEvents"`
		}
		if err := json.Unmarshal(buf.Bytes(), &tf); err != nil {
			t.Fatalf("%v\n%s", err, buf.Bytes())
		}
		var names []string
		track := ""
		for _, e := range tf.TraceEvents {
			switch {
			case e.Ph == "X":
				names = append(names, e.Name)
			case e.Name == "thread_name" && e.Tid == s.ID():
				track, _ = e.Args["name"].(string)
			}
		}
		want := "gpuctx_axpby_f32,graph (3 nodes),memcpy DtoD"
		if d.Backend() == "cuda" {
			want = "gpuctx_axpby_f32,graph (" // the node count is the driver's
		}
		if got := strings.Join(names, ","); !strings.HasPrefix(got, want) || len(names) != 3 {
			t.Errorf("spans %q, want %q", got, want)
		}
		if track != "main" {
			t.Errorf("track name %q, want main", track)
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
		if err := tr.WriteJSON(&buf); !errors.Is(err, gpuctx.ErrClosed) {
			t.Errorf("WriteJSON after Close: %v, want ErrClosed", err)
		}
		if err := d.SetTracer(tr); !errors.Is(err, gpuctx.ErrClosed) {
			t.Errorf("SetTracer of a closed tracer: %v, want ErrClosed", err)
		}
	})
}

// Record a timeline of one stream's work and write it for ui.perfetto.dev.
func ExampleTracer() {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		panic(err)
	}
	defer rt.Close()
	dev, _ := rt.Device(0)
	s, _ := dev.NewStream(gpuctx.StreamOptions{})
	buf, _ := dev.Alloc(1 << 20)

	tr := gpuctx.NewTracer()
	defer tr.Close()
	tr.NameStream(s, "main")
	tr.SetMetadata("what", "a memset and a copy")
	if err := dev.SetTracer(tr); err != nil {
		panic(err)
	}
	end := tr.Range(s, "step 1")
	_ = s.Memset(buf, 0)
	_ = s.CopyDtoD(buf, 0, buf, 1<<19, 1<<19)
	end()
	_ = dev.SetTracer(nil) // later work is not recorded

	var out bytes.Buffer // or tr.WriteFile("trace.json")
	if err := tr.WriteJSON(&out); err != nil {
		panic(err)
	}
	fmt.Println(tr.Spans(), "spans;", strings.Contains(out.String(), `"traceEvents"`))
	// Output: 3 spans; true
}

// Goroutines queueing on their own streams while a tracer is attached, then
// detached and attached again, record one span per operation (run with -race).
func TestTracerConcurrent(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		const streams, ops = 4, 25
		tr := gpuctx.NewTracer()
		defer tr.Close()
		if err := d.SetTracer(tr); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make(chan error, streams)
		for range streams {
			s := newStream(t, d)
			b := upload(t, d, make([]float32, 256))
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range ops {
					if err := s.Memset(b, 1); err != nil {
						errs <- err
						return
					}
				}
				errs <- s.Synchronize()
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		if err := tr.WriteJSON(io.Discard); err != nil {
			t.Fatal(err)
		}
		if n := tr.Spans(); n != streams*ops {
			t.Errorf("%d spans, want %d", n, streams*ops)
		}
	})
}

package moe

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// traceFile is the part of the trace-event JSON format the test reads.
type traceFile struct {
	TraceEvents []struct {
		Name string         `json:"name"`
		Cat  string         `json:"cat"`
		Ph   string         `json:"ph"`
		BP   string         `json:"bp"`
		Args map[string]any `json:"args"`
		Ts   *float64       `json:"ts"`
		Dur  *float64       `json:"dur"`
		Pid  *int           `json:"pid"`
		Tid  *uint64        `json:"tid"`
		ID   int            `json:"id"`
	} `json:"traceEvents"`
	DisplayTimeUnit string            `json:"displayTimeUnit"`
	OtherData       map[string]string `json:"otherData"`
}

// TestLayerTraceDual runs dual-mode forwards on the CPU backend with a Tracer
// attached and checks the trace: valid trace-event JSON, spans on at least two
// stream tracks that overlap in time (the shared expert on the side stream
// while the routed experts run on the main stream), and flow events that pair
// up (fork and join).
func TestLayerTraceDual(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	cfg := *variants()["deepseek_v2_greedy"]
	cfg.HiddenSize, cfg.Intermediate, cfg.SharedIntermediate = 256, 128, 1024
	w, err := RandomWeights(&cfg, 7)
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLayer(dev, &cfg, w, LayerOptions{DType: gpuctx.F32, Mode: Dual, NoGraphs: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	rec := recordPlans(l, nil)
	const T = 64
	x := randomX(T, cfg.HiddenSize, 3)
	// Whether two goroutine streams overlap in wall time is up to the
	// scheduler: a few forwards make it all but certain.
	for try := 0; try < 8; try++ {
		tr := gpuctx.NewTracer()
		tr.SetMetadata("test", "dual")
		if err := dev.SetTracer(tr); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Forward(x, T); err != nil {
			t.Fatal(err)
		}
		if err := dev.SetTracer(nil); err != nil {
			t.Fatal(err)
		}
		if !rec.last.dual {
			t.Fatal("the forward did not use the side stream")
		}
		var buf bytes.Buffer
		if err := tr.WriteJSON(&buf); err != nil {
			t.Fatal(err)
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
		overlap := checkTrace(t, buf.Bytes())
		if overlap {
			return
		}
		t.Logf("try %d: no overlap between stream tracks; again", try)
	}
	t.Fatal("no two spans on different stream tracks overlapped in 8 forwards")
}

// checkTrace validates a trace and reports whether spans of two tracks overlap.
func checkTrace(t *testing.T, data []byte) bool {
	t.Helper()
	var tf traceFile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&tf); err != nil {
		t.Fatalf("not trace-event JSON: %v\n%s", err, data)
	}
	if tf.OtherData["test"] != "dual" {
		t.Errorf("metadata %v lacks test=dual", tf.OtherData)
	}
	type span struct {
		tid        uint64
		start, end float64
	}
	var spans []span
	kernels := 0
	flows := map[int][2]int{} // id -> starts, finishes
	for i, e := range tf.TraceEvents {
		if e.Name == "" || e.Pid == nil || (e.Ph != "M" && (e.Ts == nil || e.Tid == nil)) {
			t.Fatalf("event %d lacks name, pid, ts or tid: %+v", i, e)
		}
		switch e.Ph {
		case "M":
		case "X":
			if e.Dur == nil || *e.Dur < 0 || *e.Ts < 0 {
				t.Fatalf("span %d (%s) has ts %v dur %v", i, e.Name, e.Ts, e.Dur)
			}
			spans = append(spans, span{*e.Tid, *e.Ts, *e.Ts + *e.Dur})
			if len(e.Name) > 10 && e.Name[:10] == "gpuctx_moe" {
				kernels++
			}
		case "s", "f":
			c := flows[e.ID]
			if e.Ph == "s" {
				c[0]++
			} else {
				c[1]++
			}
			flows[e.ID] = c
		default:
			t.Fatalf("event %d has phase %q", i, e.Ph)
		}
	}
	if kernels == 0 {
		t.Error("no kernel spans (gpuctx_moe_*)")
	}
	tracks := map[uint64]bool{}
	for _, s := range spans {
		tracks[s.tid] = true
	}
	if len(tracks) < 2 {
		t.Fatalf("spans on %d stream track(s), want >= 2", len(tracks))
	}
	if len(flows) < 2 {
		t.Errorf("%d flows, want >= 2 (fork and join)", len(flows))
	}
	for id, c := range flows {
		if c != [2]int{1, 1} {
			t.Errorf("flow %d: %d starts, %d finishes, want 1 and 1", id, c[0], c[1])
		}
	}
	for i, a := range spans {
		for _, b := range spans[i+1:] {
			if a.tid != b.tid && a.start < b.end && b.start < a.end && a.end > a.start && b.end > b.start {
				return true
			}
		}
	}
	return false
}

package bench

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

func TestParsePeerLine(t *testing.T) {
	r, err := parsePeerLine([]byte(`{"tokens": 8, "preset": "qwen1.5-moe", "floor_us": 10.0, "compute_floor_us": 0.2, "eager_us": 500.5,
		"graph_us": 60.25, "graph_dual_us": null, "graph_tuned_us": 40.0, "ok_tuned": false, "graph_old_default_us": 55.0,
		"rel_err": 0.001, "ok": true, "seconds": 3.1}`))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"eager": 500.5, "graph single": 60.25, "graph old default": 55}
	if r.Tokens != 8 || !r.OK || len(r.US) != len(want) {
		t.Fatalf("parsed %+v, want tokens 8, ok, modes %v", r, want)
	}
	for k, v := range want {
		if r.US[k] != v {
			t.Errorf("%s: %v, want %v", k, r.US[k], v)
		}
	}
	if mode, us, ok := r.best(); !ok || mode != "graph old default" || us != 55 {
		t.Errorf("best: %s %v %v", mode, us, ok)
	}
	for _, bad := range []string{`{"preset": "x"}`, `{"tokens": 0}`, `{"tokens": 1,`} {
		if _, err := parsePeerLine([]byte(bad)); err == nil {
			t.Errorf("%s parsed", bad)
		}
	}
	for f, want := range map[string]string{"graph_dual_us": "graph dual", "floor_us": "", "compute_floor_us": "", "rel_err": "", "eager_us": "eager"} {
		if got := peerModeName(f); got != want {
			t.Errorf("peerModeName(%s) = %q, want %q", f, got, want)
		}
	}
}

func TestApplyPeerRounds(t *testing.T) {
	row := func(T int, us map[string]float64) MoERow {
		r := MoERow{Tokens: T, MedianUS: us}
		r.derive()
		return r
	}
	// gpuctx's passes (one per round) and the peer's runs
	passes := [][]MoERow{
		{row(1, map[string]float64{"single": 50, "dual": 40}), row(8, map[string]float64{"single": 100}), row(64, map[string]float64{"single": 100})},
		{row(1, map[string]float64{"single": 52, "dual": 41}), row(8, map[string]float64{"single": 90}), row(64, map[string]float64{"single": 100})},
		{row(1, map[string]float64{"single": 60, "dual": 50}), row(8, map[string]float64{"single": 80}), row(64, map[string]float64{"single": 100})},
	}
	runs := []map[int]PeerRow{
		{1: {Tokens: 1, OK: true, US: map[string]float64{"graph single": 60, "graph dual": 49.2, "eager": 300}}, 8: {Tokens: 8, OK: true, US: map[string]float64{"graph single": 81}}},
		{1: {Tokens: 1, OK: true, US: map[string]float64{"graph single": 61, "graph dual": 41}}, 8: {Tokens: 8, OK: true, US: map[string]float64{"graph single": 90}}},
		{1: {Tokens: 1, OK: true, US: map[string]float64{"graph single": 62, "graph dual": 45}}, 8: {Tokens: 8, OK: true, US: map[string]float64{"graph single": 96}}},
	}
	cases := []struct {
		name              string
		rounds            int
		lo, med, hi       [2]float64 // tokens 1 and 8
		peerBest, ourBest [2]float64
	}{
		{"one round", 1, [2]float64{1.23, 0.81}, [2]float64{1.23, 0.81}, [2]float64{1.23, 0.81}, [2]float64{49.2, 81}, [2]float64{40, 100}},
		{"three rounds", 3, [2]float64{0.9, 0.81}, [2]float64{1, 1}, [2]float64{1.23, 1.2}, [2]float64{45, 90}, [2]float64{41, 90}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rep := &MoEReport{Rounds: c.rounds, Peer: &PeerReport{Name: PeerName, Preset: "deepseek-v2-lite", OK: true}}
			rep.Rows = mergePasses(passes[:c.rounds])
			applyPeer(rep, passes[:c.rounds], runs[:c.rounds])
			for i := range 2 {
				r := rep.Rows[i]
				if r.PeerBestUS == nil || r.SpeedupVsPeer == nil || len(r.RoundSpeedups) != c.rounds {
					t.Fatalf("row %d: %+v", i, r)
				}
				if math.Abs(*r.SpeedupMin-c.lo[i]) > 1e-9 || math.Abs(*r.SpeedupVsPeer-c.med[i]) > 1e-9 || math.Abs(*r.SpeedupMax-c.hi[i]) > 1e-9 {
					t.Errorf("row %d: ratio %v / %v / %v, want %v / %v / %v", i, *r.SpeedupMin, *r.SpeedupVsPeer, *r.SpeedupMax, c.lo[i], c.med[i], c.hi[i])
				}
				if *r.PeerBestUS != c.peerBest[i] || r.MedianUS[r.Best] != c.ourBest[i] {
					t.Errorf("row %d: peer best %v, gpuctx best %v, want %v and %v", i, *r.PeerBestUS, r.MedianUS[r.Best], c.peerBest[i], c.ourBest[i])
				}
			}
			if r := rep.Rows[2]; r.PeerBestUS != nil || r.SpeedupVsPeer != nil || r.PeerUS != nil {
				t.Errorf("row 64 has peer values without a peer row: %+v", r)
			}
			if s := rep.PeerSummary(); !strings.Contains(s, "over 2 of 3 token counts") {
				t.Errorf("summary %q", s)
			}
		})
	}
	if FmtSpeedup(1.234) != "1.23x" {
		t.Error(FmtSpeedup(1.234))
	}
}

func TestRelDiff(t *testing.T) {
	enc := func(x ...float32) []byte { return Encode(x, gpuctx.F32) }
	cases := []struct {
		name      string
		got, want []byte
		rel       float64
	}{
		{"equal", enc(1, 2, 2), enc(1, 2, 2), 0},
		{"off by a third", enc(1, 2, 4), enc(1, 2, 2), 2.0 / 3},
		{"nan", enc(1, float32(math.NaN()), 2), enc(1, 2, 2), math.Inf(1)},
		{"zero reference", enc(1, 2, 2), enc(0, 0, 0), math.Inf(1)},
	}
	for _, c := range cases {
		if got := RelDiff(c.got, c.want, gpuctx.F32); math.Abs(got-c.rel) > 1e-12 && got != c.rel {
			t.Errorf("%s: %v, want %v", c.name, got, c.rel)
		}
	}
}

// TestPeerEnvDType: the precision a peer ran is what its env line names in
// "dtype", bf16 when its env line names none (the bf16 peer), unknown
// without an env line or with one that is not JSON; the last env line wins,
// and every env line still streams as progress.
func TestPeerEnvDType(t *testing.T) {
	cases := []struct {
		name, stdout, want string
	}{
		{"no env line", "weights: 1 set(s) of 0.01 GB\nPASS: ok\n", ""},
		{"bf16 peer", `env: {"device": "NVIDIA H200", "torch": "2.11.0"}` + "\nPASS: ok\n", "bf16"},
		{"fp8 peer", `env: {"device": "NVIDIA H200", "dtype": "fp8", "configs": ["default", "tuned"]}` + "\nPASS: ok\n", "fp8"},
		{"empty dtype", `env: {"dtype": ""}` + "\n", "bf16"},
		{"not JSON", "env: device NVIDIA H200\n", ""},
		{"last env line wins", `env: {"dtype": "fp8"}` + "\n" + `env: {"device": "x"}` + "\n", "bf16"},
		{"a bad env line keeps the last good one", `env: {"dtype": "fp8"}` + "\nenv: {\n", "fp8"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var progress strings.Builder
			out, err := readPeerOutput(strings.NewReader(c.stdout), &progress)
			if err != nil {
				t.Fatal(err)
			}
			if out.dtype != c.want {
				t.Errorf("dtype %q, want %q", out.dtype, c.want)
			}
			if n := strings.Count(c.stdout, "env: "); strings.Count(progress.String(), "peer: env: ") != n {
				t.Errorf("progress lacks the env line(s):\n%s", progress.String())
			}
		})
	}
}

// TestPeerDTypeNote: a note only when the peer's precision is known and is
// not gpuctx's, naming the peer script of gpuctx's precision where there is
// one; and the summary line names the peer's precision and the mismatch.
func TestPeerDTypeNote(t *testing.T) {
	cases := []struct {
		ours, peer string
		note       string // "" : none
	}{
		{"bf16", "bf16", ""},
		{"fp8", "fp8", ""},
		{"fp8", "", ""},
		{"fp8", "bf16", "the peer runs bf16 weights while gpuctx runs fp8: the comparison is not like for like (the fp8 peer is --peer bench/peers/triton_fused_moe_fp8.py)"},
		{"bf16", "fp8", "the peer runs fp8 weights while gpuctx runs bf16: the comparison is not like for like (the bf16 peer is --peer bench/peers/triton_fused_moe.py)"},
		{"f32", "bf16", "the peer runs bf16 weights while gpuctx runs f32: the comparison is not like for like"},
	}
	for _, c := range cases {
		t.Run(c.ours+" vs "+c.peer, func(t *testing.T) {
			if got := PeerDTypeNote(c.ours, c.peer); got != c.note {
				t.Errorf("note %q, want %q", got, c.note)
			}
			one := 1.2
			rep := &MoEReport{DType: c.ours, Rounds: 1, Rows: []MoERow{{Tokens: 1, SpeedupVsPeer: &one}},
				Peer: &PeerReport{Name: PeerName, Preset: "deepseek-v3", OK: true, DType: c.peer, MinSpeedup: &one, MaxSpeedup: &one}}
			s := rep.PeerSummary()
			wantName := "speed vs peer (" + PeerName + ", preset"
			if c.peer != "" {
				wantName = "speed vs peer (" + PeerName + " " + c.peer + ", preset"
			}
			mismatch := "; not like for like: the peer ran " + c.peer + ", gpuctx " + c.ours
			if !strings.HasPrefix(s, wantName) || strings.Contains(s, mismatch) != (c.note != "") {
				t.Errorf("summary %q, want it to start with %q and to say %q: %v", s, wantName, mismatch, c.note != "")
			}
		})
	}
	for d, want := range map[string]string{"": "precision not reported", "bf16": "bf16 weights", "fp8": "fp8 weights (w8a8, 128x128 block scales)"} {
		if got := PeerDTypeText(d); got != want {
			t.Errorf("PeerDTypeText(%q) = %q, want %q", d, got, want)
		}
	}
	for dt, script := range peerScripts {
		if _, err := os.Stat(filepath.Join("..", script)); err != nil {
			t.Errorf("the %s peer script: %v", dt, err)
		}
	}
}

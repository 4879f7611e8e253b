package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
)

const fakePeer = "testdata/fake_peer.sh"

func TestMoeBenchPeerFake(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	allowPeerOnCPU = true
	defer func() { allowPeerOnCPU = false }()
	dir := t.TempDir()
	argsFile := filepath.Join(dir, "args")
	t.Setenv("FAKE_PEER_ARGS", argsFile)
	base := []string{"moe", "bench", "--tokens", "1,4", "--iters", "2", "--warmup", "0", "--peer", fakePeer, "--peer-python", fakePeer}

	t.Run("ok", func(t *testing.T) {
		t.Setenv("FAKE_PEER_MODE", "ok")
		md, png := filepath.Join(dir, "moe.md"), filepath.Join(dir, "moe.png")
		code, stdout, stderr := execute(t, append(base, "--out", md, "--plot", png)...)
		if code != 0 {
			t.Fatalf("exit %d, stderr %s", code, stderr)
		}
		if b, _ := os.ReadFile(argsFile); strings.TrimSpace(string(b)) != fakePeer+" --preset deepseek-v2-lite --tokens 1,4 --iters 2 --warmup 0 --sets 1" {
			t.Errorf("peer args %q", b)
		}
		for _, w := range []string{"peer progress on stderr", "peer: env: ", "peer: PASS"} {
			if !strings.Contains(stderr, w) {
				t.Errorf("stderr lacks %q:\n%s", w, stderr)
			}
		}
		lines := strings.Split(strings.TrimSpace(stdout), "\n")
		for _, w := range []string{"peer µs (best mode)", "45.0 (graph tuned)", "80.0 (graph single)", "--peer " + fakePeer} {
			if !strings.Contains(stdout, w) {
				t.Errorf("stdout lacks %q:\n%s", w, stdout)
			}
		}
		if last := lines[len(lines)-1]; !strings.HasPrefix(last, "speed vs peer (") || !strings.Contains(last, "over 2 of 2 token counts") {
			t.Errorf("last line is not the summary: %q", last)
		}
		if b, err := os.ReadFile(png); err != nil || len(b) < 100 {
			t.Errorf("no plot: %v", err)
		}

		code, stdout, stderr = execute(t, append(base, "--json")...)
		if code != 0 {
			t.Fatalf("--json: exit %d, stderr %s", code, stderr)
		}
		var rep moeBenchReport
		dec := json.NewDecoder(strings.NewReader(stdout))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rep); err != nil {
			t.Fatal(err)
		}
		if rep.Peer == nil || !rep.Peer.OK || rep.Peer.Preset != "deepseek-v2-lite" || rep.Peer.MinSpeedup == nil {
			t.Fatalf("peer report %+v", rep.Peer)
		}
		for i, want := range []struct {
			best float64
			mode string
		}{{45, "graph tuned"}, {80, "graph single"}} {
			r := rep.Rows[i]
			if r.PeerBestUS == nil || *r.PeerBestUS != want.best || r.PeerBestMode != want.mode || r.SpeedupVsPeer == nil ||
				math.Abs(*r.SpeedupVsPeer-want.best/r.MedianUS[r.Best]) > 1e-9 || len(r.PeerUS) < 3 {
				t.Errorf("row %d: %+v", i, r)
			}
		}
		if !strings.Contains(stderr, "speed vs peer") {
			t.Errorf("--json: no summary on stderr:\n%s", stderr)
		}
	})

	t.Run("check fails", func(t *testing.T) {
		t.Setenv("FAKE_PEER_MODE", "check")
		code, stdout, stderr := execute(t, base...)
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		// gpuctx's table is printed; the row whose check failed has no peer value
		for _, w := range []string{"| tokens ", "40.0", "FAILED"} {
			if w == "40.0" {
				if strings.Contains(stdout, "40.0 (graph tuned)") {
					t.Errorf("a timing of a config that failed its check was used:\n%s", stdout)
				}
				continue
			}
			if !strings.Contains(stdout, w) {
				t.Errorf("stdout lacks %q:\n%s", w, stdout)
			}
		}
		if !strings.Contains(stdout, "50.0 (graph dual)") {
			t.Errorf("the passing row lost its peer value:\n%s", stdout)
		}
		last := stderr[strings.LastIndex(strings.TrimSpace(stderr), "\n")+1:]
		for _, w := range []string{"gpuctx: the peer", "exit status 1", "FAIL T=4"} {
			if !strings.Contains(last, w) {
				t.Errorf("last stderr line lacks %q: %q", w, last)
			}
		}
	})

	t.Run("exit", func(t *testing.T) {
		t.Setenv("FAKE_PEER_MODE", "exit")
		code, stdout, stderr := execute(t, base...)
		if code != 1 || !strings.Contains(stdout, "| tokens ") || !strings.Contains(stderr, "triton does not import") {
			t.Errorf("exit %d\nstdout %s\nstderr %s", code, stdout, stderr)
		}
	})

	t.Run("python missing", func(t *testing.T) {
		code, stdout, stderr := execute(t, append(base, "--peer-python", filepath.Join(dir, "no-python"))...)
		if code != 1 || !strings.Contains(stdout, "| tokens ") || !strings.Contains(stderr, "--peer-python") {
			t.Errorf("exit %d\nstdout %s\nstderr %s", code, stdout, stderr)
		}
	})
}

func TestMoeBenchPeerRefused(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	cases := []struct {
		name string
		args []string
		want []string
	}{
		{"cpu backend", []string{"--peer", fakePeer}, []string{"--peer on the CPU backend", "needs CUDA"}},
		{"model", []string{"--peer", fakePeer, "--model", fixture}, []string{"--peer with --model", "presets only"}},
		{"no script", []string{"--peer", "testdata/none.py"}, []string{"--peer testdata/none.py: no such script"}},
		{"python without peer", []string{"--peer-python", "python3.12"}, []string{"--peer-python without --peer"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := execute(t, append([]string{"moe", "bench", "--tokens", "1", "--iters", "1"}, c.args...)...)
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
		})
	}
	saved := bench.PeerPresets["qwen3-30b-a3b"]
	delete(bench.PeerPresets, "qwen3-30b-a3b")
	defer func() { bench.PeerPresets["qwen3-30b-a3b"] = saved }()
	code, stdout, stderr := execute(t, "moe", "bench", "--preset", "qwen3-30b-a3b", "--peer", fakePeer)
	wantOneLineFailure(t, code, stdout, stderr, "the peer has no preset for qwen3-30b-a3b")
}

// TestMoeBenchPeerDType runs --dtype bf16 and fp8 against a fake peer whose
// env line says bf16 (no "dtype", as triton_fused_moe.py) or fp8 (as
// triton_fused_moe_fp8.py): the run goes on either way, the report names the
// peer's precision (JSON, header, summary), and only a mismatch adds the note.
func TestMoeBenchPeerDType(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	allowPeerOnCPU = true
	defer func() { allowPeerOnCPU = false }()
	dir := t.TempDir()
	cases := []struct {
		name, dtype, peerDType string // gpuctx's --dtype, FAKE_PEER_DTYPE
		wantPeer, header, note string // note "": none
	}{
		{"bf16 against the bf16 peer", "bf16", "", "bf16", "bf16 weights", ""},
		{"fp8 against the fp8 peer", "fp8", "fp8", "fp8", "fp8 weights (w8a8, 128x128 block scales)", ""},
		{"fp8 against the bf16 peer", "fp8", "", "bf16", "bf16 weights",
			"the peer runs bf16 weights while gpuctx runs fp8: the comparison is not like for like (the fp8 peer is --peer " + bench.PeerFP8Script + ")"},
		{"bf16 against the fp8 peer", "bf16", "fp8", "fp8", "fp8 weights (w8a8, 128x128 block scales)",
			"the peer runs fp8 weights while gpuctx runs bf16: the comparison is not like for like (the bf16 peer is --peer " + bench.PeerDefaultScript + ")"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("FAKE_PEER_DTYPE", c.peerDType)
			md := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".md")
			code, stdout, stderr := execute(t, "moe", "bench", "--tokens", "1,4", "--iters", "2", "--warmup", "0", "--dtype", c.dtype,
				"--peer", fakePeer, "--peer-python", fakePeer, "--json", "--out", md)
			if code != 0 {
				t.Fatalf("exit %d, stderr %s", code, stderr)
			}
			var rep moeBenchReport
			if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
				t.Fatal(err)
			}
			if rep.DType != c.dtype || rep.Peer == nil || !rep.Peer.OK || rep.Peer.DType != c.wantPeer {
				t.Fatalf("report dtype %q, peer %+v; want %q and a peer that ran %q", rep.DType, rep.Peer, c.dtype, c.wantPeer)
			}
			var notes []string
			for _, n := range rep.Notes {
				if strings.Contains(n, "not like for like") {
					notes = append(notes, n)
				}
			}
			if c.note == "" && len(notes) > 0 || c.note != "" && (len(notes) != 1 || notes[0] != c.note) {
				t.Errorf("precision notes %q, want %q", notes, c.note)
			}
			b, err := os.ReadFile(md)
			if err != nil {
				t.Fatal(err)
			}
			text := string(b)
			for _, w := range []string{"- peer: " + bench.PeerName + ", " + c.header + ", 1 run(s)", "speed vs peer (" + bench.PeerName + " " + c.wantPeer + ", preset"} {
				if !strings.Contains(text, w) {
					t.Errorf("--out lacks %q:\n%s", w, text)
				}
			}
			if mismatch := strings.Contains(text, "; not like for like: the peer ran"); mismatch != (c.note != "") || (c.note != "" && !strings.Contains(text, "- note: "+c.note)) {
				t.Errorf("--out's summary and notes do not say the mismatch (%v):\n%s", c.note != "", text)
			}
		})
	}
}

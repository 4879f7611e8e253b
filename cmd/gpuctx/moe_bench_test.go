package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/moe"
)

// onlyProgress fails unless every line of stderr is a progress line or a
// warning of command name ("moe bench: ...").
func onlyProgress(t *testing.T, name, stderr string) {
	t.Helper()
	for _, l := range strings.Split(strings.TrimSpace(stderr), "\n") {
		if l != "" && !strings.HasPrefix(l, name+": ") {
			t.Errorf("stderr line %q is not a %s progress line:\n%s", l, name, stderr)
		}
	}
}

// TestMoeBenchRounds: --rounds 3 with the fake peer alternates gpuctx and the
// peer (gpuctx first, then the peer first, then gpuctx first), passes both
// the same number of weight sets, and reports each round's ratio.
func TestMoeBenchRounds(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	allowPeerOnCPU = true
	defer func() { allowPeerOnCPU = false }()
	argsFile := filepath.Join(t.TempDir(), "args")
	t.Setenv("FAKE_PEER_ARGS", argsFile)
	code, stdout, stderr := execute(t, "moe", "bench", "--tokens", "1,4", "--iters", "2", "--warmup", "0", "--sets", "2", "--rounds", "3",
		"--peer", fakePeer, "--peer-python", fakePeer, "--json")
	if code != 0 {
		t.Fatalf("exit %d, stderr %s", code, stderr)
	}
	var order []string
	for _, l := range strings.Split(stderr, "\n") {
		switch {
		case strings.Contains(l, "running the peer"):
			order = append(order, "peer")
		case strings.Contains(l, "T=1 reference"):
			order = append(order, "gpuctx")
		}
	}
	if got := strings.Join(order, ","); got != "gpuctx,peer,peer,gpuctx,gpuctx,peer" {
		t.Errorf("order %s, want gpuctx,peer,peer,gpuctx,gpuctx,peer", got)
	}
	if b, _ := os.ReadFile(argsFile); !strings.HasSuffix(strings.TrimSpace(string(b)), "--sets 2") {
		t.Errorf("peer args %q lack --sets 2", b)
	}
	var rep moeBenchReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Rounds != 3 || rep.Sets != 2 || rep.WeightDist != "normal" || rep.Peer == nil || rep.Peer.Runs != 3 {
		t.Fatalf("report: rounds %d sets %d dist %q peer %+v", rep.Rounds, rep.Sets, rep.WeightDist, rep.Peer)
	}
	if r := rep.Rows[0]; r.PeerActiveExperts == nil || *r.PeerActiveExperts != 5.5 {
		t.Errorf("T=1: the peer's active experts %v, want 5.5", r.PeerActiveExperts)
	}
	for _, r := range rep.Rows {
		if len(r.RoundSpeedups) != 3 || r.SpeedupMin == nil || r.SpeedupMax == nil || *r.SpeedupMin > *r.SpeedupVsPeer || *r.SpeedupVsPeer > *r.SpeedupMax {
			t.Errorf("T=%d: ratios %v, min/median/max %v %v %v", r.Tokens, r.RoundSpeedups, r.SpeedupMin, r.SpeedupVsPeer, r.SpeedupMax)
		}
		if len(r.CheckRelErr) != 2 || r.ActiveExperts <= 0 {
			t.Errorf("T=%d: check %v, experts %v", r.Tokens, r.CheckRelErr, r.ActiveExperts)
		}
	}
	if !slices.Contains(rep.Notes, "round 1: the peer rotated 1 weight set(s), gpuctx 2 (the peer drops sets that do not fit in 60% of its free device memory)") {
		t.Errorf("no note that the peer rotated fewer sets: %q", rep.Notes)
	}
	checkBenchMemoryNote(t, &rep, 4)
	if md := markdown(&rep); !strings.Contains(md, "3 run(s) alternating") || !strings.Contains(md, "rotating over 2 weight and input set(s)") ||
		!strings.Contains(md, "N(0, 0.02²)") || !strings.Contains(md, ") |") {
		t.Errorf("markdown lacks the rounds, sets, distribution or ratio range:\n%s", md)
	}
}

// checkBenchMemoryNote checks moe bench's device memory per layer: the JSON
// field (weight set 0's layer after the largest batch, tokens) with its parts
// adding up, and the note line in the markdown that prints its numbers
// (bench's TestMoEBenchRounds checks them against the layer and MemInfo).
func checkBenchMemoryNote(t *testing.T, rep *moeBenchReport, tokens int) {
	t.Helper()
	m := rep.Memory
	if m == nil {
		t.Fatal("--json lacks device_memory")
	}
	if m.Tokens != tokens || m.Weights <= 0 || m.Scratch <= 0 || m.PinnedHost <= 0 || m.MainStreamWorkspace <= 0 || m.TotalBytes != m.Total() {
		t.Errorf("device_memory %+v", *m)
	}
	line := fmt.Sprintf("- note: device memory per layer (weight set 0) after the largest batch (%d tokens): %s; besides, the main stream that the %d layer(s) share holds a BLAS workspace of %s\n",
		tokens, m.Text(), rep.Sets, bench.ByteSize(m.MainStreamWorkspace))
	if md := markdown(rep); !strings.Contains(md, line) {
		t.Errorf("markdown lacks %q:\n%s", line, md)
	}
}

func TestMoeBenchFlagFailures(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"zero rounds", []string{"--rounds", "0"}, "--rounds 0"},
		{"too many sets", []string{"--sets", "17"}, "--sets 17"},
		{"bad distribution", []string{"--weights", "gauss"}, `--weights "gauss" is not a distribution`},
		{"distribution with model", []string{"--weights", "normal", "--model", fixture}, "--weights with --model"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := execute(t, append([]string{"moe", "bench", "--tokens", "1", "--iters", "1"}, c.args...)...)
			wantOneLineFailure(t, code, stdout, stderr, c.want)
		})
	}
}

func TestLargerThanCPUShape(t *testing.T) {
	tiny, err := moe.LoadConfig(fixture)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		cfg  *moe.Config
		want bool
	}{
		{"fixture checkpoint (H=64)", tiny, false},
	}
	for _, p := range moe.PresetNames() {
		cfg, err := moe.Preset(p)
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, struct {
			name string
			cfg  *moe.Config
			want bool
		}{"preset " + p, cfg, true})
		small, err := scaleDown(cfg)
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, struct {
			name string
			cfg  *moe.Config
			want bool
		}{"preset " + p + " scaled down", small, false})
	}
	for _, c := range cases {
		if got := largerThanCPUShape(c.cfg); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

package moe

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// tuneFP8Anywhere has new layers time their tiles on any backend
// (tuneAnyBackend) for the rest of the test, with tuneTimes set to times
// (nil: the measured times), and counts the timings.
func tuneFP8Anywhere(t *testing.T, times func(what string, d time.Duration) time.Duration) *atomic.Int64 {
	t.Helper()
	var n atomic.Int64
	tuneAnyBackend, tuneTimes = true, times
	timingHook = func(bool) { n.Add(1) }
	t.Cleanup(func() { tuneAnyBackend, tuneTimes, timingHook = false, nil, nil })
	return &n
}

// favour returns a tuneTimes that makes the kernels of pair tp the cheapest
// (1 ns each) and every other launch 1 ms: tune must pick tp where it times
// it. A w8a8 chain counts as one launch; a w8a16 pair timed as a chain
// ("w8a16 up/down") costs what its two kernels cost apart.
func favour(tp fp8Pair) func(string, time.Duration) time.Duration {
	cheap := []string{"up " + tp.up.Tag(), "down " + tp.down.Tag()}
	if tp.w8 {
		cheap = []string{tp.tags()}
	}
	cost := func(what string) time.Duration {
		if slices.Contains(cheap, what) {
			return time.Nanosecond
		}
		return time.Millisecond
	}
	return func(what string, _ time.Duration) time.Duration {
		if pair, ok := strings.CutPrefix(what, "w8a16 "); ok {
			up, down, _ := strings.Cut(pair, "/")
			return cost("up "+up) + cost("down "+down)
		}
		return cost(what)
	}
}

// fp8KernelNames returns the names of the FP8 expert kernels (w8a16 and
// w8a8 tiles) that one forward of mode launches, from a trace.
func fp8KernelNames(t *testing.T, l *Layer, x []float32, T int, mode Mode) (names []string, y []byte) {
	t.Helper()
	tf, y := traceRun(t, l, x, T, mode)
	for _, e := range tf.TraceEvents {
		if e.Ph == "X" && (strings.HasPrefix(e.Name, "gpuctx_moe_fp8_up_") || strings.HasPrefix(e.Name, "gpuctx_moe_fp8_down_") ||
			strings.HasPrefix(e.Name, "gpuctx_moe_w8a8_")) && !slices.Contains(names, e.Name) {
			names = append(names, e.Name)
		}
	}
	slices.Sort(names)
	return names, y
}

// kernelNames is the sorted names of tp's expert kernels.
func (tp fp8Pair) kernelNames() []string {
	n := []string{tp.up.UpName(), tp.down.DownName()}
	if tp.w8 {
		n = []string{tp.w8up.Name(), tp.w8down.Name()}
	}
	slices.Sort(n)
	return n
}

// TestLayerFP8Tune times an FP8 layer's tiles on the CPU backend
// (tuneAnyBackend) with tuneTimes making one candidate the cheapest, per
// token bucket: the tuner keeps that candidate for the bucket (the w8a8
// pairs only where they may run: the w8a8 tiles loaded, at least
// w8a8MinRows rows per touched expert, the shared expert not fused), logs
// one fp8 line naming every candidate timed, and the forwards launch that
// pair's kernels and no other FP8 tile, eagerly and from a graph; Dual is
// bitwise Single; and where the pair is of the family the rule (an
// untuned layer) picks, the result is bitwise the untuned layer's.
func TestLayerFP8Tune(t *testing.T) {
	cfg := fp8Configs()["deepseek_v3"] // E 8, K 3, a fusable shared expert
	w, err := RandomWeights(cfg, 17)
	if err != nil {
		t.Fatal(err)
	}
	E, K := cfg.NumExperts, cfg.TopK
	small16 := fp8Pair{up: moekernels.FP8Gemms[0], down: moekernels.FP8Gemms[2]}
	w32 := fp8Pair{up: moekernels.FP8Gemms[5], down: moekernels.FP8Gemms[6]}
	// Where the favoured w8a8 pair is not timed, every w8a16 tile costs the
	// same and the first wins (the first BM, then the first tile).
	first := fp8Pair{up: moekernels.FP8Gemms[0], down: moekernels.FP8Gemms[0]}
	type tuneCase struct {
		name    string
		T       int
		mode    Mode // the first forward, which tunes
		favour  fp8Pair
		want    fp8Pair
		w8a8    bool // w8a8 chains timed
		rowsMin int  // rows per touched expert, at least
		reduced bool // also under the race detector or -short
	}
	t8, t16 := w8a8Pairs[3], w8a8Pairs[4]
	cases := []tuneCase{
		{"1 token", 1, Single, small16, small16, true, 1, true},
		{"1 token: m64 not timed", 1, Dual, w8a8Pairs[0], t8, true, 1, false},
		{"transposed w8a8", 20, Dual, t16, t16, true, w8a8TuneRows, true},
		{"w8a16 beats w8a8", 48, Dual, w32, w32, true, w8a8MinRows, false},
		{"w8a8 m64", 48, Single, w8a8Pairs[0], w8a8Pairs[0], true, w8a8MinRows, false},
		{"w8a8 m128", 200, Dual, w8a8Pairs[1], w8a8Pairs[1], true, w8a8LargeRows, false},
		{"w8a8 m64 at many rows", 200, Single, w8a8Pairs[0], w8a8Pairs[0], true, w8a8LargeRows, false},
		{"t8 not timed at many rows", 200, Single, t8, w8a8Pairs[0], true, w8a8LargeRows, false},
		{"fused shared: no w8a8", 200, FusedShared, w8a8Pairs[1], first, false, w8a8LargeRows, false},
	}
	if raceEnabled || testing.Short() {
		// CI's race step (2 cores): the CPU twins under the race detector
		// took 302 s for seven cases (session 10). The 20-token case times
		// both families, every w8a8 pair among them (15 s there, against
		// 40 s for the 48-token case); a plain go test runs all of them.
		cases = slices.DeleteFunc(cases, func(tc tuneCase) bool { return !tc.reduced })
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if r := rowsPerExpert(tc.T, K, E); r < tc.rowsMin {
				t.Fatalf("T=%d: %d rows per expert, want >= %d", tc.T, r, tc.rowsMin)
			}
			timings := tuneFP8Anywhere(t, favour(tc.favour))
			b := layerBackends(t)[0]
			x := randomX(tc.T, cfg.HiddenSize, uint64(tc.T)+11)
			eager := checkFP8Tune(t, b, cfg, w, x, tc.mode, tc.want, tc.w8a8, false, timings)
			if graphs := checkFP8Tune(t, b, cfg, w, x, tc.mode, tc.want, tc.w8a8, true, timings); !bytes.Equal(graphs, eager) {
				t.Errorf("T=%d %v: the graph layer differs from the eager one", tc.T, tc.mode)
			}
			checkFP8RuleFamily(t, b, cfg, w, x, tc.T, tc.mode, tc.want, eager)
		})
	}
}

// TestLayerFP8TuneW8A16Chain: where the w8a8 chains are timed, the tuner
// compares them with the w8a16 pair timed as a chain too (up then down, as
// the forward queues them), not with the sum of its kernels timed apart.
// With the kernels apart cheaper than the t16 chain (40 + 40 against 90 us)
// but the w8a16 chain dearer (100 us), it keeps t16, and its line lists
// the w8a16 chain beside the w8a8 ones.
func TestLayerFP8TuneW8A16Chain(t *testing.T) {
	if raceEnabled {
		t.Skip("the CPU twins of every FP8 tile under the race detector: go test runs it")
	}
	cfg := fp8Configs()["deepseek_v3"]
	w, err := RandomWeights(cfg, 17)
	if err != nil {
		t.Fatal(err)
	}
	t16 := w8a8Pairs[4]
	timings := tuneFP8Anywhere(t, func(what string, _ time.Duration) time.Duration {
		switch {
		case strings.HasPrefix(what, "up "), strings.HasPrefix(what, "down "):
			return 40 * time.Microsecond
		case strings.HasPrefix(what, "w8a16 "):
			return 100 * time.Microsecond
		case what == t16.tags():
			return 90 * time.Microsecond
		}
		return time.Millisecond
	})
	const T = 20
	l, err := NewLayer(layerBackends(t)[0].dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: true, NoGraphs: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	deviceRun(t, l, randomX(T, cfg.HiddenSize, 31), T, Dual, Whole)
	if got := l.tuner.fp8[tileKey{tileBucket(T), false}]; got != t16 {
		t.Errorf("tuned %s, want %s: the w8a16 pair's kernels timed apart (80 us) beat the t16 chain (90 us), its chain (100 us) does not", got.tags(), t16.tags())
	}
	lines := l.TileChoices()
	if len(lines) != 1 || !strings.Contains(lines[0], "; chains us: w8a16 ") || !strings.Contains(lines[0], ", "+t16.w8up.Tag()+"/"+t16.w8down.Tag()+" 90.0") {
		t.Errorf("TileChoices %q: want one line listing the w8a16 chain, then the t16 chain at 90.0 us", lines)
	}
	if timings.Load() == 0 {
		t.Error("nothing was timed")
	}
}

// checkFP8Tune runs TestLayerFP8Tune's checks for one bucket on a tuning
// FP8 layer (graphs: captured and replayed forwards after the first)
// whose first forward, of x in mode, is to pick want (with the w8a8 chains
// timed or not), and returns that forward's output.
func checkFP8Tune(t *testing.T, b testBackend, cfg *Config, w *Weights, x []float32, mode Mode, want fp8Pair, w8a8, graphs bool, timings *atomic.Int64) []byte {
	t.Helper()
	l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: true, NoGraphs: !graphs})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !l.experts.q.w8 || !l.tuner.autotune {
		t.Fatalf("the CPU layer has w8a8 tiles %v, autotunes %v: want both", l.experts.q.w8, l.tuner.autotune)
	}
	rec := recordPlans(l, nil)
	T := len(x) / cfg.HiddenSize
	first := deviceRun(t, l, x, T, mode, Whole)
	fused := mode == FusedShared
	key := tileKey{tileBucket(T), fused}
	if got, ok := l.tuner.fp8[key]; !ok || got != want {
		t.Fatalf("T=%d %v: tuned %s (%v), want %s", T, mode, got.tags(), ok, want.tags())
	}
	checkFP8TuneLine(t, l, T, fused, want, w8a8)
	n := timings.Load()
	// Later forwards (eager; or captured, then replayed) run the tuned pair:
	// their plans hold it, and the eager ones launch its kernels only.
	for range 3 {
		var y []byte
		if graphs {
			y = deviceRun(t, l, x, T, mode, Whole)
		} else if names, yt := fp8KernelNames(t, l, x, T, mode); !slices.Equal(names, want.kernelNames()) {
			t.Errorf("T=%d %v: launched %v, want %v", T, mode, names, want.kernelNames())
		} else {
			y = yt
		}
		if p := rec.last; !p.tilesKnown || p.fp8 != want {
			t.Errorf("T=%d %v: a later forward planned %s (known %v), want %s", T, mode, p.fp8.tags(), p.tilesKnown, want.tags())
		}
		if y != nil && !bytes.Equal(y, first) {
			t.Errorf("T=%d %v: not reproducible", T, mode)
		}
	}
	if !fused {
		single := deviceRun(t, l, x, T, Single, Whole)
		if dual := deviceRun(t, l, x, T, Dual, Whole); !bytes.Equal(single, dual) || !bytes.Equal(single, first) {
			t.Errorf("T=%d: Dual differs from Single, or a mode from the tuning forward's", T)
		}
	}
	if m := timings.Load(); m != n || len(l.TileChoices()) != 1 {
		t.Errorf("T=%d: the bucket was timed again (%d timings after tuning; %d lines)", T, m-n, len(l.TileChoices()))
	}
	return first
}

// checkFP8TuneLine checks the TileChoices line of a tuned FP8 bucket: the
// choice, every w8a16 tile timed, and the w8a8 chains where they ran.
func checkFP8TuneLine(t *testing.T, l *Layer, T int, fused bool, want fp8Pair, w8a8 bool) {
	t.Helper()
	lines := l.TileChoices()
	if len(lines) != 1 {
		t.Fatalf("T=%d: TileChoices %q, want one line", T, lines)
	}
	line := lines[0]
	head := fmt.Sprintf("T=%d (bucket %d, fused shared %v, fp8): %s, ", T, tileBucket(T), fused, want.upDown())
	if !strings.HasPrefix(line, head) {
		t.Errorf("TileChoices line %q, want it to start %q", line, head)
	}
	for _, c := range moekernels.FP8Gemms {
		if !strings.Contains(line, c.Tag()+" ") {
			t.Errorf("TileChoices line %q lacks w8a16 tile %s", line, c.Tag())
		}
	}
	if got := strings.Contains(line, "; chains us: "); got != w8a8 {
		t.Errorf("TileChoices line %q: chains listed %v, want %v", line, got, w8a8)
	}
	// With the w8a8 chains, the w8a16 pair the tiles' own timings chose is
	// timed as a chain too (its up and down of one BM).
	if w8a8 && !want.w8 && !strings.Contains(line, "chains us: w8a16 "+want.up.Tag()+"/"+want.down.Tag()+" ") {
		t.Errorf("TileChoices line %q lacks the w8a16 chain of %s", line, want.tags())
	}
	m := rowsPerExpert(T, l.cfg.TopK, l.cfg.NumExperts)
	for _, tp := range w8a8Pairs {
		want := w8a8 && tp.timedAt(m)
		if got := strings.Contains(line, tp.w8up.Tag()+"/"+tp.w8down.Tag()+" "); got != want {
			t.Errorf("TileChoices line %q: w8a8 pair %s listed %v, want %v (%d rows per expert)", line, tp.tags(), got, want, m)
		}
	}
}

// checkFP8RuleFamily compares first, the tuned layer's forward, with an
// untuned layer's (NoAutotune: the rule, fp8Tiles): bitwise equal where the
// rule's pair is of want's family (w8a16 or w8a8: the tile within a family
// changes no result on the CPU backend), different elsewhere (the w8a8
// tiles quantize the activations).
func checkFP8RuleFamily(t *testing.T, b testBackend, cfg *Config, w *Weights, x []float32, T int, mode Mode, want fp8Pair, first []byte) {
	t.Helper()
	ref, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: true, NoAutotune: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	rec := recordPlans(ref, nil)
	got := deviceRun(t, ref, x, T, mode, Whole)
	if rule := ref.fp8Rule(&rec.last); rec.last.fp8 != rule || len(ref.TileChoices()) != 0 {
		t.Fatalf("T=%d: the untuned layer ran %s, want the rule's %s, and logged %q", T, rec.last.fp8.tags(), rule.tags(), ref.TileChoices())
	}
	if same := rec.last.fp8.w8 == want.w8; same != bytes.Equal(got, first) {
		t.Errorf("T=%d %v: tuned %s, rule %s: bitwise equal %v, want %v", T, mode, want.tags(), rec.last.fp8.tags(), !same, same)
	}
}

// TestTuneCacheFP8 stores FP8 choices of several buckets and reads them back
// through a fresh handle; a bf16 read of an FP8 record (and an FP8 read of a
// bf16 one) misses; an entry with a bad FP8 record is ignored whole; and an
// FP8 layer's key differs from the bf16 layer's of its shape, which stays as
// it was (no fp8 in it: old entries still load).
func TestTuneCacheFP8(t *testing.T) {
	dir := t.TempDir()
	key := testIdent().key()
	c := newTuneCache(dir, key)
	w16 := fp8Pair{up: moekernels.FP8Gemms[1], down: moekernels.FP8Gemms[4]}
	stores := []struct {
		k  tileKey
		tp fp8Pair
	}{{tileKey{1, false}, w16}, {tileKey{64, false}, w8a8Pairs[0]}, {tileKey{256, false}, w8a8Pairs[1]}, {tileKey{256, true}, w16}}
	for _, st := range stores {
		if err := storeChoice(c, st.k, st.tp); err != nil {
			t.Fatal(err)
		}
	}
	r := newTuneCache(dir, key)
	for _, st := range stores {
		if got, ok := cachedChoice[fp8Pair](r, st.k); !ok || got != st.tp {
			t.Errorf("%+v: %s %v, want %s", st.k, got.tags(), ok, st.tp.tags())
		}
		if _, ok := r.tiles(st.k); ok {
			t.Errorf("%+v: an FP8 record read as bf16 tiles", st.k)
		}
	}
	if _, ok := cachedChoice[fp8Pair](r, tileKey{2, false}); ok {
		t.Error("a bucket never stored hit")
	}
	b := newTuneCache(t.TempDir(), key)
	if err := b.storeTiles(tileKey{1, false}, tilePair{tileA, tileB}); err != nil {
		t.Fatal(err)
	}
	if _, ok := cachedChoice[fp8Pair](b, tileKey{1, false}); ok {
		t.Error("a bf16 record read as FP8 tiles")
	}
	for _, bad := range []tuneTile{
		{Bucket: 8, Up: w16.up.Tag(), Down: w16.down.Tag(), Kind: "w4a16"},
		{Bucket: 8, Up: "m16n1w1s1", Down: w16.down.Tag(), Kind: kindW8A16},
		{Bucket: 8, Up: moekernels.FP8Gemms[0].Tag(), Down: moekernels.FP8Gemms[6].Tag(), Kind: kindW8A16}, // BM 16 and 32
		{Bucket: 8, Up: w8a8Up.Tag(), Down: w8a8SmallDown.Tag(), Kind: kindW8A8},                           // not a loaded pair
		{Bucket: 8, Up: w16.up.Tag(), Down: w16.down.Tag(), Kind: kindW8A8},
	} {
		bc := newTuneCache(t.TempDir(), key)
		if err := storeChoice(bc, tileKey{1, false}, w16); err != nil {
			t.Fatal(err)
		}
		if err := bc.update(func(e *tuneEntry) { e.Tiles = append(e.Tiles, bad) }); err != nil {
			t.Fatal(err)
		}
		if _, ok := cachedChoice[fp8Pair](bc, tileKey{1, false}); ok {
			t.Errorf("record %+v: the entry still hits", bad)
		}
	}
	dev := layerBackends(t)[0].dev
	l, err := NewLayer(dev, fp8Configs()["deepseek_v3"], mustRandomWeights(t, fp8Configs()["deepseek_v3"], 3), LayerOptions{DType: gpuctx.BF16, FP8: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	k8, k16 := tuneKeyText(dev, l, fp8Any), tuneKeyText(dev, l, noFP8)
	if k8 == k16 || !strings.HasPrefix(k8, k16+"|fp8 ") || strings.Contains(k16, "fp8") {
		t.Errorf("FP8 key %q, bf16 key %q: want the bf16 key and an fp8 part", k8, k16)
	}
}

// mustRandomWeights is RandomWeights, failing t on error.
func mustRandomWeights(t *testing.T, cfg *Config, seed uint64) *Weights {
	t.Helper()
	w, err := RandomWeights(cfg, seed)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestLayerFP8TuneCache tunes an FP8 layer (tuneAnyBackend, the 128-row w8a8
// pair made cheapest where the rule picks the 64-row one) with a cache
// directory: a second FP8 layer of the same shape times nothing, logs the
// cached choice, runs it and gives the same bits; a bf16 layer of the same
// shape, sharing the directory, misses (it times its own tiles), and the FP8
// entry still hits after it.
func TestLayerFP8TuneCache(t *testing.T) {
	cfg := fp8Configs()["deepseek_v3"]
	w := mustRandomWeights(t, cfg, 23)
	const T = 48 // 18 rows per touched expert: the rule's w8a8 pair is the 64-row one
	want := w8a8Pairs[1]
	if rule := fp8Tiles(T, cfg.TopK, cfg.NumExperts, true); rule == want {
		t.Fatalf("the rule picks %s at %d tokens: the test cannot tell a cached choice from it", rule.tags(), T)
	}
	timings := tuneFP8Anywhere(t, favour(want))
	useTuneCache(t, t.TempDir())
	b := layerBackends(t)[0]
	x := randomX(T, cfg.HiddenSize, 9)
	var first []byte
	type step struct {
		name      string
		fp8       bool
		wantTimed bool
	}
	steps := []step{{"cold", true, true}, {"warm", true, false}, {"bf16", false, true}, {"warm after bf16", true, false}}
	if raceEnabled || testing.Short() {
		// CI's race step: the bf16 layer times all 35 bf16 tiles on the
		// CPU twins (most of this test's 60 s there); TestTuneCacheFP8
		// checks the keys apart, and a plain go test runs every step.
		steps = steps[:2]
	}
	for _, tc := range steps {
		timings.Store(0)
		l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: tc.fp8})
		if err != nil {
			t.Fatal(err)
		}
		rec := recordPlans(l, nil)
		got := deviceRun(t, l, x, T, Single, Whole)
		got2 := deviceRun(t, l, x, T, Single, Whole) // planned with the choice kept
		lines := l.TileChoices()
		_ = l.Close()
		if n := timings.Load(); (n > 0) != tc.wantTimed {
			t.Errorf("%s: %d timings, want some: %v", tc.name, n, tc.wantTimed)
		}
		if !tc.fp8 {
			continue
		}
		line := fmt.Sprintf("T=%d (bucket %d, fused shared false, fp8): %s%s", T, tileBucket(T), want.upDown(), fromCacheNote)
		if len(lines) != 1 || (lines[0] == line) == tc.wantTimed {
			t.Errorf("%s: TileChoices %q (cached: %q)", tc.name, lines, line)
		}
		if rec.last.fp8 != want {
			t.Errorf("%s: ran %s, want %s", tc.name, rec.last.fp8.tags(), want.tags())
		}
		if first == nil {
			first = got
		}
		if !bytes.Equal(got, first) || !bytes.Equal(got2, first) {
			t.Errorf("%s: output differs from the tuned run's", tc.name)
		}
	}
}

// TestLayerFP8WeightOnly checks LayerOptions.FP8WeightOnly on every backend
// (the CPU backend's twins stand in for every FP8 tile): without FP8 it is
// refused; with it the layer loads no w8a8 tiles, the tuner times no w8a8
// chain even when one is made the cheapest, the rule keeps w8a16 where it
// would run w8a8, a forward launches w8a16 kernels only, and the result is
// within the w8a16 tiles' 1e-2 of the float64 reference on the dequantized
// weights. Its tuning cache key differs from the FP8 layer's.
func TestLayerFP8WeightOnly(t *testing.T) {
	cfg := fp8Configs()["deepseek_v3"]
	w := mustRandomWeights(t, cfg, 23)
	// The fewest tokens that an FP8 layer runs in w8a8 tiles by rule.
	T := 1
	for !fp8Tiles(T, cfg.TopK, cfg.NumExperts, true).w8 {
		T++
	}
	x := randomX(T, cfg.HiddenSize, 29)
	want, err := Reference(cfg, fp8Dequantized(t, cfg, w), roundAll(x), T)
	if err != nil {
		t.Fatal(err)
	}
	timings := tuneFP8Anywhere(t, favour(w8a8Pairs[3]))
	for _, b := range layerBackends(t) {
		t.Run(b.name, func(t *testing.T) {
			dev := b.dev
			if _, err := NewLayer(dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8WeightOnly: true}); !errors.Is(err, gpuctx.ErrInvalid) || !strings.Contains(err.Error(), "FP8WeightOnly needs FP8") {
				t.Fatalf("FP8WeightOnly without FP8: %v, want ErrInvalid naming the option", err)
			}
			for _, tuned := range []bool{true, false} {
				l, err := NewLayer(dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: true, FP8WeightOnly: true, NoAutotune: !tuned, NoGraphs: true})
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				if l.experts.q.w8 {
					t.Fatalf("tuned %v: the weight-only layer loaded the w8a8 tiles", tuned)
				}
				n0 := timings.Load()
				got, err := l.Forward(x, T) // tunes the bucket where the layer autotunes
				if err != nil {
					t.Fatal(err)
				}
				if tuned {
					lines := l.TileChoices()
					if timings.Load() == n0 || len(lines) != 1 || strings.Contains(lines[0], "w8a8") {
						t.Errorf("tuned: %d timings, TileChoices %q: want one tuned line without w8a8", timings.Load()-n0, lines)
					}
				}
				names, _ := fp8KernelNames(t, l, x, T, Single)
				for _, name := range names {
					if strings.HasPrefix(name, "gpuctx_moe_w8a8_") {
						t.Errorf("tuned %v: launched %s", tuned, name)
					}
				}
				if len(names) != 2 {
					t.Errorf("tuned %v: FP8 kernels %v, want a w8a16 up and down", tuned, names)
				}
				if rel := relErr(got, want); !(rel <= 1e-2) {
					t.Errorf("tuned %v: relative error %.3g against the reference on the dequantized weights, want <= 1e-2", tuned, rel)
				}
			}
			l, err := NewLayer(dev, cfg, w, LayerOptions{DType: gpuctx.BF16, FP8: true, NoAutotune: true})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			if kw, k8 := tuneKeyText(dev, l, fp8WeightOnly), tuneKeyText(dev, l, fp8Any); kw == k8 || !strings.HasPrefix(kw, k8) {
				t.Errorf("weight-only key %q, FP8 key %q: want the FP8 key and more", kw, k8)
			}
		})
	}
}

package moe

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

func init() {
	// The package's tests run with the tuning cache off (no entries under
	// the user's cache directory, no tuning carried between runs) unless a
	// test sets a directory (useTuneCache).
	tuneGetenv = func(string) string { return "off" }
}

// useTuneCache points new Layers' tuning cache at dir ("off" disables it) for
// the rest of the test.
func useTuneCache(t *testing.T, dir string) {
	t.Helper()
	old := tuneGetenv
	tuneGetenv = func(k string) string {
		if k == tuneCacheEnv {
			return dir
		}
		return os.Getenv(k)
	}
	t.Cleanup(func() { tuneGetenv = old })
}

// TestTuneCacheDir checks where GPUCTX_KERNEL_CACHE puts the tuning cache.
func TestTuneCacheDir(t *testing.T) {
	base, err := os.UserCacheDir()
	def := ""
	if err == nil {
		def = filepath.Join(base, "gpuctx", "tuning")
	}
	for _, tc := range []struct{ env, want string }{
		{"off", ""}, {"OFF", ""}, {" off ", ""},
		{"/tmp/kc", "/tmp/kc/tuning"}, {" /tmp/kc ", "/tmp/kc/tuning"},
		{"", def},
	} {
		got := tuneCacheDir(func(k string) string {
			if k != tuneCacheEnv {
				t.Errorf("read %s, want %s", k, tuneCacheEnv)
			}
			return tc.env
		})
		if got != tc.want {
			t.Errorf("GPUCTX_KERNEL_CACHE=%q: dir %q, want %q", tc.env, got, tc.want)
		}
	}
}

// testIdent is a tuning identity with every field set.
func testIdent() tuneIdent {
	return tuneIdent{backend: "cuda", sources: "abc", shape: "H 2048 E 64",
		dev: gpuctx.DeviceInfo{Name: "NVIDIA H200", ComputeMajor: 9, SMCount: 132, DriverVersion: 13000}}
}

var (
	tileA = moekernels.MoEGemms[0]
	tileB = moekernels.MoEGemms[1]
)

// TestTuneCacheRoundTrip stores tiles and modes of several buckets and reads
// them back through a fresh handle, as the next process would.
func TestTuneCacheRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tuning")
	key := testIdent().key()
	c := newTuneCache(dir, key)
	if _, ok := c.tiles(tileKey{1, true}); ok {
		t.Fatal("empty cache hit")
	}
	k1, k1s, k64 := tileKey{1, false}, tileKey{1, true}, tileKey{64, false}
	for _, st := range []struct {
		k  tileKey
		tp tilePair
	}{{k1, tilePair{tileA, tileB}}, {k1s, tilePair{tileB, tileB}}, {k64, tilePair{tileA, tileA}}, {k1, tilePair{tileB, tileA}}} {
		if err := c.storeTiles(st.k, st.tp); err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range []struct {
		b int
		m Mode
	}{{1, FusedShared}, {64, Dual}} {
		if err := c.storeMode(m.b, m.m); err != nil {
			t.Fatal(err)
		}
	}
	r := newTuneCache(dir, key)
	for _, tc := range []struct {
		k    tileKey
		want tilePair
		ok   bool
	}{{k1, tilePair{tileB, tileA}, true}, {k1s, tilePair{tileB, tileB}, true}, {k64, tilePair{tileA, tileA}, true}, {tileKey{2, false}, tilePair{}, false}} {
		if got, ok := r.tiles(tc.k); ok != tc.ok || got != tc.want {
			t.Errorf("tiles(%+v) = %s/%s %v, want %s/%s %v", tc.k, got.up.Tag(), got.down.Tag(), ok, tc.want.up.Tag(), tc.want.down.Tag(), tc.ok)
		}
	}
	for _, tc := range []struct {
		b    int
		want Mode
		ok   bool
	}{{1, FusedShared, true}, {64, Dual, true}, {8, 0, false}} {
		if got, ok := r.mode(tc.b); ok != tc.ok || got != tc.want {
			t.Errorf("mode(%d) = %v %v, want %v %v", tc.b, got, ok, tc.want, tc.ok)
		}
	}
}

// TestTuneCacheKey checks that another device, driver, kernel source or layer
// shape misses an entry, both by its file and, should two keys share a file,
// by the key stored in it.
func TestTuneCacheKey(t *testing.T) {
	dir := t.TempDir()
	base := testIdent()
	if err := newTuneCache(dir, base.key()).storeTiles(tileKey{1, false}, tilePair{tileA, tileA}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		change func(*tuneIdent)
	}{
		{"device name", func(id *tuneIdent) { id.dev.Name = "NVIDIA H100" }},
		{"compute capability", func(id *tuneIdent) { id.dev.ComputeMinor = 1 }},
		{"multiprocessors", func(id *tuneIdent) { id.dev.SMCount = 66 }},
		{"driver", func(id *tuneIdent) { id.dev.DriverVersion = 12080 }},
		{"backend", func(id *tuneIdent) { id.backend = "rocm" }},
		{"kernel sources", func(id *tuneIdent) { id.sources = "abd" }},
		{"layer shape", func(id *tuneIdent) { id.shape = "H 2048 E 160" }},
	} {
		id := base
		tc.change(&id)
		other := newTuneCache(dir, id.key())
		if other.path == newTuneCache(dir, base.key()).path {
			t.Errorf("%s: same entry file", tc.name)
		}
		if _, ok := other.tiles(tileKey{1, false}); ok {
			t.Errorf("%s: hit", tc.name)
		}
		other.path = newTuneCache(dir, base.key()).path // a collision
		if _, ok := other.tiles(tileKey{1, false}); ok {
			t.Errorf("%s: hit on another key's entry", tc.name)
		}
	}
	if _, ok := newTuneCache(dir, base.key()).tiles(tileKey{1, false}); !ok {
		t.Error("the same key misses")
	}
}

// TestTuneCacheCorrupt checks that a damaged or stale entry is ignored and
// that the next store rewrites it.
func TestTuneCacheCorrupt(t *testing.T) {
	key := testIdent().key()
	for _, tc := range []struct{ name, text string }{
		{"empty", ""},
		{"not json", "\x00\x01garbage"},
		{"truncated", `{"format": "` + tuneCacheFormat + `", "key": "`},
		{"other format", `{"format": "gpuctx-moe-tuning-0", "key": "KEY", "tiles": [{"bucket": 1, "up": "TAG", "down": "TAG"}]}`},
		{"other key", `{"format": "` + tuneCacheFormat + `", "key": "another", "tiles": [{"bucket": 1, "up": "TAG", "down": "TAG"}]}`},
		{"unknown tile", `{"format": "` + tuneCacheFormat + `", "key": "KEY", "tiles": [{"bucket": 1, "up": "m1n1k1", "down": "TAG"}]}`},
		{"unknown mode", `{"format": "` + tuneCacheFormat + `", "key": "KEY", "tiles": [{"bucket": 1, "up": "TAG", "down": "TAG"}], "modes": [{"bucket": 1, "mode": "both"}]}`},
		{"mode not measured", `{"format": "` + tuneCacheFormat + `", "key": "KEY", "tiles": [{"bucket": 1, "up": "TAG", "down": "TAG"}], "modes": [{"bucket": 1, "mode": "single"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTuneCache(t.TempDir(), key)
			keyJSON := strings.ReplaceAll(strings.ReplaceAll(key, `\`, `\\`), `"`, `\"`)
			text := strings.ReplaceAll(strings.ReplaceAll(tc.text, "KEY", keyJSON), "TAG", tileA.Tag())
			if err := os.WriteFile(c.path, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
			if _, ok := c.tiles(tileKey{1, false}); ok {
				t.Fatal("hit on a corrupt entry")
			}
			if err := c.storeMode(8, Dual); err != nil {
				t.Fatal(err)
			}
			if m, ok := c.mode(8); !ok || m != Dual {
				t.Errorf("after rewriting: mode %v %v, want dual", m, ok)
			}
			if _, ok := c.tiles(tileKey{1, false}); ok {
				t.Error("the rewrite kept the corrupt entry's tiles")
			}
		})
	}
	// The good entry the cases above damage, for reference: it hits.
	c := newTuneCache(t.TempDir(), key)
	if err := c.storeTiles(tileKey{1, false}, tilePair{tileA, tileA}); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.tiles(tileKey{1, false}); !ok {
		t.Error("a good entry misses")
	}
}

// TestTuneCacheOff checks that a disabled cache stores nothing and hits
// nothing.
func TestTuneCacheOff(t *testing.T) {
	c := newTuneCache(tuneCacheDir(func(string) string { return "off" }), testIdent().key())
	if err := c.storeTiles(tileKey{1, false}, tilePair{tileA, tileA}); err != nil {
		t.Fatal(err)
	}
	if err := c.storeMode(1, Dual); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.tiles(tileKey{1, false}); ok {
		t.Error("disabled cache hit")
	}
	if _, ok := c.mode(1); ok {
		t.Error("disabled cache hit")
	}
}

// TestLayerTuneCache runs Auto forwards that tune the fused tiles and the mode
// (on any backend, through tuneAnyBackend) with a cache directory: a second
// Layer of the same shape, as in a new process, times nothing and gives the
// same bits; with the cache off it times again.
func TestLayerTuneCache(t *testing.T) {
	cfg := scaledPresets()["deepseek-v2-lite"]
	w, err := RandomWeights(cfg, 31)
	if err != nil {
		t.Fatal(err)
	}
	tuneAnyBackend = true
	var timings atomic.Int64
	timingHook = func(bool) { timings.Add(1) }
	t.Cleanup(func() { tuneAnyBackend, timingHook = false, nil })
	const T = 2
	x := randomX(T, cfg.HiddenSize, 5)
	dir := t.TempDir()
	for _, b := range layerBackends(t) {
		var first []byte
		for _, tc := range []struct {
			name      string
			dir       string
			wantTimed bool
		}{{"cold", dir, true}, {"warm", dir, false}, {"warm again", dir, false}, {"off", "off", true}} {
			useTuneCache(t, tc.dir)
			timings.Store(0)
			l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1})
			if err != nil {
				t.Fatal(err)
			}
			got := deviceRun(t, l, x, T, Auto, Whole)
			lines := l.TileChoices()
			if l.TunedFromCache() == tc.wantTimed {
				t.Errorf("%s %s: TunedFromCache %v", b.name, tc.name, !tc.wantTimed)
			}
			_ = l.Close()
			if n := timings.Load(); (n > 0) != tc.wantTimed {
				t.Errorf("%s %s: %d timings, want some: %v", b.name, tc.name, n, tc.wantTimed)
			}
			for _, line := range lines {
				if strings.HasSuffix(line, fromCacheNote) == tc.wantTimed {
					t.Errorf("%s %s: TileChoices line %q", b.name, tc.name, line)
				}
			}
			if len(lines) == 0 {
				t.Errorf("%s %s: no TileChoices", b.name, tc.name)
			}
			if first == nil {
				first = got
			} else if tc.dir != "off" && !bytes.Equal(got, first) { // off may time another mode
				t.Errorf("%s %s: output differs from the tuned run's", b.name, tc.name)
			}
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPrefetchTiles checks that prefetchTiles looks up one kernel per
// compilation unit, each unit once, and that its wait returns after them.
func TestPrefetchTiles(t *testing.T) {
	b := layerBackends(t)[0]
	down := moekernels.MoEGemm{BM: 128, BN: 256, BK: 64, Warpgroups: 2, Stages: 3} // down-only
	for _, tc := range []struct {
		name  string
		tiles []moekernels.MoEGemm
		want  int64
	}{
		{"none", nil, 0},
		{"one", []moekernels.MoEGemm{tileA}, 1},
		{"repeated", []moekernels.MoEGemm{tileA, tileB, tileA, tileB}, 2},
		{"down-only", []moekernels.MoEGemm{down}, 1},
		{"every tile", moekernels.MoEGemms, int64(len(moekernels.MoEGemms))},
	} {
		before := b.dev.KernelStats().Lookups
		prefetchTiles(b.dev, tc.tiles)()
		if n := b.dev.KernelStats().Lookups - before; n != tc.want {
			t.Errorf("%s: %d lookups, want %d", tc.name, n, tc.want)
		}
	}
}

// TestExpectedTiles checks which tiles a layer compiles while it loads
// (LayerOptions.Tokens): the forced pair, the rule's tiles, the cached
// tuning's, tune's candidates, and nothing off CUDA or without the hint.
func TestExpectedTiles(t *testing.T) {
	cfg := scaledPresets()["deepseek-v2-lite"]
	dir := t.TempDir()
	useTuneCache(t, dir)
	b := layerBackends(t)[0]
	w, err := RandomWeights(cfg, 3)
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLayer(b.dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.tuner.cache.storeTiles(tileKey{64, false}, tilePair{tileA, tileB}); err != nil {
		t.Fatal(err)
	}
	forced := tileB
	rule := ruleTile(1, cfg.TopK, cfg.NumExperts)
	ruleShared := ruleTile(1, cfg.TopK+l.ns, cfg.NumExperts+l.ns)
	for _, tc := range []struct {
		name     string
		backend  string
		tokens   []int
		autotune bool
		force    *moekernels.MoEGemm
		want     []moekernels.MoEGemm
	}{
		{"cpu", "cpu", []int{1}, true, nil, nil},
		{"no hint", "cuda", nil, true, nil, nil},
		{"forced", "cuda", []int{1, 64}, true, &forced, []moekernels.MoEGemm{forced, forced}},
		{"rule", "cuda", []int{1}, false, nil, []moekernels.MoEGemm{rule, ruleShared}},
		{"cached", "cuda", []int{64}, true, nil, []moekernels.MoEGemm{tileA, tileB}},
		{"tune candidates", "cuda", []int{1}, true, nil, tuneCandidates(1)},
	} {
		l.tuner.autotune, l.tuner.forceTile = tc.autotune, tc.force
		if got := l.expectedTiles(tc.backend, tc.tokens); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %d tiles %v, want %d %v", tc.name, len(got), got, len(tc.want), tc.want)
		}
	}
	if n := len(tuneCandidates(1)); n == 0 || n == len(tuneCandidates(64)) {
		t.Errorf("tune candidates: %d at 1 token, %d at 64; want the 16-row tiles only at 1", n, len(tuneCandidates(64)))
	}
}

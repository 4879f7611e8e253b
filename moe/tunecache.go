package moe

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// The disk cache of tuning results: what the tuner measured for a layer shape
// on a device (the fused tiles per token bucket, bf16 or FP8, Auto's mode per
// bucket), so
// that a new process, or another Layer of the same shape in this one (moe
// bench makes one per weight set), reuses it instead of timing again (about
// 150 ms a bucket). The bf16 tiles and the mode change no output bit, so a
// cached choice gives the same results as a fresh tuning; so does an FP8
// layer's cached choice, which is the choice itself (w8a16 or w8a8 tiles).
//
// Entries live beside the compiled kernels (backend/cuda's disk cache): in
// $GPUCTX_KERNEL_CACHE/tuning, or os.UserCacheDir()/gpuctx/tuning when the
// variable is unset; GPUCTX_KERNEL_CACHE=off disables both caches. One JSON
// file per key, named by the SHA-256 of
//
//	format, backend, device name, compute capability, multiprocessors, driver
//	version, the MoE kernel sources, the layer's shape (config dimensions and
//	routing, dtype, fused shared chunks, small-batch limit; for an FP8 layer
//	"fp8" and the FP8 kernel sources)
//
// holds every bucket measured so far; the key text is stored in the file and
// compared on reading. A file that does not parse, has another key or format,
// or names an unknown tile or mode is ignored, and rewritten by the next
// tuning. Entries are written atomically (internal/atomicfile); processes that
// tune at once may drop each other's buckets, which are then timed again.
// Failing to read or write the cache is never an error. Deleting the directory
// is always safe.

// tuneCacheEnv is the variable that moves ("dir": dir/tuning) or disables
// ("off") the tuning cache, with the kernel cache.
const tuneCacheEnv = "GPUCTX_KERNEL_CACHE"

// tuneGetenv reads tuneCacheEnv (tests replace it: the package's tests run
// with the cache off unless they set a directory).
var tuneGetenv = os.Getenv

// tuneCacheFormat names the entry format; a change of format misses. 2: the
// timings start from a flushed L2 (coldL2), so the choices of 1 may differ.
const tuneCacheFormat = "gpuctx-moe-tuning-2"

// tuneCache is one entry file of the tuning cache; the zero value is disabled.
type tuneCache struct {
	path string // entry file
	key  string // key text, stored in the entry
}

// tuneEntry is the JSON of one entry file.
type tuneEntry struct {
	Format string     `json:"format"`
	Key    string     `json:"key"`
	Tiles  []tuneTile `json:"tiles,omitempty"`
	Modes  []tuneMode `json:"modes,omitempty"`
}

// tuneTile is the tuned tile pair of one token bucket.
type tuneTile struct {
	Bucket      int    `json:"bucket"`
	FusedShared bool   `json:"fused_shared"`
	Up          string `json:"up"`
	Down        string `json:"down"`
	// Kind is the tiles' family: "" for the bf16 tiles (moekernels.MoEGemm),
	// kindW8A16 or kindW8A8 for an FP8 layer's (fp8Pair).
	Kind string `json:"kind,omitempty"`
}

// The tile families of an FP8 layer's cache records (tuneTile.Kind).
const (
	kindW8A16 = "w8a16"
	kindW8A8  = "w8a8"
)

// tuneMode is Auto's measured mode of one token bucket.
type tuneMode struct {
	Bucket int    `json:"bucket"`
	Mode   string `json:"mode"`
}

// tuneCacheDir returns the tuning cache's directory for getenv's
// GPUCTX_KERNEL_CACHE: "" (disabled) for "off" in any case, dir/tuning for a
// path, os.UserCacheDir()/gpuctx/tuning when unset ("" without a user cache
// directory).
func tuneCacheDir(getenv func(string) string) string {
	v := strings.TrimSpace(getenv(tuneCacheEnv))
	switch {
	case strings.EqualFold(v, "off"):
		return ""
	case v != "":
		return filepath.Join(v, "tuning")
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return ""
	}
	return filepath.Join(base, "gpuctx", "tuning")
}

// kernelSourcesHash is the SHA-256 of the MoE kernel sources: another kernel
// text, another tuning.
var kernelSourcesHash = sync.OnceValue(func() string {
	return sourcesHash(moekernels.RouteSource(), moekernels.GemmSource(), moekernels.WgmmaSource())
})

// fp8SourcesHash is the SHA-256 of the FP8 tiles' sources (w8a16, w8a8 and
// the quantizer), part of an FP8 layer's key.
var fp8SourcesHash = sync.OnceValue(func() string {
	return sourcesHash(moekernels.FP8MMASource(), moekernels.W8A8Source())
})

// sourcesHash is the SHA-256 of srcs, each preceded by its length.
func sourcesHash(srcs ...string) string {
	h := sha256.New()
	for _, s := range srcs {
		fmt.Fprintf(h, "%d\x00%s", len(s), s)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// tuneIdent is what a tuning depends on besides the token bucket.
type tuneIdent struct {
	backend string
	dev     gpuctx.DeviceInfo
	sources string // kernelSourcesHash
	shape   string // layerShape
}

// key is the key text of id.
func (id tuneIdent) key() string {
	d := id.dev
	return fmt.Sprintf("%s|backend %s|device %q cc %d.%d sms %d driver %d|sources %s|%s", tuneCacheFormat,
		id.backend, d.Name, d.ComputeMajor, d.ComputeMinor, d.SMCount, d.DriverVersion, id.sources, id.shape)
}

// layerShape describes what of layer l the tiles and Auto's mode depend on:
// the config's dimensions and routing, the dtype, the fused shared chunks,
// the small-batch limit and whether the fused path is on; for a layer with
// FP8 experts, "fp8" and the FP8 kernel sources, so that an FP8 layer never
// shares an entry with the bf16 layer of its shape (whose key, and old
// entries, stay as they were), and for a weight-only one "w8a16 only" (its
// choices never name w8a8 tiles, which it does not load).
func layerShape(l *Layer, fp8 fp8Form) string {
	c := &l.cfg
	s := fmt.Sprintf("H %d E %d K %d I %d shared %d gate %v scoring %v method %v groups %d/%d|dtype %v ns %d small %d fused %v",
		c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate, c.SharedIntermediate, c.SharedGate, c.Scoring, c.TopKMethod,
		c.NumGroups, c.TopKGroups, l.dt, l.ns, l.small, l.fusedOK)
	if fp8 != noFP8 {
		s += "|fp8 sources " + fp8SourcesHash()
	}
	if fp8 == fp8WeightOnly {
		s += "|w8a16 only"
	}
	return s
}

// fp8Form is how a layer's routed experts are held and run.
type fp8Form int

const (
	noFP8         fp8Form = iota // the layer's dtype
	fp8Any                       // FP8: the w8a16 tiles, and the w8a8 ones where the device has them
	fp8WeightOnly                // FP8, the w8a16 tiles only (LayerOptions.FP8WeightOnly)
)

// fp8FormOf is o's fp8Form.
func fp8FormOf(o LayerOptions) fp8Form {
	switch {
	case o.FP8 && o.FP8WeightOnly:
		return fp8WeightOnly
	case o.FP8:
		return fp8Any
	}
	return noFP8
}

// tuneKeyText is the key of the tuning of layer l on dev, whose routed
// experts are held as fp8 says.
func tuneKeyText(dev *gpuctx.Device, l *Layer, fp8 fp8Form) string {
	return tuneIdent{backend: dev.Backend(), dev: dev.Info(), sources: kernelSourcesHash(), shape: layerShape(l, fp8)}.key()
}

// newTuneCache returns the entry of key in dir ("" disables it).
func newTuneCache(dir, key string) tuneCache {
	if dir == "" {
		return tuneCache{}
	}
	sum := sha256.Sum256([]byte(key))
	return tuneCache{path: filepath.Join(dir, hex.EncodeToString(sum[:])+".json"), key: key}
}

// load reads the entry; ok is false when it is missing, corrupt or stale.
func (c tuneCache) load() (e tuneEntry, ok bool) {
	if c.path == "" {
		return e, false
	}
	b, err := os.ReadFile(c.path)
	if err != nil || json.Unmarshal(b, &e) != nil || e.Format != tuneCacheFormat || e.Key != c.key {
		return tuneEntry{}, false
	}
	for _, t := range e.Tiles {
		if recordErr(t) != nil {
			return tuneEntry{}, false
		}
	}
	for _, m := range e.Modes {
		if mode, err := ParseMode(m.Mode); err != nil || (mode != Dual && mode != FusedShared) {
			return tuneEntry{}, false
		}
	}
	return e, true
}

// tiles returns the cached bf16 tile pair of bucket b.
func (c tuneCache) tiles(b tileKey) (tilePair, bool) { return cachedChoice[tilePair](c, b) }

// cachedChoice returns the cached tiles of bucket b where they are of P's
// family.
func cachedChoice[P tileChoice](c tuneCache, b tileKey) (P, bool) {
	var none P
	e, ok := c.load()
	if !ok {
		return none, false
	}
	for _, t := range e.Tiles {
		if t.Bucket == b.bucket && t.FusedShared == b.fusedShared {
			return choiceOf[P](t)
		}
	}
	return none, false
}

// choiceOf parses a cache record as P's tiles; ok is false for a record of
// another family or an unknown tile.
func choiceOf[P tileChoice](t tuneTile) (P, bool) {
	var p P
	var err error
	switch q := any(&p).(type) {
	case *tilePair:
		*q, err = tilePairOf(t)
	case *fp8Pair:
		*q, err = fp8PairOf(t)
	}
	return p, err == nil
}

// recordErr reports why a cache record names no tiles of its family.
func recordErr(t tuneTile) error {
	if t.Kind == "" {
		_, err := tilePairOf(t)
		return err
	}
	_, err := fp8PairOf(t)
	return err
}

// tilePairOf parses a bf16 record.
func tilePairOf(t tuneTile) (tilePair, error) {
	if t.Kind != "" {
		return tilePair{}, fmt.Errorf("moe: tuning cache: %s tiles, not bf16 ones", t.Kind)
	}
	up, err := parseTile(t.Up)
	if err != nil {
		return tilePair{}, err
	}
	down, err := parseTile(t.Down)
	return tilePair{up, down}, err
}

// record is tp's cache record for bucket b.
func (tp tilePair) record(b tileKey) tuneTile {
	return tuneTile{Bucket: b.bucket, FusedShared: b.fusedShared, Up: tp.up.Tag(), Down: tp.down.Tag()}
}

// mode returns Auto's cached mode of a bucket.
func (c tuneCache) mode(bucket int) (Mode, bool) {
	e, ok := c.load()
	if !ok {
		return 0, false
	}
	for _, m := range e.Modes {
		if m.Bucket == bucket {
			mode, _ := ParseMode(m.Mode) // checked by load
			return mode, true
		}
	}
	return 0, false
}

// storeTiles records the bf16 tile pair of bucket b (storeChoice).
func (c tuneCache) storeTiles(b tileKey, tp tilePair) error { return storeChoice(c, b, tp) }

// storeChoice records the tiles of bucket b, keeping the entry's other
// buckets (a corrupt or stale entry is replaced).
func storeChoice[P tileChoice](c tuneCache, b tileKey, tp P) error {
	return c.update(func(e *tuneEntry) {
		t := tp.record(b)
		for i := range e.Tiles {
			if e.Tiles[i].Bucket == b.bucket && e.Tiles[i].FusedShared == b.fusedShared {
				e.Tiles[i] = t
				return
			}
		}
		e.Tiles = append(e.Tiles, t)
	})
}

// storeMode records Auto's mode of a bucket.
func (c tuneCache) storeMode(bucket int, m Mode) error {
	return c.update(func(e *tuneEntry) {
		for i := range e.Modes {
			if e.Modes[i].Bucket == bucket {
				e.Modes[i].Mode = m.String()
				return
			}
		}
		e.Modes = append(e.Modes, tuneMode{Bucket: bucket, Mode: m.String()})
	})
}

// update applies change to the entry (a fresh one if missing, corrupt or
// stale) and writes it atomically.
func (c tuneCache) update(change func(*tuneEntry)) error {
	if c.path == "" {
		return nil
	}
	e, ok := c.load()
	if !ok {
		e = tuneEntry{Format: tuneCacheFormat, Key: c.key}
	}
	change(&e)
	b, err := json.MarshalIndent(&e, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(c.path), 0o755); err != nil {
		return err
	}
	return atomicfile.WriteFile(c.path, append(b, '\n'))
}

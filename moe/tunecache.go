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
// on a device (the fused tiles per token bucket, Auto's mode per bucket), so
// that a new process, or another Layer of the same shape in this one (moe
// bench makes one per weight set), reuses it instead of timing again (about
// 150 ms a bucket). The tiles and the mode change no output bit, so a cached
// choice gives the same results as a fresh tuning.
//
// Entries live beside the compiled kernels (backend/cuda's disk cache): in
// $GPUCTX_KERNEL_CACHE/tuning, or os.UserCacheDir()/gpuctx/tuning when the
// variable is unset; GPUCTX_KERNEL_CACHE=off disables both caches. One JSON
// file per key, named by the SHA-256 of
//
//	format, backend, device name, compute capability, multiprocessors, driver
//	version, the MoE kernel sources, the layer's shape (config dimensions and
//	routing, dtype, fused shared chunks, small-batch limit)
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

// tuneCacheFormat names the entry format; a change of format misses.
const tuneCacheFormat = "gpuctx-moe-tuning-1"

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
}

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
	h := sha256.New()
	for _, s := range []string{moekernels.RouteSource(), moekernels.GemmSource(), moekernels.WgmmaSource()} {
		fmt.Fprintf(h, "%d\x00%s", len(s), s)
	}
	return hex.EncodeToString(h.Sum(nil))
})

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
// the small-batch limit and whether the fused path is on.
func layerShape(l *Layer) string {
	c := &l.cfg
	return fmt.Sprintf("H %d E %d K %d I %d shared %d gate %v scoring %v method %v groups %d/%d|dtype %v ns %d small %d fused %v",
		c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate, c.SharedIntermediate, c.SharedGate, c.Scoring, c.TopKMethod,
		c.NumGroups, c.TopKGroups, l.dt, l.ns, l.small, l.fusedOK)
}

// tuneKeyText is the key of the tuning of layer l on dev.
func tuneKeyText(dev *gpuctx.Device, l *Layer) string {
	return tuneIdent{backend: dev.Backend(), dev: dev.Info(), sources: kernelSourcesHash(), shape: layerShape(l)}.key()
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
		if _, err := parseTile(t.Up); err != nil {
			return tuneEntry{}, false
		}
		if _, err := parseTile(t.Down); err != nil {
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

// tiles returns the cached tile pair of bucket b.
func (c tuneCache) tiles(b tileKey) (tilePair, bool) {
	e, ok := c.load()
	if !ok {
		return tilePair{}, false
	}
	for _, t := range e.Tiles {
		if t.Bucket == b.bucket && t.FusedShared == b.fusedShared {
			up, _ := parseTile(t.Up) // checked by load
			down, _ := parseTile(t.Down)
			return tilePair{up, down}, true
		}
	}
	return tilePair{}, false
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

// storeTiles records the tile pair of bucket b, keeping the entry's other
// buckets (a corrupt or stale entry is replaced).
func (c tuneCache) storeTiles(b tileKey, tp tilePair) error {
	return c.update(func(e *tuneEntry) {
		t := tuneTile{Bucket: b.bucket, FusedShared: b.fusedShared, Up: tp.up.Tag(), Down: tp.down.Tag()}
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

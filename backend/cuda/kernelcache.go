package cuda

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
)

// The disk cache of compiled kernels. NVRTC takes about a second per kernel
// source file, which dominated a one-shot "gpuctx moe run"; the cache keeps
// each compiled image (CUBIN, or PTX where NVRTC cannot emit CUBIN for the
// architecture) in a file named by
//
//	sha256(format version, file name, source, NVRTC options, architecture, NVRTC version)
//
// so any change to what would be compiled, or to the compiler, misses. Its
// directory is $GPUCTX_KERNEL_CACHE, or os.UserCacheDir()/gpuctx/kernels
// (Linux: $XDG_CACHE_HOME/gpuctx/kernels or ~/.cache/gpuctx/kernels) when that
// is unset; GPUCTX_KERNEL_CACHE=off disables it. Deleting the directory is
// always safe.
//
// Processes may share the directory: an entry is written to a temporary file in
// the same directory and renamed into place, so a reader sees a whole entry or
// none. Every entry carries its length and a SHA-256 of its image; an entry
// that is short, corrupt or of another format is ignored, recompiled and
// rewritten. Failing to write the cache is never an error: the compiled image
// is used all the same.

// KernelCacheEnv is the environment variable that moves ("dir") or disables
// ("off") the disk cache of compiled kernels.
const KernelCacheEnv = "GPUCTX_KERNEL_CACHE"

// kernelCacheMagic starts every entry; the trailing digit is the format version.
const kernelCacheMagic = "GPUCTXK1"

// entry layout: magic (8) | kind (1: 0 CUBIN, 1 PTX) | image length (8, little
// endian) | SHA-256 of the image (32) | image.
const kernelCacheHeader = len(kernelCacheMagic) + 1 + 8 + sha256.Size

// diskCache is one cache directory; the zero value (dir "") is disabled.
type diskCache struct {
	dir string
}

// kernelCacheFromEnv returns the cache that getenv's GPUCTX_KERNEL_CACHE names:
// "off" (any case) disables it, a path is used as is, and unset or empty means
// os.UserCacheDir()/gpuctx/kernels (disabled when there is no user cache
// directory).
func kernelCacheFromEnv(getenv func(string) string) diskCache {
	v := strings.TrimSpace(getenv(KernelCacheEnv))
	switch {
	case strings.EqualFold(v, "off"):
		return diskCache{}
	case v != "":
		return diskCache{dir: v}
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return diskCache{}
	}
	return diskCache{dir: filepath.Join(base, "gpuctx", "kernels")}
}

// processKernelCache is the cache of this process, read from the environment
// once.
var processKernelCache = sync.OnceValue(func() diskCache { return kernelCacheFromEnv(os.Getenv) })

// kernelCacheHits and kernelCacheCompiles count, for this process, source files
// whose image came from the disk cache and those NVRTC compiled.
var kernelCacheHits, kernelCacheCompiles atomic.Int64

// kernelCacheKey is the hex SHA-256 naming the entry of one compilation.
func kernelCacheKey(file, src string, opts []string, arch, nvrtcVersion string) string {
	h := sha256.New()
	for _, part := range []string{kernelCacheMagic, file, src, strings.Join(opts, "\x00"), arch, nvrtcVersion} {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:]) // length-prefixed: no two part lists hash the same bytes
		h.Write([]byte(part))
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (c diskCache) path(key string) string { return filepath.Join(c.dir, key+".bin") }

// load returns the image stored under key, if a whole, valid entry is there.
func (c diskCache) load(key string) (img []byte, isPTX, ok bool) {
	if c.dir == "" {
		return nil, false, false
	}
	data, err := os.ReadFile(c.path(key))
	if err != nil || len(data) < kernelCacheHeader || string(data[:len(kernelCacheMagic)]) != kernelCacheMagic {
		return nil, false, false
	}
	kind := data[len(kernelCacheMagic)]
	n := binary.LittleEndian.Uint64(data[len(kernelCacheMagic)+1:])
	sum := data[len(kernelCacheMagic)+9 : kernelCacheHeader]
	img = data[kernelCacheHeader:]
	if kind > 1 || n != uint64(len(img)) || n == 0 {
		return nil, false, false
	}
	if got := sha256.Sum256(img); !bytes.Equal(got[:], sum) {
		return nil, false, false
	}
	return img, kind == 1, true
}

// store writes img under key: to a temporary file in the cache directory,
// renamed into place, so that concurrent readers and writers (other
// goroutines or processes) never see part of an entry.
func (c diskCache) store(key string, img []byte, isPTX bool) error {
	if c.dir == "" || len(img) == 0 {
		return nil
	}
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(c.dir, key+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	buf := make([]byte, kernelCacheHeader, kernelCacheHeader+len(img))
	copy(buf, kernelCacheMagic)
	if isPTX {
		buf[len(kernelCacheMagic)] = 1
	}
	binary.LittleEndian.PutUint64(buf[len(kernelCacheMagic)+1:], uint64(len(img)))
	sum := sha256.Sum256(img)
	copy(buf[len(kernelCacheMagic)+9:], sum[:])
	buf = append(buf, img...)
	_, werr := f.Write(buf)
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Chmod(tmp, 0o644); err != nil { // CreateTemp makes 0600
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, c.path(key)); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// compileCached returns the image stored under key, or runs compile and stores
// its result. fromDisk reports a cache hit. A store failure is ignored (the
// image is good; the next process compiles again).
func (c diskCache) compileCached(key string, compile func() ([]byte, bool, error)) (img []byte, isPTX, fromDisk bool, err error) {
	if img, isPTX, ok := c.load(key); ok {
		kernelCacheHits.Add(1)
		return img, isPTX, true, nil
	}
	img, isPTX, err = compile()
	if err != nil {
		return nil, false, false, err
	}
	kernelCacheCompiles.Add(1)
	_ = c.store(key, img, isPTX)
	return img, isPTX, false, nil
}

// KernelCacheStats reports the disk cache of compiled kernels: its directory
// ("" when disabled), and how many kernel source files this process loaded
// from it and compiled with NVRTC (all devices together).
func (d *device) KernelCacheStats() (dir string, hits, compiled int64) {
	return processKernelCache().dir, kernelCacheHits.Load(), kernelCacheCompiles.Load()
}

// KernelCacheDir returns the directory of the disk cache of compiled kernels
// that this process uses, or "" when GPUCTX_KERNEL_CACHE=off (or there is no
// user cache directory).
func KernelCacheDir() string { return processKernelCache().dir }

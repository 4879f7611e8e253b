package gpuctx

import (
	"sync"
	"sync/atomic"
	"time"
)

// kernelStats counts Device.Kernel calls and the wall time during which at
// least one was in progress (concurrent lookups, such as package moe's
// parallel compilations, count once).
type kernelStats struct {
	lookups  atomic.Int64
	nanos    atomic.Int64 // busy time of the finished busy spans
	mu       sync.Mutex
	inflight int
	since    time.Time        // start of the current busy span
	now      func() time.Time // the clock; nil: time.Now (tests set it)
}

func (k *kernelStats) clock() time.Time {
	if k.now != nil {
		return k.now()
	}
	return time.Now()
}

// begin marks a lookup started; end(begin's time) marks it finished.
func (k *kernelStats) begin() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.inflight == 0 {
		k.since = k.clock()
	}
	k.inflight++
}

func (k *kernelStats) end() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.lookups.Add(1)
	if k.inflight--; k.inflight == 0 {
		k.nanos.Add(int64(k.clock().Sub(k.since)))
	}
}

// busy returns the busy time so far, the current span included.
func (k *kernelStats) busy() time.Duration {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := time.Duration(k.nanos.Load())
	if k.inflight > 0 {
		d += k.clock().Sub(k.since)
	}
	return d
}

// KernelStats says how a device's kernels were obtained.
type KernelStats struct {
	// Lookups counts Device.Kernel calls on the device; Time is the wall time
	// during which at least one was in progress (on CUDA: NVRTC compilation
	// or a disk cache read, module loads; near zero once a kernel is cached in
	// the process), concurrent lookups counted once.
	Lookups int64
	Time    time.Duration
	// CacheDir is the on-disk cache of compiled kernels ("" when the backend
	// has none or it is disabled: GPUCTX_KERNEL_CACHE=off). CacheHits counts
	// kernel source files loaded from it, Compiled those compiled, in this
	// process (all devices).
	CacheDir            string
	CacheHits, Compiled int64
}

// kernelCacheReporter is implemented by backend devices with a disk cache of
// compiled kernels (backend/cuda).
type kernelCacheReporter interface {
	KernelCacheStats() (dir string, hits, compiled int64)
}

// KernelStats reports the device's kernel lookups and its backend's compiled
// kernel cache.
func (d *Device) KernelStats() KernelStats {
	st := KernelStats{Lookups: d.kstats.lookups.Load(), Time: d.kstats.busy()}
	if r, ok := d.hd.(kernelCacheReporter); ok {
		st.CacheDir, st.CacheHits, st.Compiled = r.KernelCacheStats()
	}
	return st
}

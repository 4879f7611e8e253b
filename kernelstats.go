package gpuctx

import (
	"sync/atomic"
	"time"
)

// kernelStats counts Device.Kernel calls and the host time they took.
type kernelStats struct {
	lookups atomic.Int64
	nanos   atomic.Int64
}

func (k *kernelStats) add(d time.Duration) {
	k.lookups.Add(1)
	k.nanos.Add(int64(d))
}

// KernelStats says how a device's kernels were obtained.
type KernelStats struct {
	// Lookups counts Device.Kernel calls on the device; Time is the host time
	// they took together (on CUDA: NVRTC compilation or a disk cache read,
	// module loads; near zero once a kernel is cached in the process).
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
	st := KernelStats{Lookups: d.kstats.lookups.Load(), Time: time.Duration(d.kstats.nanos.Load())}
	if r, ok := d.hd.(kernelCacheReporter); ok {
		st.CacheDir, st.CacheHits, st.Compiled = r.KernelCacheStats()
	}
	return st
}

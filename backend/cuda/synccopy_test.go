package cuda

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// TestSyncCopiesCompleteOnReturn checks that the synchronous copies have
// landed when they return, as far as work on this backend's streams (all
// CU_STREAM_NON_BLOCKING, so none waits for the legacy default stream) can
// tell: right after CopyHtoD (from pageable host memory, which cuMemcpyHtoD
// only stages) and CopyDtoD (which cuMemcpyDtoD only queues) of a large
// buffer, an async copy on a stream reads the buffer's last bytes and must see
// the new contents, every round.
//
// On an idle H200 the read did not overtake the copy even without the
// legacy-stream synchronize (2026-12-02); with another process loading the
// GPU, moe's layers read stale inputs (bench/RESULTS.md, "the copy race").
// So the rounds run while a child process of this test binary loads the GPU
// (TestGPULoadHelper). This loaded form has not yet
// run on a GPU: bench/gpu/tests.sh's LOADED=1 step is the check that was seen
// to fail without the fix.
func TestSyncCopiesCompleteOnReturn(t *testing.T) {
	d := gpu(t)
	const n, tail, rounds = 256 << 20, 4096, 8
	dst, src := devAlloc(t, d, n), devAlloc(t, d, n)
	s := newStream(t, d, hal.StreamOptions{})
	host := make([]byte, n) // pageable, as a Go slice is
	got := pinned[byte](t, d, tail)
	check := func(what string, r int, want byte) {
		t.Helper()
		if err := s.CopyDtoHAsync(unsafe.Pointer(&got[0]), dst+hal.Ptr(n-tail), tail); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		for i, v := range got {
			if v != want {
				t.Fatalf("round %d: a stream read byte %d of the last %d after %s returned: %#x, want %#x (the copy had not landed)", r, i, tail, what, v, want)
			}
		}
	}
	stop := startGPULoad(t)
	defer stop()
	for r := range rounds {
		a, b := byte(2*r+1), byte(2*r+2)
		for i := range host {
			host[i] = a
		}
		if err := d.CopyHtoD(dst, unsafe.Pointer(&host[0]), n); err != nil {
			t.Fatal(err)
		}
		check("CopyHtoD", r, a)
		for i := range host {
			host[i] = b
		}
		if err := d.CopyHtoD(src, unsafe.Pointer(&host[0]), n); err != nil {
			t.Fatal(err)
		}
		if err := d.CopyDtoD(dst, src, n); err != nil {
			t.Fatal(err)
		}
		check("CopyDtoD", r, b)
	}
}

// startGPULoad starts this test binary again as TestGPULoadHelper, which keeps
// the GPU's copy engines and memory busy from another process (another CUDA
// context, time-sliced with this one) until the returned stop is called.
func startGPULoad(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run", "^TestGPULoadHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), "GPUCTX_GPU_LOAD_HELPER=30s")
	if err := cmd.Start(); err != nil {
		cancel()
		t.Logf("no load process (%v): the rounds run on an idle GPU", err)
		return func() {}
	}
	time.Sleep(2 * time.Second) // its context and buffers exist, its copies queued
	return func() { cancel(); _ = cmd.Wait() }
}

// TestGPULoadHelper is not a test: run by startGPULoad in a child process
// (GPUCTX_GPU_LOAD_HELPER=duration), it copies 512 MiB back and forth on two
// streams until the duration ends or it is killed.
func TestGPULoadHelper(t *testing.T) {
	dur, err := time.ParseDuration(os.Getenv("GPUCTX_GPU_LOAD_HELPER"))
	if err != nil {
		t.Skip("a helper process of TestSyncCopiesCompleteOnReturn (GPUCTX_GPU_LOAD_HELPER unset)")
	}
	d := gpu(t)
	const n = 512 << 20
	a, b := devAlloc(t, d, n), devAlloc(t, d, n)
	ss := [2]hal.Stream{newStream(t, d, hal.StreamOptions{}), newStream(t, d, hal.StreamOptions{})}
	for end := time.Now().Add(dur); time.Now().Before(end); {
		for i, s := range ss {
			src, dst := a, b
			if i == 1 {
				src, dst = b, a
			}
			if err := s.CopyDtoDAsync(dst, src, n); err != nil {
				t.Fatal(err)
			}
		}
		if err := ss[0].Synchronize(); err != nil {
			t.Fatal(err)
		}
	}
	t.Log("load helper: " + strconv.Itoa(n>>20) + " MiB copies for " + dur.String())
}

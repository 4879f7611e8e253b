package cuda

import (
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// TestSyncCopiesCompleteOnReturn checks that the synchronous copies have
// landed when they return, as far as work on this backend's streams (all
// CU_STREAM_NON_BLOCKING, so none waits for the legacy default stream) can
// tell: right after CopyHtoD (from pageable host memory, which cuMemcpyHtoD
// only stages) and CopyDtoD (which cuMemcpyDtoD only queues) of a large
// buffer, an async copy on a stream reads the buffer's last bytes and must see
// the new contents, every round. Without the legacy-stream synchronize in
// CopyHtoD and CopyDtoD, the stream's read can overtake the pending copy.
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

package cpu

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

func TestBackendInfo(t *testing.T) {
	b, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("backend %s", b.Name())
	if b.Name() != "cpu" || b.DeviceCount() != 1 {
		t.Errorf("Name, DeviceCount = %q, %d; want cpu, 1", b.Name(), b.DeviceCount())
	}
	d0, err := b.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := b.Device(0); again != d0 {
		t.Error("Device(0) twice returned different devices")
	}
	if _, err := b.Device(1); err == nil {
		t.Error("Device(1): want an error, the CPU backend has one device")
	}
	info := d0.Info()
	t.Logf("%+v, libraries %+v", info, b.Libraries())
	if !strings.HasPrefix(info.Name, "CPU (") || info.SMCount <= 0 || info.ComputeMajor != 0 {
		t.Errorf("Info = %+v", info)
	}
	if libs := b.Libraries(); len(libs) != 1 || libs[0].Name != "gonum" || libs[0].Version == "" {
		t.Errorf("Libraries = %+v", libs)
	}
	if _, ok := d0.(hal.WorkspaceChecker); !ok {
		t.Error("device does not implement hal.WorkspaceChecker")
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := d0.Alloc(16); err == nil {
		t.Error("Alloc after Close: want an error")
	}
	if _, err := b.Device(0); err == nil {
		t.Error("Device after Close: want an error")
	}
}

func TestMemoryErrors(t *testing.T) {
	d := newTestDevice(t)
	host := make([]byte, 4096)
	hp := unsafe.Pointer(&host[0])
	tests := []struct {
		name string
		run  func(p, q hal.Ptr) error // p: 1000 live bytes, q: another live 1000 bytes
	}{
		{"free twice", func(p, q hal.Ptr) error {
			if err := d.Free(p); err != nil {
				return errors.New("first Free failed: " + err.Error())
			}
			return d.Free(p)
		}},
		{"free interior pointer", func(p, q hal.Ptr) error { return d.Free(p + 8) }},
		{"free unknown pointer", func(p, q hal.Ptr) error { return d.Free(0x1234) }},
		{"copy past end", func(p, q hal.Ptr) error { return d.CopyHtoD(p, hp, 1001) }},
		{"copy at offset past end", func(p, q hal.Ptr) error { return d.CopyHtoD(p+900, hp, 101) }},
		{"copy from freed", func(p, q hal.Ptr) error {
			if err := d.Free(q); err != nil {
				return err
			}
			return d.CopyDtoH(hp, q, 10)
		}},
		{"copy DtoD unknown source", func(p, q hal.Ptr) error { return d.CopyDtoD(p, 0x10, 8) }},
		{"async copy past end", func(p, q hal.Ptr) error {
			s, err := d.NewStream(hal.StreamOptions{})
			if err != nil {
				return err
			}
			defer s.Destroy()
			return s.CopyDtoHAsync(hp, p, 2000)
		}},
		{"memset past end", func(p, q hal.Ptr) error {
			s, err := d.NewStream(hal.StreamOptions{})
			if err != nil {
				return err
			}
			defer s.Destroy()
			return s.MemsetAsync(p+1, 0, 1000)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := d.Alloc(1000)
			if err != nil {
				t.Fatal(err)
			}
			q, err := d.Alloc(1000)
			if err != nil {
				t.Fatal(err)
			}
			err = tc.run(p, q)
			if !errors.Is(err, hal.ErrBadPointer) {
				t.Fatalf("got %v, want an error wrapping hal.ErrBadPointer", err)
			}
			t.Logf("error: %v", err)
		})
	}
	if _, err := d.Alloc(0); err == nil {
		t.Error("Alloc(0): want an error")
	}
	h, err := d.AllocHost(64)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.FreeHost(h); err != nil {
		t.Fatal(err)
	}
	if err := d.FreeHost(h); !errors.Is(err, hal.ErrBadPointer) {
		t.Errorf("FreeHost twice: got %v, want hal.ErrBadPointer", err)
	}
}

func TestMemoryRoundTrip(t *testing.T) {
	d := newTestDevice(t)
	src := make([]byte, 3000)
	for i := range src {
		src[i] = byte(i * 7)
	}
	p := upload(t, d, src)
	if p%256 != 0 {
		t.Errorf("Alloc returned %#x, not 256-byte aligned", uintptr(p))
	}
	q, err := d.Alloc(3000)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.CopyDtoD(q, p, 3000); err != nil {
		t.Fatal(err)
	}
	if got := download(t, d, q, 3000); !bytes.Equal(got, src) {
		t.Error("HtoD, DtoD, DtoH round trip changed the data")
	}
	// Async copies through pinned host memory, and a memset in between.
	h, err := d.AllocHost(3000)
	if err != nil {
		t.Fatal(err)
	}
	s := newTestStream(t, d)
	for _, err := range []error{
		s.MemsetAsync(q, 0xAB, 100),
		s.CopyDtoHAsync(h, q, 3000),
		s.Synchronize(),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	got := unsafe.Slice((*byte)(h), 3000)
	if !bytes.Equal(got[:100], bytes.Repeat([]byte{0xAB}, 100)) || !bytes.Equal(got[100:], src[100:]) {
		t.Error("MemsetAsync + CopyDtoHAsync produced wrong bytes")
	}
	free, total, err := d.MemInfo()
	t.Logf("MemInfo free=%d total=%d err=%v", free, total, err)
	if err == nil && (total == 0 || free > total) {
		t.Errorf("MemInfo free=%d total=%d", free, total)
	}
}

// TestAllocOutOfMemory: an absurd request returns an error wrapping
// hal.ErrOutOfMemory (as CUDA_ERROR_OUT_OF_MEMORY does) instead of the Go
// runtime dying in make; the budget is charged and refunded by Free.
func TestAllocOutOfMemory(t *testing.T) {
	d := newTestDevice(t)
	for _, n := range []int{1 << 40, 1 << 50, math.MaxInt - 10, math.MaxInt} {
		if p, err := d.Alloc(n); !errors.Is(err, hal.ErrOutOfMemory) {
			t.Errorf("Alloc(%d) = %#x, %v; want hal.ErrOutOfMemory", n, p, err)
		} else if !strings.Contains(err.Error(), "Alloc(") {
			t.Errorf("Alloc(%d): error %q does not name the call", n, err)
		}
		if _, err := d.AllocHost(n); !errors.Is(err, hal.ErrOutOfMemory) {
			t.Errorf("AllocHost(%d): %v; want hal.ErrOutOfMemory", n, err)
		}
	}
	// A configured budget.
	d.mu.Lock()
	d.limit = 1 << 20
	d.mu.Unlock()
	p1, err := d.Alloc(600 << 10)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Alloc(600 << 10); !errors.Is(err, hal.ErrOutOfMemory) {
		t.Fatalf("second 600 KiB in a 1 MiB budget: %v; want hal.ErrOutOfMemory", err)
	}
	h, err := d.AllocHost(300 << 10)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Free(p1); err != nil {
		t.Fatal(err)
	}
	if err := d.FreeHost(h); err != nil {
		t.Fatal(err)
	}
	p2, err := d.Alloc(1 << 20)
	if err != nil {
		t.Fatalf("the whole budget after Free: %v", err)
	}
	_ = d.Free(p2)
	t.Setenv(MemoryLimitEnv, "1e6")
	if got := memLimit(5); got != 1e6 {
		t.Errorf("memLimit with $%s=1e6: %d", MemoryLimitEnv, got)
	}
}

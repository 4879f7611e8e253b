package conformance

import (
	"fmt"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestAllocFree checks Alloc for a range of sizes: the size is kept, the address
// is 256-byte aligned, the memory holds what is written to it, and Free
// succeeds once. It also checks MemInfo's sanity. Everything is synchronous.
func TestAllocFree(t *testing.T, dev *gpuctx.Device) {
	free, total, err := dev.MemInfo()
	must(t, "Device.MemInfo", err)
	if total == 0 || free > total {
		t.Errorf("Device.MemInfo = free %d, total %d; want 0 < total and free <= total", free, total)
	}
	for _, n := range []int{1, 3, 255, 256, 4097, 1 << 20} {
		t.Run(fmt.Sprintf("bytes=%d", n), func(t *testing.T) {
			r := newRand(t)
			b, err := dev.Alloc(n)
			must(t, fmt.Sprintf("Device.Alloc(%d)", n), err)
			if b.Size() != n {
				t.Errorf("Size() = %d, want %d", b.Size(), n)
			}
			if b.Device() != dev {
				t.Errorf("Device() is not the device that allocated the buffer")
			}
			p, err := b.Ptr()
			must(t, "Buffer.Ptr", err)
			if p == 0 || p%256 != 0 {
				t.Errorf("Ptr() = %#x, want a non-zero 256-byte aligned address", p)
			}
			want := randBytes(r, n)
			must(t, "CopyFromHost", b.CopyFromHost(want))
			got := make([]byte, n)
			must(t, "CopyToHost", b.CopyToHost(got))
			sameBytes(t, "round trip", got, want)
			must(t, "Free", b.Free())
		})
	}
	t.Run("many", func(t *testing.T) {
		// Live allocations never overlap: each keeps its own contents.
		r := newRand(t)
		const count = 64
		bufs := make([]*gpuctx.Buffer, count)
		data := make([][]byte, count)
		for i := range bufs {
			data[i] = randBytes(r, 1+r.IntN(3000))
			bufs[i] = upload(t, dev, data[i])
		}
		for i, b := range bufs {
			got := make([]byte, b.Size())
			must(t, "CopyToHost", b.CopyToHost(got))
			sameBytes(t, fmt.Sprintf("buffer %d", i), got, data[i])
			if i%2 == 0 {
				must(t, "Free", b.Free())
			}
		}
		for i := 1; i < count; i += 2 {
			got := make([]byte, bufs[i].Size())
			must(t, "CopyToHost after freeing neighbours", bufs[i].CopyToHost(got))
			sameBytes(t, fmt.Sprintf("buffer %d after freeing neighbours", i), got, data[i])
		}
	})
	t.Run("host", func(t *testing.T) {
		for _, n := range []int{1, 4096, 1<<20 + 1} {
			h, err := dev.AllocHost(n)
			must(t, fmt.Sprintf("AllocHost(%d)", n), err)
			if h.Size() != n || len(h.Bytes()) != n {
				t.Errorf("AllocHost(%d): Size %d, len(Bytes) %d", n, h.Size(), len(h.Bytes()))
			}
			b := h.Bytes()
			b[0], b[n-1] = 0x11, 0x22 // writable end to end
			must(t, "HostBuffer.Free", h.Free())
			if h.Bytes() != nil {
				t.Errorf("Bytes() after Free is not nil")
			}
		}
	})
}

// TestSyncCopies checks the synchronous copies (CopyFromHost, CopyToHost,
// CopyFrom), on whole buffers and on Slice views, and that bytes outside a view
// are left alone.
func TestSyncCopies(t *testing.T, dev *gpuctx.Device) {
	cases := []struct {
		size, off, n int
	}{
		{1, 0, 1},
		{64, 0, 64},
		{1000, 3, 997},
		{4096, 100, 1},
		{1 << 20, 12345, 500000},
		{1<<20 + 7, 0, 1<<20 + 7},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("size=%d/off=%d/n=%d", c.size, c.off, c.n), func(t *testing.T) {
			r := newRand(t)
			const poison = 0x5a
			base := filled(c.size, poison)
			a := upload(t, dev, base)
			b := upload(t, dev, filled(c.size, ^byte(poison)))
			va, err := a.Slice(c.off, c.n)
			must(t, "Slice", err)
			if va.Size() != c.n {
				t.Fatalf("Slice(%d, %d).Size() = %d", c.off, c.n, va.Size())
			}
			data := randBytes(r, c.n)
			must(t, "CopyFromHost into view", va.CopyFromHost(data))
			want := append(append(append([]byte{}, base[:c.off]...), data...), base[c.off+c.n:]...)
			sameBytes(t, "buffer after writing a view", download(t, dev, a), want)

			got := make([]byte, c.n)
			must(t, "CopyToHost from view", va.CopyToHost(got))
			sameBytes(t, "view read back", got, data)

			// Device to device: whole buffer, then a view to a view at another offset.
			must(t, "CopyFrom (whole)", b.CopyFrom(a))
			sameBytes(t, "CopyFrom whole buffer", download(t, dev, b), want)
			c2 := upload(t, dev, filled(c.size+5, poison))
			vc, err := c2.Slice(5, c.n)
			must(t, "Slice", err)
			must(t, "CopyFrom (view to view)", vc.CopyFrom(va))
			want2 := append(append(filled(5, poison), data...), filled(c.size-c.n, poison)...)
			sameBytes(t, "CopyFrom view to view", download(t, dev, c2), want2)
		})
	}
}

// TestAsyncCopies checks the stream copies with pinned HostBuffers: host to
// device, device to device and device to host, queued back to back on one
// stream with offsets, into poisoned destinations; every byte is checked after
// Stream.Synchronize, including the bytes that must not have been written.
func TestAsyncCopies(t *testing.T, dev *gpuctx.Device) {
	cases := []struct {
		name                     string
		size                     int // of every buffer
		hostOff, devOff, dev2Off int
		n                        int
	}{
		{"one-byte", 16, 0, 0, 0, 1},
		{"whole", 4096, 0, 0, 0, 4096},
		{"odd-offsets", 10007, 13, 7, 1001, 9000},
		{"tail", 65536, 65535, 65535, 65535, 1},
		{"large", 4<<20 + 3, 1, 2, 3, 4 << 20},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRand(t)
			s := newStream(t, dev)
			const devPoison, dev2Poison, hostPoison = 0x5a, 0xa5, 0xc3
			src := allocHost(t, dev, c.size)
			dst := allocHost(t, dev, c.size)
			whole := allocHost(t, dev, c.size)
			data := randBytes(r, c.size)
			copy(src.Bytes(), data)
			copy(dst.Bytes(), filled(c.size, hostPoison))
			copy(whole.Bytes(), filled(c.size, hostPoison))

			d1 := alloc(t, dev, c.size)
			d2 := alloc(t, dev, c.size)
			must(t, "Memset d1", s.Memset(d1, devPoison))
			must(t, "Memset d2", s.Memset(d2, dev2Poison))
			must(t, "CopyHtoD", s.CopyHtoD(d1, c.devOff, src, c.hostOff, c.n))
			must(t, "CopyDtoD", s.CopyDtoD(d2, c.dev2Off, d1, c.devOff, c.n))
			must(t, "CopyDtoH", s.CopyDtoH(dst, c.hostOff, d2, c.dev2Off, c.n))
			must(t, "CopyDtoH whole d1", s.CopyDtoH(whole, 0, d1, 0, c.size))
			must(t, "Stream.Synchronize", s.Synchronize())
			if done, err := s.Query(); err != nil || !done {
				t.Errorf("Stream.Query after Synchronize = %v, %v; want true, nil", done, err)
			}

			moved := data[c.hostOff : c.hostOff+c.n]
			wantDst := filled(c.size, hostPoison)
			copy(wantDst[c.hostOff:], moved)
			sameBytes(t, "host destination", dst.Bytes(), wantDst)
			wantD1 := filled(c.size, devPoison)
			copy(wantD1[c.devOff:], moved)
			sameBytes(t, "d1 after CopyHtoD", whole.Bytes(), wantD1)
			wantD2 := filled(c.size, dev2Poison)
			copy(wantD2[c.dev2Off:], moved)
			sameBytes(t, "d2 after CopyDtoD", download(t, dev, d2), wantD2)
		})
	}
}

// TestMemset checks Stream.Memset on whole buffers and views.
func TestMemset(t *testing.T, dev *gpuctx.Device) {
	cases := []struct {
		size, off, n int
		v            byte
	}{
		{1, 0, 1, 0xff},
		{1000, 0, 1000, 0},
		{1000, 1, 998, 0x7e},
		{1<<20 + 1, 4096, 1 << 19, 0x81},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("size=%d/off=%d/n=%d", c.size, c.off, c.n), func(t *testing.T) {
			r := newRand(t)
			s := newStream(t, dev)
			data := randBytes(r, c.size)
			b := upload(t, dev, data)
			v, err := b.Slice(c.off, c.n)
			must(t, "Slice", err)
			must(t, "Memset", s.Memset(v, c.v))
			must(t, "Synchronize", s.Synchronize())
			want := append([]byte{}, data...)
			copy(want[c.off:], filled(c.n, c.v))
			sameBytes(t, "after Memset", download(t, dev, b), want)
		})
	}
}

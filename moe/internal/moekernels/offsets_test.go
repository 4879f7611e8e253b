package moekernels

import (
	"errors"
	"math"
	"slices"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestDownTilesPast2to31 runs every down tile (CUDA only: the Go twins index
// with Go's 64-bit int) over an act of more than 2^31 elements, the size of
// T*K*I for DeepSeek-V3 past 131072 tokens: its rows from 2^31/I on start past
// a 32-bit offset (issue 20). It needs about 4.4 GB of device memory.
func TestDownTilesPast2to31(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: 4.4 GB of device memory")
	}
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		t.Skipf("needs CUDA: %v", err)
	}
	t.Cleanup(func() { _ = rt.Close() }) // after the buffers' Free (cleanups run last first)
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	const I = 16384             // Kdim of the down tiles
	const split = (1 << 31) / I // the first row past a 32-bit element offset
	runDownSplit(t, dev, I, split, 384*(split/384+10))
}

// TestDownTilesSplit is TestDownTilesPast2to31 at a small size on the CPU
// backend: it checks the test's own arithmetic on the Go twin.
func TestDownTilesSplit(t *testing.T) {
	runDownSplit(t, newTestDevice(t).dev, 64, 200, 384)
}

// runDownSplit runs every down tile on dev over rows rows of act of width I
// (rows a multiple of every BM). act holds 0.74609375 (bf16 0x3F3F) in the
// rows below split and 3 (0x4040) from it on, down small multiples of 1/16,
// so every f32 sum is exact and each output row is v times its weight sums,
// rounded to bf16 once: the bits are known on the host.
func runDownSplit(t *testing.T, dev *gpuctx.Device, I, split, rows int) {
	const H = 64 // the down tiles' N
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	alloc := func(n int) *gpuctx.Buffer {
		b, err := dev.Alloc(n)
		if errors.Is(err, gpuctx.ErrOutOfMemory) {
			t.Skipf("Alloc(%d): %v", n, err)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Free() })
		return b
	}
	act, out := alloc(2*rows*I), alloc(2*rows*H)
	for _, part := range []struct {
		off, n int
		v      byte
	}{{0, 2 * split * I, 0x3F}, {2 * split * I, 2 * (rows - split) * I, 0x40}} {
		b, err := act.Slice(part.off, part.n)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Memset(b, part.v); err != nil {
			t.Fatal(err)
		}
	}
	var r lcg = 5
	down := make([]uint16, H*I)
	sums := make([]float64, H) // exact: multiples of 1/16 under 2^14
	for i := range down {
		k := math.Round(r.next() * 3)
		down[i] = f32ToBF16(float32(k / 16))
		sums[i/I] += k / 16
	}
	sorted := make([]int32, rows)
	for i := range sorted {
		sorted[i] = int32(i)
	}
	upload := func(b []byte) *gpuctx.Buffer {
		d := alloc(len(b))
		if err := d.CopyFromHost(b); err != nil {
			t.Fatal(err)
		}
		return d
	}
	dw, sp, np := upload(asBytes(down)), upload(asBytes(sorted)), upload(asBytes([]int32{int32(rows)}))
	bexp := upload(make([]byte, 4*rows/16)) // expert 0 for every block of any BM
	want := make([]uint16, rows*H)
	for p := range rows {
		v := 0.74609375
		if p >= split {
			v = 3
		}
		for h := range H {
			want[p*H+h] = f32ToBF16(float32(v * sums[h]))
		}
	}
	for _, c := range MoEGemms {
		t.Run(c.Tag(), func(t *testing.T) {
			l, err := NewDown(dev, c)
			if errors.Is(err, gpuctx.ErrUnavailable) {
				t.Skipf("%v", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Memset(out, 0xFF); err != nil {
				t.Fatal(err)
			}
			gx, gy := c.Grid(H, rows, dev.Info().SMCount)
			if err := l.Launch(s, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(false), Down{
				Act: act, Down: dw, Sorted: sp, BlockExpert: bexp, Npost: np, Out: out, TK: int32(rows), H: H, I: int32(I),
			}); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			got := make([]uint16, rows*H)
			if err := out.CopyToHost(asBytes(got)); err != nil {
				t.Fatal(err)
			}
			for p := range rows {
				if g, w := got[p*H:(p+1)*H], want[p*H:(p+1)*H]; !slices.Equal(g, w) {
					t.Fatalf("row %d (the first past the split: %d): out %04x..., want %04x...", p, split, g[:4], w[:4])
				}
			}
		})
	}
}

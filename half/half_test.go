package half

import (
	"math"
	"testing"
)

func TestBF16(t *testing.T) {
	cases := []struct {
		in   float32
		want uint16
	}{
		{1, 0x3f80},
		{-2, 0xc000},
		{0, 0},
		{float32(math.Inf(1)), 0x7f80},
		{math.Float32frombits(0x3f808000), 0x3f80}, // tie: round to even (down)
		{math.Float32frombits(0x3f818000), 0x3f82}, // tie: round to even (up)
		{math.Float32frombits(0x3f808001), 0x3f81}, // above the tie: up
		{math.MaxFloat32, 0x7f80},                  // overflows to +Inf
	}
	for _, c := range cases {
		if got := BF16(c.in); got != c.want {
			t.Errorf("BF16(%g [%#08x]) = %#04x, want %#04x", c.in, math.Float32bits(c.in), got, c.want)
		}
	}
	if v := FromBF16(BF16(float32(math.NaN()))); !math.IsNaN(float64(v)) {
		t.Errorf("NaN became %g", v)
	}
	for _, h := range []uint16{0x3f80, 0xc2f7, 0x0001, 0x7f7f} {
		if got := BF16(FromBF16(h)); got != h {
			t.Errorf("round trip %#04x -> %#04x", h, got)
		}
	}
}

func TestF16(t *testing.T) {
	cases := []struct {
		in   float32
		want uint16
	}{{1, 0x3c00}, {-2, 0xc000}, {65504, 0x7bff}, {1e6, 0x7c00}, {0.000061035156, 0x0400}}
	for _, c := range cases {
		if got := F16(c.in); got != c.want {
			t.Errorf("F16(%g) = %#04x, want %#04x", c.in, got, c.want)
		}
		if got := FromF16(c.want); c.want != 0x7c00 && got != c.in {
			t.Errorf("FromF16(%#04x) = %g, want %g", c.want, got, c.in)
		}
	}
}

package moekernels

import (
	"math"
	"strings"
	"testing"
)

// TestAlignCap checks the sorted rows of the aligned sort against its worst
// case: every expert's segment padded by BM-1 rows.
func TestAlignCap(t *testing.T) {
	for _, tc := range []struct{ TK, E, BM, want int }{
		{0, 8, 16, 0}, {1, 8, 16, 16}, {6, 8, 16, 96}, {100, 4, 16, 160}, {1 << 20, 257, 128, 1081216},
	} {
		if got := AlignCap(tc.TK, tc.E, tc.BM); got != tc.want {
			t.Errorf("AlignCap(%d, %d, %d) = %d, want %d", tc.TK, tc.E, tc.BM, got, tc.want)
		}
	}
	if MaxTileRows() != 192 {
		t.Errorf("MaxTileRows() = %d, want 192 (the m192 warpgroup tiles)", MaxTileRows())
	}
}

// TestCheckLimits checks the 32-bit limits at and past 2^31, and that the
// rows of act the down tiles read (T*K*I elements, 64-bit offsets now) are
// not one of them.
func TestCheckLimits(t *testing.T) {
	const lim = math.MaxInt32
	for _, tc := range []struct {
		name           string
		T, ks, E, H, I int
		want           string // "" for nil
	}{
		{"DeepSeek-V3 at 262144 tokens: T*K*I = 2^32", 262144, 9, 257, 7168, 2048, ""},
		{"T*H at the limit", lim / 8, 1, 1, 8, 8, ""},
		{"T*H past", lim/8 + 1, 1, 1, 8, 8, "T*H"},
		{"2*I*H at the limit", 1, 1, 1, 1 << 16, (lim / 2) >> 16, ""},
		{"2*I*H past", 1, 1, 1, 1 << 16, 1 << 14, "2*I*H"},
		{"T*ks past", lim/16 + 1, 16, 16, 8, 8, "sorted rows"},
		{"padding past", (lim - 100) / 16, 16, 512, 8, 8, "sorted rows"},
		{"negative", -1, 1, 1, 8, 8, "negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckLimits(tc.T, tc.ks, tc.E, tc.H, tc.I)
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("CheckLimits(%d, %d, %d, %d, %d) = %v, want %q", tc.T, tc.ks, tc.E, tc.H, tc.I, err, tc.want)
			}
		})
	}
}

// TestMoEGemmFits checks the grid-y limit of the tiles that are not
// persistent.
func TestMoEGemmFits(t *testing.T) {
	m16 := MoEGemm{BM: 16, BN: 64, BK: 64, WarpsM: 1, WarpsN: 4, Stages: 6}
	m128 := MoEGemm{BM: 128, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 3}
	p := MoEGemm{BM: 128, BN: 128, BK: 64, Warpgroups: 2, Stages: 4, Producers: 2}
	cap := AlignCap(131072*8, 256, 128) // DeepSeek-V3, 131072 tokens
	for _, tc := range []struct {
		c    MoEGemm
		cap  int
		want bool
	}{
		{m16, 16 * MaxGridY, true}, {m16, 16*MaxGridY + 16, false}, {m16, cap, false},
		{m128, cap, true}, {p, 1 << 30, true},
	} {
		if got := tc.c.Fits(tc.cap); got != tc.want {
			t.Errorf("%s.Fits(%d) = %v, want %v", tc.c.Tag(), tc.cap, got, tc.want)
		}
		if _, y := tc.c.Grid(64, tc.cap, 132); (y <= MaxGridY) != tc.want {
			t.Errorf("%s.Grid(64, %d, 132) has y = %d; Fits = %v", tc.c.Tag(), tc.cap, y, tc.want)
		}
	}
}

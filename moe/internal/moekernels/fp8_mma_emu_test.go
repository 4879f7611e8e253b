package moekernels

import (
	"fmt"
	"math"
	"testing"

	"github.com/gpuctx/gpuctx/moe/fp8"
)

// An emulation of one thread block of moe_fp8_mma.cu's fp8_gemm, step by
// step as the CUDA code does it (the same chunk assignment, the
// fragment-order shared-memory layout of f8_achunk and f8_bchunk, the
// registers f8_block reads, mma.sync m16n8k16's fragment layout, the scale
// step and the epilogue's fragment positions), with each mma's sum computed
// exactly. On exactly summable data it must give the twin's bits: that checks
// the kernel's index arithmetic, which no CPU test of the twin reaches.

func emuAChunk(r, ch int) int {
	return ((((r>>4)*2+(ch>>3))*2+((r>>3)&1))*2+(ch&1))*32 + 4*(r&7) + ((ch >> 1) & 3)
}

func emuBChunk(R, ch int) int { return ((R>>3)*2+(ch>>2))*32 + 4*(R&7) + (ch & 3) }

// emuARow and emuBRow are f8_arow and f8_brow: the source row and column
// chunk of destination chunk d.
func emuARow(d int) (r, ch int) {
	lane, rest := d&31, d>>5
	return 16*(rest>>3) + 8*((rest>>1)&1) + lane>>2, 8*((rest>>2)&1) + 2*(lane&3) + rest&1
}

func emuBRow(d int) (R, ch int) {
	lane, rest := d&31, d>>5
	return 8*(rest>>1) + lane>>2, 4*(rest&1) + lane&3
}

// emuTile is one block of the kernel: its inputs as the kernel sees them.
type emuTile struct {
	tile                   FP8Gemm
	up                     bool
	A                      []uint16 // UP: x [T][K]; DOWN: act [cap][K]
	B                      []uint8  // the expert's [NB*N][K] codes
	S                      []float32
	rowSrc, rowDst         []int // the row tables (moe_tile_rows)
	Kdim, N, n0, mb, E, ex int
}

// stage fills stage it's shared memory as the cp.async loads do: KS K
// blocks from block it*KS (zeros past K), chunk d of the stage's A (B)
// chunks being chunk d % A_CH of its K block d / A_CH.
func (u *emuTile) stage(it int) []byte {
	c, NB := u.tile, 1
	if u.up {
		NB = 2
	}
	th, ks := c.Threads(), c.ks()
	aCh, bCh := c.BM*16, NB*c.BN*8
	aBytes, stBytes := aCh*16, aCh*16+bCh*16
	sm := make([]byte, ks*stBytes)
	k0 := it * ks * fp8.BlockSize
	for tid := range th {
		for i := 0; i < ks*aCh/th; i++ {
			d := tid + i*th
			kbl, inner := d/aCh, d%aCh
			r, ch := emuARow(inner)
			if emuAChunk(r, ch) != inner {
				panic(fmt.Sprintf("f8_arow(%d) = (%d, %d), which f8_achunk maps to %d", inner, r, ch, emuAChunk(r, ch)))
			}
			col := k0 + kbl*fp8.BlockSize + ch*8
			if src := u.rowSrc[r]; src >= 0 && col < u.Kdim {
				base := u.A[src*u.Kdim+col:] // the kernel's Ab + (src - mb*BM)*Kdim for DOWN
				for j := range 8 {
					o := kbl*stBytes + 16*inner
					sm[o+2*j], sm[o+2*j+1] = byte(base[j]), byte(base[j]>>8)
				}
			}
		}
		for i := 0; i < ks*bCh/th; i++ {
			d := tid + i*th
			kbl, inner := d/bCh, d%bCh
			R, ch := emuBRow(inner)
			if emuBChunk(R, ch) != inner {
				panic(fmt.Sprintf("f8_brow(%d) = (%d, %d), which f8_bchunk maps to %d", inner, R, ch, emuBChunk(R, ch)))
			}
			half, n := 0, u.n0+R%c.BN
			if u.up {
				half = R / c.BN
			}
			col := k0 + kbl*fp8.BlockSize + ch*16
			if n < u.N && col < u.Kdim {
				copy(sm[kbl*stBytes+aBytes+16*inner:][:16], u.B[(half*u.N+n)*u.Kdim+col:][:16])
			}
		}
	}
	return sm
}

func le32(b []byte) uint32 {
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

// bf16Pair returns the two bf16 values of a 32-bit register (low half first).
func bf16Pair(w uint32) [2]float64 {
	return [2]float64{float64(bf16ToF32(uint16(w))), float64(bf16ToF32(uint16(w >> 16)))}
}

// e4m3Pair returns f8_bf16x4's conversion of codes 2h and 2h+1 of w.
func e4m3Pair(w uint32, h int) [2]float64 {
	return [2]float64{float64(fp8.FromE4M3(uint8(w >> (16 * h)))), float64(fp8.FromE4M3(uint8(w >> (16*h + 8))))}
}

// block returns the block sums of one stage for warp w: [nb][i][t][lane][v]
// as the mma accumulators hold them, each mma's sum exact (float64).
func (u *emuTile) block(sm []byte, w int) [][][][32][4]float64 {
	c, NB := u.tile, 1
	if u.up {
		NB = 2
	}
	MT, WN := c.BM/16, c.BN/c.WarpsN
	NT, aBytes := WN/8, c.BM*16*16
	p := make([][][][32][4]float64, NB)
	for nb := range NB {
		p[nb] = make([][][32][4]float64, MT)
		for i := range MT {
			p[nb][i] = make([][32][4]float64, NT)
		}
	}
	for q := range 2 {
		for j := range 4 {
			for nb := range NB {
				for t := range NT {
					tileIdx := (w*WN+nb*c.BN)/8 + t
					var Bm [16][8]float64 // B[slot][n]
					for lane := range 32 {
						wd := le32(sm[aBytes+((tileIdx*2+q)*32+lane)*16+4*j:])
						g, cc := lane>>2, lane&3
						b0, b1 := e4m3Pair(wd, 0), e4m3Pair(wd, 1)
						Bm[2*cc][g], Bm[2*cc+1][g], Bm[2*cc+8][g], Bm[2*cc+9][g] = b0[0], b0[1], b1[0], b1[1]
					}
					for i := range MT {
						var Am [16][16]float64 // A[m][slot]
						for lane := range 32 {
							g, cc := lane>>2, lane&3
							rd := func(rh, pair int) [2]float64 {
								off := ((((i*2+q)*2+rh)*2+pair/4)*32+lane)*16 + 4*(pair%4)
								return bf16Pair(le32(sm[off:]))
							}
							a0, a1, a2, a3 := rd(0, 2*j), rd(1, 2*j), rd(0, 2*j+1), rd(1, 2*j+1)
							Am[g][2*cc], Am[g][2*cc+1], Am[g+8][2*cc], Am[g+8][2*cc+1] = a0[0], a0[1], a1[0], a1[1]
							Am[g][2*cc+8], Am[g][2*cc+9], Am[g+8][2*cc+8], Am[g+8][2*cc+9] = a2[0], a2[1], a3[0], a3[1]
						}
						for lane := range 32 {
							g, cc := lane>>2, lane&3
							for v := range 4 {
								m, n := g+8*(v/2), 2*cc+v%2
								var s float64
								for k := range 16 {
									s += Am[m][k] * Bm[k][n]
								}
								p[nb][i][t][lane][v] += s
							}
						}
					}
				}
			}
		}
	}
	return p
}

// blockT is block for a transposed tile (f8_block_t): [nb][mt][rg][lane][v]
// with the weights as mma's A operand (rows g and g+8 of m-tile mt) and
// token group rg's rows as its B operand, each mma's sum exact. Every group
// is multiplied (the kernel skips groups without data, whose sums are 0).
func (u *emuTile) blockT(sm []byte, w int) [][][][32][4]float64 {
	c, NB := u.tile, 1
	if u.up {
		NB = 2
	}
	WN, aBytes := c.BN/c.WarpsN, c.BM*16*16
	MW, RG := WN/16, c.BM/8
	p := make([][][][32][4]float64, NB)
	for nb := range NB {
		p[nb] = make([][][32][4]float64, MW)
		for mt := range MW {
			p[nb][mt] = make([][32][4]float64, RG)
		}
	}
	for q := range 2 {
		for j := range 4 {
			for nb := range NB {
				for mt := range MW {
					var Am [16][16]float64 // A[weight row][slot]
					for lane := range 32 {
						g, cc := lane>>2, lane&3
						for hh := range 2 {
							tileIdx := (w*WN+nb*c.BN)/8 + 2*mt + hh
							wd := le32(sm[aBytes+((tileIdx*2+q)*32+lane)*16+4*j:])
							lo, hi := e4m3Pair(wd, 0), e4m3Pair(wd, 1)
							m := g + 8*hh
							Am[m][2*cc], Am[m][2*cc+1], Am[m][2*cc+8], Am[m][2*cc+9] = lo[0], lo[1], hi[0], hi[1]
						}
					}
					for rg := range RG {
						var Bm [16][8]float64 // B[slot][token]
						for lane := range 32 {
							g, cc := lane>>2, lane&3
							rd := func(pair int) [2]float64 {
								off := (((((rg>>1)*2+q)*2+(rg&1))*2+pair/4)*32+lane)*16 + 4*(pair%4)
								return bf16Pair(le32(sm[off:]))
							}
							b0, b1 := rd(2*j), rd(2*j+1)
							Bm[2*cc][g], Bm[2*cc+1][g], Bm[2*cc+8][g], Bm[2*cc+9][g] = b0[0], b0[1], b1[0], b1[1]
						}
						for lane := range 32 {
							g, cc := lane>>2, lane&3
							for v := range 4 {
								m, n := g+8*(v/2), 2*cc+v%2
								var s float64
								for k := range 16 {
									s += Am[m][k] * Bm[k][n]
								}
								p[nb][mt][rg][lane][v] += s
							}
						}
					}
				}
			}
		}
	}
	return p
}

// run returns the block's stores: output row -> column -> bf16.
func (u *emuTile) run() map[int]map[int]uint16 {
	c, NB := u.tile, 1
	if u.up {
		NB = 2
	}
	MT, WN := c.BM/16, c.BN/c.WarpsN
	NT := WN / 8
	block := u.block
	if c.Trans { // (i, t) stand for (mt, rg): the accumulators of blockT
		MT, NT, block = WN/16, c.BM/8, u.blockT
	}
	KB, NBR := (u.Kdim+127)/128, (u.N+127)/128
	out := map[int]map[int]uint16{}
	store := func(dst, n int, o uint16) {
		if out[dst] == nil {
			out[dst] = map[int]uint16{}
		}
		out[dst][n] = o
	}
	ks := c.ks()
	stBytes := c.BM*16*16 + NB*c.BN*8*16
	gt, nv := 32*c.WarpsN, NB*MT*NT*4 // a K group's threads, values a thread
	for w := range c.WarpsN {
		acc := make([]float32, NB*MT*NT*32*4)
		at := func(nb, i, t, lane, v int) *float32 { return &acc[(((nb*MT+i)*NT+t)*32+lane)*4+v] }
		// The exchange area of fp8_main_t ([round parity][group - 1][value]
		// [thread of the group]), NaN until written, and the groups with
		// data (live): a split tile neither stores nor adds the others.
		xq := make([]float32, 2*(ks-1)*nv*gt)
		for i := range xq {
			xq[i] = float32(math.NaN())
		}
		live := func(rg int) bool {
			if !c.Trans {
				return true
			}
			for r := 8 * rg; r < 8*rg+8; r++ {
				if u.rowSrc[r] >= 0 {
					return true
				}
			}
			return false
		}
		// scaled calls fn with each value of group ks's scaled block sums of
		// block kb (p * s rounded to f32).
		scaled := func(p [][][][32][4]float64, kb int, fn func(nb, i, t, lane, v int, q float32)) {
			for nb := range NB {
				s := u.S[((u.ex*NB+nb)*NBR+u.n0/128)*KB+kb]
				for i := range MT {
					for t := range NT {
						for lane := range 32 {
							for v := range 4 {
								fn(nb, i, t, lane, v, float32(float32(p[nb][i][t][lane][v])*s))
							}
						}
					}
				}
			}
		}
		// gather is group 0 adding round r's exchanged sums, as fp8_main_t's.
		gather := func(r int) {
			for j := 1; j < ks && r*ks+j < KB; j++ {
				for nb := range NB {
					for i := range MT {
						for t := range NT {
							if !live(t) {
								continue
							}
							for lane := range 32 {
								for v := range 4 {
									x := ((nb*MT+i)*NT+t)*4 + v
									a := at(nb, i, t, lane, v)
									*a += xq[(r&1)*(ks-1)*nv*gt+((j-1)*nv+x)*gt+w*32+lane]
								}
							}
						}
					}
				}
			}
		}
		NKS := (KB + ks - 1) / ks
		for it := range NKS {
			sm := u.stage(it)
			// The other groups may store round it's sums before group 0
			// adds round it - 1's (both after the round's barrier): they do
			// here, so that a shared buffer would show.
			for g := 1; g < ks && it*ks+g < KB; g++ {
				scaled(block(sm[g*stBytes:], w), it*ks+g, func(nb, i, t, lane, v int, q float32) {
					if live(t) {
						xq[(it&1)*(ks-1)*nv*gt+(g-1)*nv*gt+(((nb*MT+i)*NT+t)*4+v)*gt+w*32+lane] = q
					}
				})
			}
			if it > 0 {
				gather(it - 1)
			}
			scaled(block(sm, w), it*ks, func(nb, i, t, lane, v int, q float32) { *at(nb, i, t, lane, v) += q })
		}
		if NKS > 0 {
			gather(NKS - 1)
		}
		if c.Trans {
			for mt := range MT {
				for rg := range NT {
					for lane := range 32 {
						for v := range 4 {
							r := 8*rg + 2*(lane&3) + v%2
							n := u.n0 + w*WN + 16*mt + lane>>2 + 8*(v/2)
							dst := u.rowDst[r]
							if dst < 0 || n >= u.N {
								continue
							}
							var o uint16
							if u.up && u.rowSrc[r] >= 0 {
								g := bf16ToF32(f32ToBF16(*at(0, mt, rg, lane, v)))
								uu := bf16ToF32(f32ToBF16(*at(1, mt, rg, lane, v)))
								o = f32ToBF16(fp8SwiGLU(g, uu))
							} else if !u.up {
								o = f32ToBF16(*at(0, mt, rg, lane, v))
							}
							store(dst, n, o)
						}
					}
				}
			}
			continue
		}
		for i := range MT {
			for lane := range 32 {
				for hr := range 2 {
					r := i*16 + lane>>2 + hr*8
					dst := u.rowDst[r]
					if dst < 0 {
						continue
					}
					for t := range NT {
						n := u.n0 + w*WN + t*8 + (lane&3)*2
						if n >= u.N {
							continue
						}
						for v := range 2 {
							var o uint16
							if u.up && u.rowSrc[r] >= 0 {
								g := bf16ToF32(f32ToBF16(*at(0, i, t, lane, hr*2+v)))
								uu := bf16ToF32(f32ToBF16(*at(1, i, t, lane, hr*2+v)))
								o = f32ToBF16(fp8SwiGLU(g, uu))
							} else if !u.up {
								o = f32ToBF16(*at(0, i, t, lane, hr*2+v))
							}
							store(dst, n+v, o)
						}
					}
				}
			}
		}
	}
	return out
}

// TestFP8MMAEmulated runs the emulated kernel over every block of every
// FP8 tile, up and down, on exact data with partial blocks (plain, then
// widened: fp8MMACase.widen), and checks that it stores the twin's bits
// exactly where the kernel must store. The K-split tiles also run a K of 10
// blocks (up: rounds of 4, 4 and 2 blocks for KS = 4) and 4 (down), so
// that their exchange runs more than one round.
func TestFP8MMAEmulated(t *testing.T) {
	cpu := newTestDevice(t)
	for _, sh := range []struct {
		H, I  int
		split bool // the K-split tiles only
	}{{272, 144, false}, {1168, 400, true}} {
		w := newFP8MMAWeights(3, sh.H, sh.I, true, 5)
		wp := w.upload(t, cpu)
		for _, wide := range []bool{false, true} {
			c := w.batch(20, 2, 6)
			if wide {
				c.widen(9)
			}
			for _, tile := range FP8Gemms {
				if sh.split && tile.ks() == 1 {
					continue
				}
				for _, up := range []bool{true, false} {
					t.Run(fmt.Sprintf("H=%d/%s/up=%v/wide=%v", sh.H, tile.Tag(), up, wide), func(t *testing.T) {
						want := c.run(t, cpu, wp, tile, up)
						got := emuRun(c, tile, up)
						ncol := map[bool]int{true: c.I, false: c.H}[up]
						stored := 0
						for row, cols := range got {
							for n, v := range cols {
								stored++
								if want[row*ncol+n] != v {
									t.Fatalf("row %d column %d: emulated kernel %#04x, twin %#04x", row, n, v, want[row*ncol+n])
								}
							}
						}
						sorted, blockExpert, npost, _ := c.align(tile.BM)
						rows := 0
						for p := range int(npost) {
							if blockExpert[p/tile.BM] >= 0 && (up || int(sorted[p]) < len(c.idx)) {
								rows++
							}
						}
						if stored != rows*ncol {
							t.Errorf("the emulated kernel stored %d values, want %d rows of %d", stored, rows, ncol)
						}
					})
				}
			}
		}
	}
}

// emuRun runs every block of the tile's grid over the case.
func emuRun(c *fp8MMACase, tile FP8Gemm, up bool) map[int]map[int]uint16 {
	sorted, blockExpert, npost, cp := c.align(tile.BM)
	TK := len(c.idx)
	u := &emuTile{tile: tile, up: up, Kdim: c.H, N: c.I, E: c.E}
	codes, scales := c.weights(up)
	u.S = scales
	if up {
		u.A = c.x
	} else {
		u.A, u.Kdim, u.N = c.actRows(tile.BM), c.I, c.H
	}
	NB := map[bool]int{true: 2, false: 1}[up]
	all := map[int]map[int]uint16{}
	gx, gy := tile.Grid(u.N, cp)
	for mb := range gy {
		if mb*tile.BM >= int(npost) || blockExpert[mb] < 0 {
			continue
		}
		u.mb, u.ex = mb, int(blockExpert[mb])
		u.B = codes[u.ex*NB*u.N*u.Kdim:][:NB*u.N*u.Kdim]
		u.rowSrc, u.rowDst = make([]int, tile.BM), make([]int, tile.BM)
		for r := range tile.BM {
			p := mb*tile.BM + r
			a := int(sorted[p])
			real := a >= 0 && a < TK
			switch {
			case up && real:
				u.rowSrc[r], u.rowDst[r] = a/c.K, p
			case up:
				u.rowSrc[r], u.rowDst[r] = -1, p
			case real:
				u.rowSrc[r], u.rowDst[r] = p, a
			default:
				u.rowSrc[r], u.rowDst[r] = -1, -1
			}
		}
		for nx := range gx {
			u.n0 = nx * tile.BN
			for row, cols := range u.run() {
				if all[row] == nil {
					all[row] = map[int]uint16{}
				}
				for n, v := range cols {
					all[row][n] = v
				}
			}
		}
	}
	return all
}

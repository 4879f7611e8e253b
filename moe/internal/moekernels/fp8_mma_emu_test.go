package moekernels

import (
	"fmt"
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

// stage fills one stage's shared memory as the cp.async loads do.
func (u *emuTile) stage(kb int) []byte {
	c, NB := u.tile, 1
	if u.up {
		NB = 2
	}
	th := c.Threads()
	aBytes := c.BM * 16 * 16
	sm := make([]byte, aBytes+NB*c.BN*8*16)
	k0 := kb * fp8.BlockSize
	for tid := range th {
		for i := 0; i < c.BM*16/th; i++ {
			d := tid + i*th
			r, ch := emuARow(d)
			if emuAChunk(r, ch) != d {
				panic(fmt.Sprintf("f8_arow(%d) = (%d, %d), which f8_achunk maps to %d", d, r, ch, emuAChunk(r, ch)))
			}
			if src := u.rowSrc[r]; src >= 0 && k0+ch*8 < u.Kdim {
				base := u.A[src*u.Kdim+k0+ch*8:] // the kernel's Ab + (src - mb*BM)*Kdim for DOWN
				for j := range 8 {
					sm[16*d+2*j], sm[16*d+2*j+1] = byte(base[j]), byte(base[j]>>8)
				}
			}
		}
		for i := 0; i < NB*c.BN*8/th; i++ {
			d := tid + i*th
			R, ch := emuBRow(d)
			if emuBChunk(R, ch) != d {
				panic(fmt.Sprintf("f8_brow(%d) = (%d, %d), which f8_bchunk maps to %d", d, R, ch, emuBChunk(R, ch)))
			}
			half, n := 0, u.n0+R%c.BN
			if u.up {
				half = R / c.BN
			}
			if n < u.N && k0+ch*16 < u.Kdim {
				copy(sm[aBytes+16*d:][:16], u.B[(half*u.N+n)*u.Kdim+k0+ch*16:][:16])
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
	for w := range c.WarpsN {
		acc := make([]float32, NB*MT*NT*32*4)
		at := func(nb, i, t, lane, v int) *float32 { return &acc[(((nb*MT+i)*NT+t)*32+lane)*4+v] }
		for kb := range KB {
			p := block(u.stage(kb), w)
			for nb := range NB {
				s := u.S[((u.ex*NB+nb)*NBR+u.n0/128)*KB+kb]
				for i := range MT {
					for t := range NT {
						for lane := range 32 {
							for v := range 4 {
								a := at(nb, i, t, lane, v)
								*a += float32(float32(p[nb][i][t][lane][v]) * s)
							}
						}
					}
				}
			}
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
// widened: fp8MMACase.widen), and checks that
// it stores the twin's bits exactly where the kernel must store.
func TestFP8MMAEmulated(t *testing.T) {
	w := newFP8MMAWeights(3, 272, 144, true, 5)
	cpu := newTestDevice(t)
	wp := w.upload(t, cpu)
	for _, wide := range []bool{false, true} {
		c := w.batch(20, 2, 6)
		if wide {
			c.widen(9)
		}
		for _, tile := range FP8Gemms {
			for _, up := range []bool{true, false} {
				t.Run(fmt.Sprintf("%s/up=%v/wide=%v", tile.Tag(), up, wide), func(t *testing.T) {
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

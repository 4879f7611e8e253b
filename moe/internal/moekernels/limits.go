package moekernels

import (
	"fmt"
	"math"
	"sync"
)

// The kernels keep row counts and most element offsets in 32-bit ints (they
// cost registers in the GEMM tiles); offsets whose products can pass 2^31
// for a batch the layer accepts are 64-bit (long long in the CUDA sources, Go
// int in the twins): the rows of act, T*K*I elements, that the down tiles
// read start at a 64-bit offset per row block. What stays 32-bit is bounded
// by CheckLimits.

// AlignCap is the number of sorted rows gpuctx_moe_align and its three-launch
// form need for TK assignments over E experts in blocks of BM rows: every
// expert's segment padded to a multiple of BM, roundup(TK + min(E, TK)*(BM-1),
// BM).
func AlignCap(TK, E, BM int) int {
	n := TK + min(E, TK)*(BM-1)
	return (n + BM - 1) / BM * BM
}

// MaxTileRows returns the largest BM of MoEGemms: the padding AlignCap adds
// per expert at most.
var MaxTileRows = sync.OnceValue(func() int {
	bm := 0
	for _, c := range MoEGemms {
		bm = max(bm, c.BM)
	}
	return bm
})

// CheckLimits reports whether a batch of T tokens, with ks routing slots per
// token (top-k plus the fused shared expert's chunks) sorted over E experts
// (routed plus chunks), hidden size H and expert width I, fits the 32-bit
// arithmetic of the MoE kernels: the sorted rows (AlignCap of T*ks with the
// largest tile, the kernels' TK, cap and row indices), T*H (the x rows the up
// tiles read) and 2*I*H (one expert's gate and up weights, the tiles' weight
// offsets), each at most math.MaxInt32. The error, a sentence for the caller
// to prefix, names the first limit passed; nil if none is.
func CheckLimits(T, ks, E, H, I int) error {
	const lim = math.MaxInt32
	if T < 0 || ks < 0 || E < 0 || H < 0 || I < 0 {
		return fmt.Errorf("moekernels: CheckLimits: T=%d ks=%d E=%d H=%d I=%d: negative size", T, ks, E, H, I)
	}
	if w := int64(2) * int64(I) * int64(H); w > lim {
		return fmt.Errorf("an expert's gate and up weights hold 2*I*H = %d elements, more than the MoE kernels' 32-bit weight offsets allow (%d)", w, lim)
	}
	if x := int64(T) * int64(H); x > lim {
		return fmt.Errorf("a batch of %d tokens holds T*H = %d elements, more than the MoE kernels' 32-bit offsets of x allow (%d); split the batch", T, x, lim)
	}
	tk, bm := int64(T)*int64(ks), int64(MaxTileRows())
	if tk > lim || (tk+min(int64(E), tk)*(bm-1)+bm-1)/bm*bm > lim { // AlignCap in 64 bits

		return fmt.Errorf("a batch of %d tokens with %d routing slots each makes more sorted rows than the MoE kernels' 32-bit row indices hold (%d with the padding of %d experts); split the batch", T, ks, lim, E)
	}
	return nil
}

// Package collective is the seam between gpuctx programs and a collectives
// library: a Comm is one rank of a group of devices that exchange buffers.
//
// Two implementations exist: Local (this package), an in-process group of N
// devices of any backend (the CPU backend in CI) that meet at a rendezvous of
// goroutines and channels; and the NCCL binding (package collective/nccl),
// which loads libnccl.so.2 at run time.
//
// Every rank of a group must call the same operations in the same order (as
// with MPI or NCCL); an operation blocks or fails until every rank has called
// it. Counts are in bytes: rank r's block for rank d starts at the sum of
// sendCounts[:d] in its send buffer, and the block it receives from rank s
// starts at the sum of recvCounts[:s] in its receive buffer.
package collective

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
)

// Comm is one rank of a communicator. A Comm is used by one goroutine at a
// time (its rank's); different ranks' Comms are used concurrently.
type Comm interface {
	// Rank returns this rank, in [0, Size()).
	Rank() int
	// Size returns the number of ranks.
	Size() int
	// AllGather exchanges a few host integers (per-rank counts): every rank
	// passes len(counts) == n (the same n on every rank) and gets back
	// Size()*n values, rank r's at [r*n, (r+1)*n). It blocks until every rank
	// has called it.
	AllGather(counts []int) ([]int, error)
	// AllToAllV sends sendCounts[d] bytes of send to rank d and receives
	// recvCounts[s] bytes from rank s into recv (blocks packed in rank order,
	// see the package doc), in the order of stream: it reads send after the
	// work queued on stream before it, and work queued after it sees recv.
	// sendCounts[d] on rank s must equal recvCounts[s] on rank d; a mismatch is
	// an error wrapping gpuctx.ErrInvalid on both ranks. Zero counts are
	// allowed, and send or recv may then be nil.
	AllToAllV(send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int, stream *gpuctx.Stream) error
	// Close releases this rank. Operations of the group that have not
	// completed, and later ones, fail with an error wrapping gpuctx.ErrClosed.
	// Double Close is harmless.
	Close() error
}

// Displacements returns the offset of each block of a packed buffer whose
// block sizes are counts, and their sum.
func Displacements(counts []int) (displ []int, total int) {
	displ = make([]int, len(counts))
	for i, c := range counts {
		displ[i] = total
		total += c
	}
	return displ, total
}

// CheckCounts checks the arguments of AllToAllV for a group of size n: n
// non-negative counts each, and buffers large enough for their sums (a nil
// buffer only with a zero sum). op names the caller in the error.
func CheckCounts(op string, n int, send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int) error {
	for _, v := range []struct {
		name   string
		buf    *gpuctx.Buffer
		counts []int
	}{{"send", send, sendCounts}, {"recv", recv, recvCounts}} {
		if len(v.counts) != n {
			return fmt.Errorf("collective: %s: %d %s counts for %d ranks: %w", op, len(v.counts), v.name, n, gpuctx.ErrInvalid)
		}
		total := 0
		for r, c := range v.counts {
			if c < 0 {
				return fmt.Errorf("collective: %s: %s count %d for rank %d is negative: %w", op, v.name, c, r, gpuctx.ErrInvalid)
			}
			total += c
		}
		if total == 0 {
			continue
		}
		if v.buf == nil {
			return fmt.Errorf("collective: %s: %s buffer is nil but its counts sum to %d bytes: %w", op, v.name, total, gpuctx.ErrInvalid)
		}
		if v.buf.Size() < total {
			return fmt.Errorf("collective: %s: %s buffer holds %d bytes, its counts sum to %d: %w", op, v.name, v.buf.Size(), total, gpuctx.ErrSize)
		}
	}
	return nil
}

package collective

import (
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx"
)

// Local is one rank of an in-process group made by NewLocal: the ranks are
// goroutines of one program, each driving its own device (of any backend,
// several CPU-backend runtimes in tests), and every operation is a rendezvous
// of the N ranks.
//
// AllToAllV runs at the call: it waits for the stream (so that send holds
// what was queued before it and recv is no longer in use), meets the other
// ranks, copies each block from the sender's buffer with synchronous copies
// through host memory, waits until every rank has copied (so that no sender
// reuses its buffer early) and returns, holding its stream and buffers
// (gpuctx.Stream.WithNative) from the rendezvous to the end: meanwhile a
// Buffer.Free of send or recv fails and a Stream.Close waits. The effect is thus in stream order,
// but the calling goroutine blocks for the whole exchange; work queued on
// other streams (a shared expert on a side stream) keeps running meanwhile.
type Local struct {
	g      *group
	rank   int
	seq    uint64
	closed bool
}

type group struct {
	n         int
	mu        sync.Mutex
	rounds    map[uint64]*round
	closed    chan struct{}
	closeOnce sync.Once
}

// round is one collective operation: the ranks' contributions, and two
// barriers (every rank arrived; every rank finished reading the others').
type round struct {
	kinds   []string
	in      []any
	arrived int
	left    int
	full    chan struct{}
	done    chan struct{}
}

// NewLocal returns the n ranks of a new in-process group (n >= 1), rank r at
// index r. Each is used by one goroutine; the group ends when any rank is
// closed.
func NewLocal(n int) ([]*Local, error) {
	if n < 1 {
		return nil, fmt.Errorf("collective: NewLocal: %d ranks: need at least 1: %w", n, gpuctx.ErrInvalid)
	}
	g := &group{n: n, rounds: map[uint64]*round{}, closed: make(chan struct{})}
	out := make([]*Local, n)
	for r := range out {
		out[r] = &Local{g: g, rank: r}
	}
	return out, nil
}

// Rank returns this rank.
func (c *Local) Rank() int { return c.rank }

// Size returns the number of ranks of the group.
func (c *Local) Size() int { return c.g.n }

// Close ends the group: every rank's pending and later operations fail with
// an error wrapping gpuctx.ErrClosed. Double Close is harmless.
func (c *Local) Close() error {
	c.closed = true
	c.g.closeOnce.Do(func() { close(c.g.closed) })
	return nil
}

func (c *Local) errClosed(op string) error {
	return fmt.Errorf("collective: Local.%s: rank %d of %d: group closed: %w", op, c.rank, c.g.n, gpuctx.ErrClosed)
}

// arrive adds this rank's contribution v to its next round and waits until
// every rank has arrived.
func (c *Local) arrive(op string, v any) (*round, error) {
	g := c.g
	select {
	case <-g.closed:
		return nil, c.errClosed(op)
	default:
	}
	g.mu.Lock()
	r := g.rounds[c.seq]
	if r == nil {
		r = &round{kinds: make([]string, g.n), in: make([]any, g.n), full: make(chan struct{}), done: make(chan struct{})}
		g.rounds[c.seq] = r
	}
	r.kinds[c.rank], r.in[c.rank] = op, v
	r.arrived++
	if r.arrived == g.n {
		close(r.full)
	}
	g.mu.Unlock()
	select {
	case <-r.full:
	case <-g.closed:
		return nil, c.errClosed(op)
	}
	for s, k := range r.kinds {
		if k != op {
			c.leave(op, r)
			return nil, fmt.Errorf("collective: Local.%s: rank %d called %s in the same round: every rank must call the same operations in the same order: %w", op, s, k, gpuctx.ErrInvalid)
		}
	}
	return r, nil
}

// leave marks this rank done with r and waits until every rank is.
func (c *Local) leave(op string, r *round) error {
	g := c.g
	g.mu.Lock()
	r.left++
	if r.left == g.n {
		close(r.done)
		delete(g.rounds, c.seq)
	}
	g.mu.Unlock()
	c.seq++
	select {
	case <-r.done:
		return nil
	case <-g.closed:
		return c.errClosed(op)
	}
}

// AllGather implements Comm.
func (c *Local) AllGather(counts []int) ([]int, error) {
	const op = "AllGather"
	if c.closed {
		return nil, c.errClosed(op)
	}
	r, err := c.arrive(op, append([]int(nil), counts...))
	if err != nil {
		return nil, err
	}
	out := make([]int, 0, c.g.n*len(counts))
	for s, v := range r.in {
		in := v.([]int)
		if len(in) != len(counts) && err == nil {
			err = fmt.Errorf("collective: Local.AllGather: rank %d passed %d counts, rank %d passed %d: %w", s, len(in), c.rank, len(counts), gpuctx.ErrInvalid)
		}
		out = append(out, in...)
	}
	if lerr := c.leave(op, r); err == nil {
		err = lerr
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

type a2aArgs struct {
	send                   *gpuctx.Buffer
	sendCounts, recvCounts []int
}

// AllToAllV implements Comm (see Local for how it runs).
func (c *Local) AllToAllV(send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int, stream *gpuctx.Stream) error {
	const op = "AllToAllV"
	if c.closed {
		return c.errClosed(op)
	}
	// Argument errors are reported before the rendezvous; the other ranks
	// then wait until the group is closed, as they would with NCCL.
	if stream == nil {
		return fmt.Errorf("collective: Local.AllToAllV: nil stream: %w", gpuctx.ErrInvalid)
	}
	if err := CheckCounts("Local.AllToAllV", c.g.n, send, sendCounts, recv, recvCounts); err != nil {
		return err
	}
	for _, b := range []*gpuctx.Buffer{send, recv} {
		if b != nil && b.Device() != stream.Device() {
			return fmt.Errorf("collective: Local.AllToAllV: a buffer belongs to another device than the stream: %w", gpuctx.ErrWrongDevice)
		}
	}
	if err := stream.Synchronize(); err != nil {
		return fmt.Errorf("collective: Local.AllToAllV: %w", err)
	}
	// The leases keep the stream open and both buffers allocated until every
	// rank has copied: a peer reads send, and a Close of stream waits.
	return stream.WithNative([]*gpuctx.Buffer{send, recv}, func(gpuctx.Native) error {
		r, err := c.arrive(op, a2aArgs{send, append([]int(nil), sendCounts...), append([]int(nil), recvCounts...)})
		if err != nil {
			return err
		}
		err = c.copyIn(r, recv, recvCounts)
		if lerr := c.leave(op, r); err == nil {
			err = lerr
		}
		return err
	})
}

// copyIn checks that every rank's counts agree with this rank's and copies
// the blocks addressed to this rank into recv.
func (c *Local) copyIn(r *round, recv *gpuctx.Buffer, recvCounts []int) error {
	me := r.in[c.rank].(a2aArgs)
	for s, v := range r.in {
		in := v.(a2aArgs)
		if in.sendCounts[c.rank] != recvCounts[s] {
			return fmt.Errorf("collective: Local.AllToAllV: rank %d sends %d bytes to rank %d, which expects %d: %w", s, in.sendCounts[c.rank], c.rank, recvCounts[s], gpuctx.ErrInvalid)
		}
		if in.recvCounts[c.rank] != me.sendCounts[s] {
			return fmt.Errorf("collective: Local.AllToAllV: rank %d sends %d bytes to rank %d, which expects %d: %w", c.rank, me.sendCounts[s], s, in.recvCounts[c.rank], gpuctx.ErrInvalid)
		}
	}
	rdispl, _ := Displacements(recvCounts)
	var tmp []byte
	for s, v := range r.in {
		n := recvCounts[s]
		if n == 0 {
			continue
		}
		in := v.(a2aArgs)
		sdispl, _ := Displacements(in.sendCounts)
		src, err := in.send.Slice(sdispl[c.rank], n)
		if err != nil {
			return err
		}
		dst, err := recv.Slice(rdispl[s], n)
		if err != nil {
			return err
		}
		if cap(tmp) < n {
			tmp = make([]byte, n)
		}
		if err := src.CopyToHost(tmp[:n]); err != nil {
			return fmt.Errorf("collective: Local.AllToAllV: reading rank %d's block: %w", s, err)
		}
		if err := dst.CopyFromHost(tmp[:n]); err != nil {
			return fmt.Errorf("collective: Local.AllToAllV: writing rank %d's block: %w", s, err)
		}
	}
	return nil
}

var _ Comm = (*Local)(nil)

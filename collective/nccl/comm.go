package nccl

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
)

// ncclUint8 is ncclDataType_t's ncclUint8: counts are bytes.
const ncclUint8 int32 = 1

// Comm is one rank of an NCCL communicator on one CUDA device; it implements
// collective.Comm. Use it from one goroutine at a time.
type Comm struct {
	lib        *Lib
	dev        *gpuctx.Device
	comm       uintptr
	rank, size int
	own        *gpuctx.Stream // AllGather's stream
	mu         sync.Mutex
	closed     bool
}

// NewComm joins rank rank of a communicator of size ranks identified by id,
// on dev (a CUDA device). It blocks until every rank has joined
// (ncclCommInitRank).
func NewComm(lib *Lib, dev *gpuctx.Device, id UniqueID, size, rank int) (*Comm, error) {
	const op = "nccl.NewComm"
	if lib == nil || dev == nil {
		return nil, fmt.Errorf("%w: %s: nil library or device", gpuctx.ErrInvalid, op)
	}
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("%w: %s: rank %d of %d", gpuctx.ErrInvalid, op, rank, size)
	}
	own, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if _, err := own.NativeHandle(); err != nil {
		_ = own.Close()
		return nil, fmt.Errorf("%s: NCCL needs a CUDA device: %w", op, err)
	}
	c := &Comm{lib: lib, dev: dev, rank: rank, size: size, own: own}
	err = dev.OnThread(func() error {
		return lib.check("ncclCommInitRank", lib.s.ncclCommInitRank(&c.comm, int32(size), ncclUniqueID{id}, int32(rank)))
	})
	if err != nil {
		_ = own.Close()
		return nil, fmt.Errorf("%s: rank %d of %d: %w", op, rank, size, err)
	}
	return c, nil
}

// Rank returns this rank.
func (c *Comm) Rank() int { return c.rank }

// Size returns the number of ranks.
func (c *Comm) Size() int { return c.size }

func (c *Comm) errClosed(op string) error {
	return fmt.Errorf("nccl: Comm.%s: rank %d: %w", op, c.rank, gpuctx.ErrClosed)
}

// AllToAllV implements collective.Comm: one ncclGroupStart/End around an
// ncclSend and an ncclRecv per peer with a non-zero count, queued on stream
// (the rank's own block included). It returns once the calls are queued.
func (c *Comm) AllToAllV(send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int, stream *gpuctx.Stream) error {
	const op = "AllToAllV"
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return c.errClosed(op)
	}
	if stream == nil {
		return fmt.Errorf("%w: nccl: Comm.AllToAllV: nil stream", gpuctx.ErrInvalid)
	}
	if err := collective.CheckCounts("Comm.AllToAllV", c.size, send, sendCounts, recv, recvCounts); err != nil {
		return err
	}
	return c.exchange(send, sendCounts, recv, recvCounts, stream)
}

// exchange queues the send/recv group; c.mu is held.
func (c *Comm) exchange(send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int, stream *gpuctx.Stream) error {
	h, err := stream.NativeHandle()
	if err != nil {
		return fmt.Errorf("nccl: %w", err)
	}
	var sp, rp gpuctx.Ptr
	if send != nil {
		if sp, err = send.Ptr(); err != nil {
			return err
		}
	}
	if recv != nil {
		if rp, err = recv.Ptr(); err != nil {
			return err
		}
	}
	sd, _ := collective.Displacements(sendCounts)
	rd, _ := collective.Displacements(recvCounts)
	l := c.lib
	return c.dev.OnThread(func() error {
		if err := l.check("ncclGroupStart", l.s.ncclGroupStart()); err != nil {
			return err
		}
		var first error
		for p := range c.size {
			if n := sendCounts[p]; n > 0 && first == nil {
				first = l.check("ncclSend", l.s.ncclSend(uintptr(sp)+uintptr(sd[p]), uintptr(n), ncclUint8, int32(p), c.comm, h))
			}
			if n := recvCounts[p]; n > 0 && first == nil {
				first = l.check("ncclRecv", l.s.ncclRecv(uintptr(rp)+uintptr(rd[p]), uintptr(n), ncclUint8, int32(p), c.comm, h))
			}
		}
		// The group is always closed, also after an error.
		return errors.Join(first, l.check("ncclGroupEnd", l.s.ncclGroupEnd()))
	})
}

// AllGather implements collective.Comm: the counts (as int64) go through a
// device buffer and a send/recv group on the Comm's own stream, which it
// waits for.
func (c *Comm) AllGather(counts []int) ([]int, error) {
	const op = "AllGather"
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, c.errClosed(op)
	}
	n := len(counts)
	blk := 8 * n
	if blk == 0 {
		return []int{}, nil
	}
	buf, err := c.dev.Alloc(blk * (c.size + 1)) // [own counts | everyone's]
	if err != nil {
		return nil, err
	}
	defer buf.Free()
	host := make([]byte, blk)
	for i, v := range counts {
		binary.LittleEndian.PutUint64(host[8*i:], uint64(int64(v)))
	}
	mine, err := buf.Slice(0, blk)
	if err != nil {
		return nil, err
	}
	if err := mine.CopyFromHost(host); err != nil {
		return nil, err
	}
	all, err := buf.Slice(blk, blk*c.size)
	if err != nil {
		return nil, err
	}
	// mine holds one block; send it whole to every peer by giving each peer a
	// view of the same bytes.
	for p := range c.size {
		if err := c.exchangeOne(mine, all, p, blk); err != nil {
			return nil, fmt.Errorf("nccl: Comm.AllGather: %w", err)
		}
	}
	if err := c.own.Synchronize(); err != nil {
		return nil, err
	}
	out := make([]byte, blk*c.size)
	if err := all.CopyToHost(out); err != nil {
		return nil, err
	}
	res := make([]int, n*c.size)
	for i := range res {
		res[i] = int(int64(binary.LittleEndian.Uint64(out[8*i:])))
	}
	return res, nil
}

// exchangeOne queues, for round p, a send of mine to rank (rank+p)%size and a
// receive from rank (rank-p)%size into its block of all: a ring of size
// rounds that together gather every block.
func (c *Comm) exchangeOne(mine, all *gpuctx.Buffer, p, blk int) error {
	to, from := (c.rank+p)%c.size, (c.rank-p+c.size)%c.size
	sc, rc := make([]int, c.size), make([]int, c.size)
	sc[to] = blk
	rc[from] = blk
	view, err := all.Slice(from*blk, blk)
	if err != nil {
		return err
	}
	// recv counts index the view's packed layout: one block from `from`.
	return c.exchange(mine, sc, view, rc, c.own)
}

// Close destroys the communicator (ncclCommDestroy) after waiting for its own
// stream. Double Close is harmless.
func (c *Comm) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	err := c.own.Synchronize()
	err = errors.Join(err, c.dev.OnThread(func() error {
		return c.lib.check("ncclCommDestroy", c.lib.s.ncclCommDestroy(c.comm))
	}))
	return errors.Join(err, c.own.Close())
}

var _ collective.Comm = (*Comm)(nil)

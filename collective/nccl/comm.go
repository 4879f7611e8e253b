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
// (ncclCommInitRank). It fails with an error wrapping gpuctx.ErrInvalid for
// bad arguments and gpuctx.ErrUnavailable on a device without vendor streams.
func NewComm(lib *Lib, dev *gpuctx.Device, id UniqueID, size, rank int) (*Comm, error) {
	const op = "nccl: NewComm"
	if lib == nil || dev == nil {
		return nil, fmt.Errorf("%s: nil library or device: %w", op, gpuctx.ErrInvalid)
	}
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("%s: rank %d of %d: %w", op, rank, size, gpuctx.ErrInvalid)
	}
	own, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	c := &Comm{lib: lib, dev: dev, rank: rank, size: size, own: own}
	err = own.WithNative(nil, func(n gpuctx.Native) error {
		if n.Stream == 0 {
			return fmt.Errorf("NCCL needs a CUDA device, not a %s one: %w", dev.Backend(), gpuctx.ErrUnavailable)
		}
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
// (the rank's own block included). It returns once the calls are queued. The
// calls run inside stream.WithNative: stream stays open and send and recv stay
// allocated until they are queued (a concurrent Stream.Close waits, a
// Buffer.Free fails). stream and the buffers must belong to the Comm's device.
func (c *Comm) AllToAllV(send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int, stream *gpuctx.Stream) error {
	const op = "AllToAllV"
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return c.errClosed(op)
	}
	if stream == nil {
		return fmt.Errorf("nccl: Comm.AllToAllV: nil stream: %w", gpuctx.ErrInvalid)
	}
	if stream.Device() != c.dev {
		return fmt.Errorf("nccl: Comm.AllToAllV: the stream belongs to another device than the communicator: %w", gpuctx.ErrWrongDevice)
	}
	if err := collective.CheckCounts("Comm.AllToAllV", c.size, send, sendCounts, recv, recvCounts); err != nil {
		return err
	}
	if err := c.exchange(send, sendCounts, recv, recvCounts, stream); err != nil {
		return fmt.Errorf("nccl: Comm.AllToAllV: %w", err)
	}
	return nil
}

// exchange queues the send/recv group on stream with stream, send and recv
// leased; c.mu is held.
func (c *Comm) exchange(send *gpuctx.Buffer, sendCounts []int, recv *gpuctx.Buffer, recvCounts []int, stream *gpuctx.Stream) error {
	sd, _ := collective.Displacements(sendCounts)
	rd, _ := collective.Displacements(recvCounts)
	l := c.lib
	return stream.WithNative([]*gpuctx.Buffer{send, recv}, func(nat gpuctx.Native) error {
		sp, rp, h := uintptr(nat.Ptrs[0]), uintptr(nat.Ptrs[1]), nat.Stream
		if err := l.check("ncclGroupStart", l.s.ncclGroupStart()); err != nil {
			return err
		}
		var first error
		for p := range c.size {
			if n := sendCounts[p]; n > 0 && first == nil {
				first = l.check("ncclSend", l.s.ncclSend(sp+uintptr(sd[p]), uintptr(n), ncclUint8, int32(p), c.comm, h))
			}
			if n := recvCounts[p]; n > 0 && first == nil {
				first = l.check("ncclRecv", l.s.ncclRecv(rp+uintptr(rd[p]), uintptr(n), ncclUint8, int32(p), c.comm, h))
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
	if err = errors.Join(err, c.own.Close()); err != nil {
		return fmt.Errorf("nccl: Comm.Close: rank %d: %w", c.rank, err)
	}
	return nil
}

var _ collective.Comm = (*Comm)(nil)

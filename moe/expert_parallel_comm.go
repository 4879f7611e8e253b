package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
)

// NewExpertParallelComms is NewExpertParallel over communicators the caller
// made, one per device (rank r on devs[r] with comms[r], comms[r].Rank() ==
// r): an NCCL communicator (collective/nccl) instead of the in-process group,
// say. The ExpertParallel owns the comms: its Close closes them, and so does
// an error here.
func NewExpertParallelComms(devs []*gpuctx.Device, comms []collective.Comm, cfg *Config, w *Weights, dtype gpuctx.DType) (*ExpertParallel, error) {
	const op = "moe: NewExpertParallelComms"
	closeFrom := func(r int) {
		for _, c := range comms[r:] {
			if c != nil {
				_ = c.Close()
			}
		}
	}
	if len(devs) == 0 || len(comms) != len(devs) {
		closeFrom(0)
		return nil, fmt.Errorf("%s: %d devices and %d communicators: want one each, at least one: %w", op, len(devs), len(comms), gpuctx.ErrInvalid)
	}
	p := &ExpertParallel{dt: dtype}
	for r, d := range devs {
		if comms[r] == nil || comms[r].Rank() != r || comms[r].Size() != len(devs) {
			_ = p.Close()
			closeFrom(r)
			return nil, fmt.Errorf("%s: communicator %d is not rank %d of %d: %w", op, r, r, len(devs), gpuctx.ErrInvalid)
		}
		s, err := NewExpertShard(d, comms[r], cfg, w, dtype)
		if err != nil {
			_ = p.Close()
			closeFrom(r)
			return nil, fmt.Errorf("%s: rank %d: %w", op, r, err)
		}
		p.shards = append(p.shards, s)
	}
	p.cfg = *cfg
	return p, nil
}

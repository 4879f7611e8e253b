package nccl

import (
	"errors"
	"fmt"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestErrorIs: an NCCL failure matches ErrNCCL and the gpuctx sentinel its
// ncclResult_t means, also when wrapped, and no other.
func TestErrorIs(t *testing.T) {
	sentinels := []error{gpuctx.ErrClosed, gpuctx.ErrFreed, gpuctx.ErrWrongDevice, gpuctx.ErrSize, gpuctx.ErrInvalid,
		gpuctx.ErrHandleExpired, gpuctx.ErrUnavailable, gpuctx.ErrNoKernel, gpuctx.ErrOutOfMemory, gpuctx.ErrDeviceLost}
	for _, tc := range []struct {
		name string
		code int
		is   []error
	}{
		{"unhandled CUDA error", 1, nil},
		{"system error", 2, nil},
		{"internal error", 3, nil},
		{"invalid argument", 4, []error{gpuctx.ErrInvalid}},
		{"invalid usage", 5, []error{gpuctx.ErrInvalid}},
		{"remote error", 6, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &Error{Op: "ncclSend", Code: tc.code, Msg: tc.name}
			for _, err := range []error{e, fmt.Errorf("nccl: Comm.AllToAllV: %w", e)} {
				if !errors.Is(err, ErrNCCL) {
					t.Errorf("errors.Is(%v, ErrNCCL) = false", err)
				}
				for _, s := range sentinels {
					want := false
					for _, w := range tc.is {
						want = want || w == s
					}
					if got := errors.Is(err, s); got != want {
						t.Errorf("errors.Is(%v, %v) = %v, want %v", err, s, got, want)
					}
				}
			}
		})
	}
}

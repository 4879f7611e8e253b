// Package bench measures gpuctx: timing on the device with events (warm-up,
// then the median of timed runs), the two ceilings measured in the same run
// (device-to-device copy bandwidth and a large GEMM through a Context), the
// floor model of an MoE layer, the MoE layer bench (modes, rotated weight
// sets, output checks) and its peer (bench/peers/triton_fused_moe.py, run as
// a child process, alternated with gpuctx over rounds), and the GEMM bench.
// Package cmd/gpuctx holds the flags and the printing; moe never imports
// bench.
package bench

// Error is a failure with the advice to print after it (the CLI prints it as
// "what: cause: fix").
type Error struct {
	What, Fix string
	Err       error
}

func (e *Error) Error() string {
	s := e.What
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	if e.Fix != "" {
		s += ": " + e.Fix
	}
	return s
}

func (e *Error) Unwrap() error { return e.Err }

// Fail returns an *Error.
func Fail(what, fix string, err error) error { return &Error{What: what, Fix: fix, Err: err} }

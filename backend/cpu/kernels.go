package cpu

import (
	"fmt"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/kernels"
)

// Kernels are the Go bodies registered with package kernels, under the same
// names and with the same parameters as their CUDA C sources; this backend
// holds none of its own. A package adds kernels with kernels.Register from an
// init function (package kernels holds the basic ones, package moe the
// Mixture-of-Experts ones).
//
// Launch checks the argument count and types against the kernel's parameter
// kinds before queueing, so a body may type-assert its arguments. Bodies run
// on the stream's goroutine, compute the whole result (grid and block are only
// validated) and return errors (bad pointers, bad sizes) that become the
// stream's sticky error.

// kernelSpec is a registered kernel: its parameter kinds and its body.
type kernelSpec struct {
	params []kernels.ArgKind
	body   func(d *device, args []any) error
}

func (ks kernelSpec) check(name string, args []any) error {
	if len(args) != len(ks.params) {
		return fmt.Errorf("cpu: Launch %s: got %d arguments, the kernel takes %d (%v)", name, len(args), len(ks.params), ks.params)
	}
	for i, a := range args {
		if !ks.params[i].Matches(a) {
			return fmt.Errorf("cpu: Launch %s: argument %d is %T, the kernel wants %v", name, i, a, ks.params[i])
		}
	}
	return nil
}

// memory is a device's memory as kernels.Memory, for kernel bodies.
type memory struct{ d *device }

// Bytes returns the n bytes at p if they lie inside one live allocation of
// the device and p is a multiple of align.
func (m memory) Bytes(what string, p hal.Ptr, n, align int) ([]byte, error) {
	return m.d.mem(what, p, n, align)
}

type kernel struct {
	dev  *device
	name string
	spec kernelSpec
}

// Name returns the kernel's name.
func (k *kernel) Name() string { return k.name }

// Kernel returns the registered kernel name, or an error wrapping
// hal.ErrNoKernel. Safe for concurrent use.
func (d *device) Kernel(name string) (hal.Kernel, error) {
	d.mu.RLock()
	closed := d.closed
	d.mu.RUnlock()
	if closed {
		return nil, d.errClosed("Kernel")
	}
	k, _, ok := kernels.Lookup(name)
	if !ok {
		return nil, fmt.Errorf("cpu: Kernel(%q): %w; known kernels: %v", name, hal.ErrNoKernel, kernels.Names())
	}
	body := k.CPU
	return &kernel{dev: d, name: name, spec: kernelSpec{
		params: k.Params,
		body:   func(d *device, args []any) error { return body(memory{d}, args) },
	}}, nil
}

// deviceSlice views n elements of type T at p, checking that they lie inside
// one live allocation and that p is aligned for T; what names the argument in
// errors.
func deviceSlice[T any](d *device, what string, p hal.Ptr, n int64) ([]T, error) {
	return kernels.Slice[T](memory{d}, what, p, n)
}

var (
	_ hal.Kernel     = (*kernel)(nil)
	_ kernels.Memory = memory{}
)

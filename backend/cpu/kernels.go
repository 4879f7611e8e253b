package cpu

import (
	"fmt"
	"sort"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Kernels are Go functions registered by name, with the same names and
// parameters as the CUDA C sources in kernels/*.cu. Another file of this
// package adds kernels with registerKernel in an init function:
//
//	func init() {
//		registerKernel("gpuctx_scale_f32", []argKind{argPtr, argF32, argI64},
//			func(d *device, a []any) error {
//				y, err := deviceSlice[float32](d, "y", a[0].(hal.Ptr), a[2].(int64))
//				...
//			})
//	}
//
// Launch checks the argument count and types against the kind list before
// queueing, so a body may type-assert its arguments. Bodies run on the stream's
// goroutine, compute the whole result (grid and block are only validated) and
// return errors (bad pointers, bad sizes) that become the stream's sticky error.

// argKind is the Go type of one launch argument.
type argKind int

const (
	argPtr argKind = iota // hal.Ptr
	argI32                // int32
	argU32                // uint32
	argI64                // int64
	argU64                // uint64
	argF32                // float32
	argF64                // float64
)

func (k argKind) String() string {
	return [...]string{"hal.Ptr", "int32", "uint32", "int64", "uint64", "float32", "float64"}[k]
}

func (k argKind) matches(v any) bool {
	switch v.(type) {
	case hal.Ptr:
		return k == argPtr
	case int32:
		return k == argI32
	case uint32:
		return k == argU32
	case int64:
		return k == argI64
	case uint64:
		return k == argU64
	case float32:
		return k == argF32
	case float64:
		return k == argF64
	}
	return false
}

// kernelSpec is a registered kernel: its parameter kinds and its body.
type kernelSpec struct {
	params []argKind
	body   func(d *device, args []any) error
}

func (ks kernelSpec) check(name string, args []any) error {
	if len(args) != len(ks.params) {
		return fmt.Errorf("cpu: Launch %s: got %d arguments, the kernel takes %d (%v)", name, len(args), len(ks.params), ks.params)
	}
	for i, a := range args {
		if !ks.params[i].matches(a) {
			return fmt.Errorf("cpu: Launch %s: argument %d is %T, the kernel wants %v", name, i, a, ks.params[i])
		}
	}
	return nil
}

var kernelRegistry = map[string]kernelSpec{}

// registerKernel adds a kernel; call it from init functions only (the registry
// is read without locks afterwards). Registering a name twice panics, which
// is a programming error caught by any test.
func registerKernel(name string, params []argKind, body func(d *device, args []any) error) {
	if _, dup := kernelRegistry[name]; dup {
		panic("cpu: kernel " + name + " registered twice")
	}
	kernelRegistry[name] = kernelSpec{params: params, body: body}
}

// kernelNames lists the registered kernels, sorted.
func kernelNames() []string {
	names := make([]string, 0, len(kernelRegistry))
	for n := range kernelRegistry {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
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
	spec, ok := kernelRegistry[name]
	if !ok {
		return nil, fmt.Errorf("cpu: Kernel(%q): %w; known kernels: %v", name, hal.ErrNoKernel, kernelNames())
	}
	return &kernel{dev: d, name: name, spec: spec}, nil
}

// deviceSlice views n elements of type T at p, checking that they lie inside
// one live allocation and that p is aligned for T; what names the argument in
// errors.
func deviceSlice[T any](d *device, what string, p hal.Ptr, n int64) ([]T, error) {
	var zero T
	size := int64(unsafe.Sizeof(zero))
	if n < 0 || n > (1<<62)/size {
		return nil, fmt.Errorf("%s: bad element count %d", what, n)
	}
	b, err := d.mem(what, p, int(n*size), int(unsafe.Alignof(zero)))
	if err != nil || n == 0 {
		return nil, err
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), n), nil
}

func init() {
	registerKernel("gpuctx_empty", nil, func(*device, []any) error { return nil })

	// gpuctx_fill_f32(float* y, float v, int64 n): y[i] = v.
	registerKernel("gpuctx_fill_f32", []argKind{argPtr, argF32, argI64}, func(d *device, a []any) error {
		y, err := deviceSlice[float32](d, "y", a[0].(hal.Ptr), a[2].(int64))
		if err != nil {
			return err
		}
		v := a[1].(float32)
		for i := range y {
			y[i] = v
		}
		return nil
	})

	// gpuctx_axpby_f32(float* y, const float* x, float a, float b, int64 n):
	// y[i] = a*x[i] + b*y[i].
	registerKernel("gpuctx_axpby_f32", []argKind{argPtr, argPtr, argF32, argF32, argI64}, func(d *device, a []any) error {
		n := a[4].(int64)
		y, err := deviceSlice[float32](d, "y", a[0].(hal.Ptr), n)
		if err != nil {
			return err
		}
		x, err := deviceSlice[float32](d, "x", a[1].(hal.Ptr), n)
		if err != nil {
			return err
		}
		alpha, beta := a[2].(float32), a[3].(float32)
		for i := range y {
			y[i] = alpha*x[i] + beta*y[i]
		}
		return nil
	})

	// gpuctx_add_i32(int32* y, int32 v, int64 n): y[i] += v.
	registerKernel("gpuctx_add_i32", []argKind{argPtr, argI32, argI64}, func(d *device, a []any) error {
		y, err := deviceSlice[int32](d, "y", a[0].(hal.Ptr), a[2].(int64))
		if err != nil {
			return err
		}
		v := a[1].(int32)
		for i := range y {
			y[i] += v
		}
		return nil
	})
}

var _ hal.Kernel = (*kernel)(nil)

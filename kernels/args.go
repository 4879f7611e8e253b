package kernels

import (
	"fmt"
	"reflect"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Ptr is a device address as a kernel parameter (a C pointer): hal.Ptr under a
// name that packages above the backend seam can use.
type Ptr = hal.Ptr

// ArgKind is the Go type of one kernel parameter, as Launch must pass it.
type ArgKind int

// The parameter kinds and the C types they stand for.
const (
	ArgPtr ArgKind = iota // Ptr: any pointer
	ArgI32                // int32: int
	ArgU32                // uint32: unsigned int
	ArgI64                // int64: long long
	ArgU64                // uint64: unsigned long long
	ArgF32                // float32: float
	ArgF64                // float64: double
)

var argTypes = [...]reflect.Type{
	ArgPtr: reflect.TypeFor[Ptr](),
	ArgI32: reflect.TypeFor[int32](),
	ArgU32: reflect.TypeFor[uint32](),
	ArgI64: reflect.TypeFor[int64](),
	ArgU64: reflect.TypeFor[uint64](),
	ArgF32: reflect.TypeFor[float32](),
	ArgF64: reflect.TypeFor[float64](),
}

// String returns the Go type name, e.g. "int32" ("hal.Ptr" for ArgPtr).
func (k ArgKind) String() string {
	if k < 0 || int(k) >= len(argTypes) {
		return fmt.Sprintf("ArgKind(%d)", int(k))
	}
	return argTypes[k].String()
}

// Matches reports whether v has exactly the Go type of k.
func (k ArgKind) Matches(v any) bool {
	return k >= 0 && int(k) < len(argTypes) && reflect.TypeOf(v) == argTypes[k]
}

// kindOf returns the kind whose Go type is t.
func kindOf(t reflect.Type) (ArgKind, bool) {
	for k, at := range argTypes {
		if t == at {
			return ArgKind(k), true
		}
	}
	return 0, false
}

// Memory is device memory as a kernel's Go body sees it. The CPU backend
// implements it (its device memory is host memory); a body reads and writes
// the slices it returns directly.
type Memory interface {
	// Bytes returns the n bytes at p after checking that they lie inside one
	// live allocation and that p is a multiple of align; what names the
	// argument in the error.
	Bytes(what string, p Ptr, n, align int) ([]byte, error)
}

// Slice views n elements of type T at p through m, checking that they lie
// inside one live allocation and that p is aligned for T; what names the
// argument in errors. n == 0 gives a nil slice.
func Slice[T any](m Memory, what string, p Ptr, n int64) ([]T, error) {
	var zero T
	size := int64(unsafe.Sizeof(zero))
	if n < 0 || n > (1<<62)/size {
		return nil, fmt.Errorf("%s: bad element count %d", what, n)
	}
	b, err := m.Bytes(what, p, int(n*size), int(unsafe.Alignof(zero)))
	if err != nil || n == 0 {
		return nil, err
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), n), nil
}

// Twin returns kernel name with typed arguments: its parameters are the leaf
// fields of the struct A in declaration order (see Leaves: a field of struct
// type stands for its own fields, so that related parameters can be grouped),
// each of type Ptr, int32, uint32, int64, uint64, float32 or float64, and
// exported, and its Go body receives them as an *A, so that it reads named
// fields instead of asserting positional arguments. The launch argument list
// of a kernel is Args of an A. Twin panics if A is not such a struct: a
// programming error any test catches.
func Twin[A any](name string, body func(m Memory, a *A) error) Kernel {
	t := reflect.TypeFor[A]()
	params := paramsOf(name, t)
	paths := leafPaths(t)
	return Kernel{
		Name:   name,
		Params: params,
		CPU: func(m Memory, args []any) error {
			if len(args) != len(params) {
				return fmt.Errorf("%d arguments for %d parameters", len(args), len(params))
			}
			a := new(A)
			v := reflect.ValueOf(a).Elem()
			for i, x := range args {
				v.FieldByIndex(paths[i]).Set(reflect.ValueOf(x))
			}
			return body(m, a)
		},
	}
}

// paramsOf returns the parameter kinds of the struct t's leaf fields.
func paramsOf(name string, t reflect.Type) []ArgKind {
	if t.Kind() != reflect.Struct {
		panic(fmt.Sprintf("kernels: Twin %s: argument type %v is not a struct", name, t))
	}
	leaves := Leaves(t)
	params := make([]ArgKind, len(leaves))
	for i, f := range leaves {
		k, ok := kindOf(f.Type)
		if !ok || !f.IsExported() {
			panic(fmt.Sprintf("kernels: Twin %s: field %s of %v has type %v or is unexported; want an exported field of a kernel argument type", name, f.Name, t, f.Type))
		}
		params[i] = k
	}
	return params
}

// KindOf returns the parameter kind whose Go type is t, and false if t is no
// kernel argument type.
func KindOf(t reflect.Type) (ArgKind, bool) { return kindOf(t) }

// Leaves returns the leaf fields of the struct type t in declaration order:
// every field, except that an exported field whose type is a struct (embedded
// or named) is replaced by the leaves of that struct, depth first. Each field's Index
// is its full index path in t (for reflect.Value.FieldByIndex). Leaves panics
// if t is not a struct type.
func Leaves(t reflect.Type) []reflect.StructField {
	var out []reflect.StructField
	var walk func(t reflect.Type, path []int)
	walk = func(t reflect.Type, path []int) {
		for i := range t.NumField() {
			f := t.Field(i)
			p := append(append([]int(nil), path...), i)
			if f.Type.Kind() == reflect.Struct && f.IsExported() {
				walk(f.Type, p)
				continue
			}
			f.Index = p
			out = append(out, f)
		}
	}
	walk(t, nil)
	return out
}

// leafPaths returns the index paths of Leaves(t), cached per type.
func leafPaths(t reflect.Type) [][]int {
	if p, ok := pathCache.Load(t); ok {
		return p.([][]int)
	}
	leaves := Leaves(t)
	paths := make([][]int, len(leaves))
	for i, f := range leaves {
		paths[i] = f.Index
	}
	p, _ := pathCache.LoadOrStore(t, paths)
	return p.([][]int)
}

var pathCache sync.Map // reflect.Type -> [][]int

// Args returns the leaf fields of the kernel argument struct a (or *a) in
// order (see Leaves): the argument list to pass to Launch for the kernel
// registered with Twin on a's type. It panics if a's fields are not of kernel
// argument types.
func Args(a any) []any {
	v := reflect.Indirect(reflect.ValueOf(a))
	paramsOf("Args", v.Type())
	return flatten(v)
}

// Flatten returns the leaf fields of the struct a (or *a) in order, as Args,
// without checking their types: for an argument struct whose pointer fields
// have a type of a package above this one (gpuctx.Buffer), whose launch
// converts them. It panics if a is not a struct or a pointer to one.
func Flatten(a any) []any {
	v := reflect.Indirect(reflect.ValueOf(a))
	if v.Kind() != reflect.Struct {
		panic(fmt.Sprintf("kernels: Flatten: %T is not a struct", a))
	}
	return flatten(v)
}

func flatten(v reflect.Value) []any {
	paths := leafPaths(v.Type())
	out := make([]any, len(paths))
	for i, p := range paths {
		out[i] = v.FieldByIndex(p).Interface()
	}
	return out
}

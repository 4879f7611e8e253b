package kernels

import _ "embed"

// basicSource is basic.cu: the launch-overhead probe, fill, axpby and
// integer add (the table in the package doc).
//
//go:embed basic.cu
var basicSource string

// fillArgs are the parameters of gpuctx_fill_f32.
type fillArgs struct {
	Y Ptr
	V float32
	N int64
}

// axpbyArgs are the parameters of gpuctx_axpby_f32.
type axpbyArgs struct {
	Y, X Ptr
	A, B float32
	N    int64
}

// addArgs are the parameters of gpuctx_add_i32.
type addArgs struct {
	Y Ptr
	V int32
	N int64
}

func init() {
	Register(Source{File: "basic.cu", Text: basicSource, Kernels: []Kernel{
		Twin("gpuctx_empty", func(Memory, *struct{}) error { return nil }),
		// y[i] = v.
		Twin("gpuctx_fill_f32", func(m Memory, a *fillArgs) error {
			y, err := Slice[float32](m, "y", a.Y, a.N)
			if err != nil {
				return err
			}
			for i := range y {
				y[i] = a.V
			}
			return nil
		}),
		// y[i] = a*x[i] + b*y[i].
		Twin("gpuctx_axpby_f32", func(m Memory, a *axpbyArgs) error {
			y, err := Slice[float32](m, "y", a.Y, a.N)
			if err != nil {
				return err
			}
			x, err := Slice[float32](m, "x", a.X, a.N)
			if err != nil {
				return err
			}
			for i := range y {
				y[i] = a.A*x[i] + a.B*y[i]
			}
			return nil
		}),
		// y[i] += v.
		Twin("gpuctx_add_i32", func(m Memory, a *addArgs) error {
			y, err := Slice[int32](m, "y", a.Y, a.N)
			if err != nil {
				return err
			}
			for i := range y {
				y[i] += a.V
			}
			return nil
		}),
	}})
}

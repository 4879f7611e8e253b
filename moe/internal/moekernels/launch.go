package moekernels

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
)

// LaunchArgs is the set of launch argument types, one per kernel (Up and Down
// for every GEMM tile of MoEGemms, FP8Up and FP8Down for every tile of
// FP8Gemms, FP8Quant, W8A8Up and W8A8Down for moe_w8a8.cu).
type LaunchArgs interface {
	Route | Plan | Gather | Swiglu | Combine | ExpertUp | ExpertDown | Align | AlignCount |
		AlignScan | AlignScatter | RouteAlign | CombineRows | Up | Down | FP8Up | FP8Down |
		FP8Quant | W8A8Up | W8A8Down
	args() []any // the leaf fields in order (kernels.Flatten)
}

// Launcher queues one MoE kernel of one device with its typed arguments A,
// so that a caller names every argument instead of listing them in order:
//
//	route, err := moekernels.NewLauncher[moekernels.Route](dev)
//	...
//	err = route.LaunchEarly(s, grid, block, 0, moekernels.Route{
//		Logits: logits, Bias: bias, TopkIdx: idx, TopkW: w, T: T, E: E, K: K,
//		Rule: rule, Ks: K, Ns: 0})
//
// NewLauncher, NewUp and NewDown return one, LoadKernels all but the GEMM
// tiles'; the zero Launcher refuses to launch. A Launcher holds no state but
// the kernel: it may be copied and used from any goroutine, as
// gpuctx.Stream.Launch may.
type Launcher[A LaunchArgs] struct {
	k     *gpuctx.Kernel
	early bool // WaitsFirst(k.Name())
}

// NewLauncher looks up, on d, the kernel whose arguments are A (compiling it
// on first use on CUDA): gpuctx_moe_route for Route, gpuctx_moe_plan for
// Plan, and so on. A GEMM tile's kernels depend on the tile: use NewUp and
// NewDown.
func NewLauncher[A LaunchArgs](d *gpuctx.Device) (Launcher[A], error) {
	name := kernelOf[A]()
	if name == "" {
		return Launcher[A]{}, fmt.Errorf("moekernels: NewLauncher: Up and Down belong to a GEMM tile: use NewUp or NewDown: %w", gpuctx.ErrInvalid)
	}
	return newLauncher[A](d, name)
}

// NewUp looks up, on d, the up kernel of tile c (MoEGemm.UpName). A down-only
// tile (HasUp false) has none: an error wrapping gpuctx.ErrInvalid.
func NewUp(d *gpuctx.Device, c MoEGemm) (Launcher[Up], error) {
	if !c.HasUp() {
		return Launcher[Up]{}, fmt.Errorf("moekernels: NewUp: tile %s is down-only: %w", c.Tag(), gpuctx.ErrInvalid)
	}
	return newLauncher[Up](d, c.UpName())
}

// NewDown looks up, on d, the down kernel of tile c (MoEGemm.DownName).
func NewDown(d *gpuctx.Device, c MoEGemm) (Launcher[Down], error) {
	return newLauncher[Down](d, c.DownName())
}

func newLauncher[A LaunchArgs](d *gpuctx.Device, name string) (Launcher[A], error) {
	if d == nil {
		return Launcher[A]{}, fmt.Errorf("moekernels: NewLauncher: %s: nil device: %w", name, gpuctx.ErrInvalid)
	}
	k, err := d.Kernel(name)
	if err != nil {
		return Launcher[A]{}, err
	}
	return Launcher[A]{k: k, early: WaitsFirst(name)}, nil
}

// Kernels holds a launcher for every MoE kernel but the GEMM tiles' (NewUp,
// NewDown).
type Kernels struct {
	Route        Launcher[Route]
	Plan         Launcher[Plan]
	Gather       Launcher[Gather]
	Swiglu       Launcher[Swiglu]
	Combine      Launcher[Combine]
	ExpertUp     Launcher[ExpertUp]
	ExpertDown   Launcher[ExpertDown]
	Align        Launcher[Align]
	AlignCount   Launcher[AlignCount]
	AlignScan    Launcher[AlignScan]
	AlignScatter Launcher[AlignScatter]
	RouteAlign   Launcher[RouteAlign]
	CombineRows  Launcher[CombineRows]
}

// LoadKernels looks up every kernel of Kernels on d (compiling moe.cu on
// first use on CUDA). It returns the first lookup's error.
func LoadKernels(d *gpuctx.Device) (*Kernels, error) {
	var ks Kernels
	for _, load := range []func() error{
		loadInto(&ks.Route, d), loadInto(&ks.Plan, d), loadInto(&ks.Gather, d), loadInto(&ks.Swiglu, d),
		loadInto(&ks.Combine, d), loadInto(&ks.ExpertUp, d), loadInto(&ks.ExpertDown, d), loadInto(&ks.Align, d),
		loadInto(&ks.AlignCount, d), loadInto(&ks.AlignScan, d), loadInto(&ks.AlignScatter, d),
		loadInto(&ks.RouteAlign, d), loadInto(&ks.CombineRows, d),
	} {
		if err := load(); err != nil {
			return nil, err
		}
	}
	return &ks, nil
}

func loadInto[A LaunchArgs](dst *Launcher[A], d *gpuctx.Device) func() error {
	return func() (err error) {
		*dst, err = NewLauncher[A](d)
		return err
	}
}

// kernelOf returns the kernel whose arguments are A, or "" for a GEMM tile's.
func kernelOf[A LaunchArgs]() string {
	switch any(*new(A)).(type) {
	case Route:
		return "gpuctx_moe_route"
	case Plan:
		return "gpuctx_moe_plan"
	case Gather:
		return "gpuctx_moe_gather"
	case Swiglu:
		return "gpuctx_moe_swiglu"
	case Combine:
		return "gpuctx_moe_combine"
	case ExpertUp:
		return "gpuctx_moe_expert_up"
	case ExpertDown:
		return "gpuctx_moe_expert_down"
	case Align:
		return "gpuctx_moe_align"
	case AlignCount:
		return "gpuctx_moe_align_count"
	case AlignScan:
		return "gpuctx_moe_align_scan"
	case AlignScatter:
		return "gpuctx_moe_align_scatter"
	case RouteAlign:
		return "gpuctx_moe_route_align"
	case CombineRows:
		return "gpuctx_moe_combine_rows"
	case FP8Quant:
		return FP8QuantName
	}
	return ""
}

// Kernel returns the kernel l launches (nil for the zero Launcher).
func (l Launcher[A]) Kernel() *gpuctx.Kernel { return l.k }

// Launch queues the kernel on s with gpuctx.Stream.Launch: grid and block,
// smem bytes of dynamic shared memory, and a's fields as the arguments in
// order. It returns Stream.Launch's error (a buffer of another device, a
// closed stream, ...); the host does not wait.
func (l Launcher[A]) Launch(s *gpuctx.Stream, grid, block gpuctx.Dim3, smem int, a A) error {
	if l.k == nil {
		return l.zero("Launch")
	}
	return s.Launch(l.k, grid, block, smem, a.args()...)
}

// LaunchEarly is Launch through gpuctx.Stream.LaunchEarly when the kernel
// waits for the kernels ahead of it before it touches memory (WaitsFirst), so
// that it may be scheduled before they end; otherwise it is Launch.
func (l Launcher[A]) LaunchEarly(s *gpuctx.Stream, grid, block gpuctx.Dim3, smem int, a A) error {
	if l.k == nil {
		return l.zero("LaunchEarly")
	}
	if l.early {
		return s.LaunchEarly(l.k, grid, block, smem, a.args()...)
	}
	return s.Launch(l.k, grid, block, smem, a.args()...)
}

func (l Launcher[A]) zero(op string) error {
	name := kernelOf[A]()
	if name == "" {
		name = "a GEMM tile"
	}
	return fmt.Errorf("moekernels: Launcher.%s: the zero Launcher of %s: %w", op, name, gpuctx.ErrInvalid)
}

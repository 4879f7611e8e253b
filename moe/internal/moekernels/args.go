package moekernels

import "github.com/gpuctx/gpuctx"

// The argument structs of the MoE kernels, one per kernel (a generic struct
// per parameter list shared by the GEMM tiles): their leaf fields are the
// kernel's parameters in order (kernels.Leaves: the RouteRule field stands for
// its eight fields). Each is instantiated twice: with Ptr pointers for the Go
// twins (kernels.Twin), and with *gpuctx.Buffer pointers for launches through
// a Launcher, the exported names Route, Plan, ... below. The parameters'
// meaning is in the package documentation and MoEGemm's. Each struct's args
// method lists its leaf fields in order without reflection (a launch is on
// the forward's hot path; kernels.Flatten takes 40 times as long):
// TestLaunchArgsList checks it against kernels.Flatten.

// Pointer is the type of the pointer fields of an argument struct: Ptr in the
// Go twins, *gpuctx.Buffer in a launch (the stream checks that the buffer is
// on its device and passes its address).
type Pointer interface{ Ptr | *gpuctx.Buffer }

// RouteRule is how gpuctx_moe_route and gpuctx_moe_route_align score and
// choose a token's experts: Scoring 0 softmax, 1 sigmoid; Method 0 greedy, 1
// group_limited_greedy (group score: the max), 2 noaux_tc (the sum of the top
// 2), keeping TopkGroups of Groups groups; HasBias adds the bias to the
// choice; Norm divides the weights by their sum plus NormEps; Scale
// multiplies them.
type RouteRule struct {
	Scoring, Method, Groups, TopkGroups, HasBias, Norm int32
	NormEps, Scale                                     float32
}

// The values of RouteRule.Scoring and RouteRule.Method.
const (
	ScoreSoftmax    int32 = 0 // softmax over the experts
	ScoreSigmoid    int32 = 1 // a sigmoid per expert
	MethodGreedy    int32 = 0 // the top K
	MethodGroupMax  int32 = 1 // group_limited_greedy: groups scored by their max
	MethodGroupTop2 int32 = 2 // noaux_tc: groups scored by the sum of their top 2
)

// RouteArgs are the parameters of gpuctx_moe_route.
type RouteArgs[P Pointer] struct {
	Logits, Bias, TopkIdx, TopkW P
	T, E, K                      int32
	Rule                         RouteRule
	Ks, Ns                       int32
}

func (a RouteArgs[P]) args() []any {
	return []any{a.Logits, a.Bias, a.TopkIdx, a.TopkW, a.T, a.E, a.K, a.Rule.Scoring, a.Rule.Method,
		a.Rule.Groups, a.Rule.TopkGroups, a.Rule.HasBias, a.Rule.Norm, a.Rule.NormEps, a.Rule.Scale, a.Ks, a.Ns}
}

// PlanArgs are the parameters of gpuctx_moe_plan.
type PlanArgs[P Pointer] struct {
	TopkIdx, Counts, Offsets, Pos P
	TK, E                         int32
}

func (a PlanArgs[P]) args() []any {
	return []any{a.TopkIdx, a.Counts, a.Offsets, a.Pos, a.TK, a.E}
}

// GatherArgs are the parameters of gpuctx_moe_gather.
type GatherArgs[P Pointer] struct {
	X, Pos, Xp          P
	TK, K, H, ElemBytes int32
}

func (a GatherArgs[P]) args() []any {
	return []any{a.X, a.Pos, a.Xp, a.TK, a.K, a.H, a.ElemBytes}
}

// SwigluArgs are the parameters of gpuctx_moe_swiglu.
type SwigluArgs[P Pointer] struct {
	H, Act        P
	Rows, I, BF16 int32
}

func (a SwigluArgs[P]) args() []any {
	return []any{a.H, a.Act, a.Rows, a.I, a.BF16}
}

// CombineArgs are the parameters of gpuctx_moe_combine.
type CombineArgs[P Pointer] struct {
	Out, Pos, W, Shared, Gate, Y                 P
	T, K, H, HasRouted, HasShared, HasGate, BF16 int32
}

func (a CombineArgs[P]) args() []any {
	return []any{a.Out, a.Pos, a.W, a.Shared, a.Gate, a.Y, a.T, a.K, a.H, a.HasRouted, a.HasShared, a.HasGate,
		a.BF16}
}

// ExpertUpArgs are the parameters of gpuctx_moe_expert_up.
type ExpertUpArgs[P Pointer] struct {
	Xp, Gu, Counts, Offsets, Act P
	E, H, I, BF16                int32
}

func (a ExpertUpArgs[P]) args() []any {
	return []any{a.Xp, a.Gu, a.Counts, a.Offsets, a.Act, a.E, a.H, a.I, a.BF16}
}

// ExpertDownArgs are the parameters of gpuctx_moe_expert_down.
type ExpertDownArgs[P Pointer] struct {
	Act, Down, Counts, Offsets, Out P
	E, H, I, BF16                   int32
}

func (a ExpertDownArgs[P]) args() []any {
	return []any{a.Act, a.Down, a.Counts, a.Offsets, a.Out, a.E, a.H, a.I, a.BF16}
}

// AlignArgs are the parameters of gpuctx_moe_align.
type AlignArgs[P Pointer] struct {
	TopkIdx, Sorted, BlockExpert, Npost P
	TK, E, BM, Cap, First               int32
}

func (a AlignArgs[P]) args() []any {
	return []any{a.TopkIdx, a.Sorted, a.BlockExpert, a.Npost, a.TK, a.E, a.BM, a.Cap, a.First}
}

// AlignCountArgs are the parameters of gpuctx_moe_align_count.
type AlignCountArgs[P Pointer] struct {
	TopkIdx, Bcnt P
	TK, E         int32
}

func (a AlignCountArgs[P]) args() []any {
	return []any{a.TopkIdx, a.Bcnt, a.TK, a.E}
}

// AlignScanArgs are the parameters of gpuctx_moe_align_scan.
type AlignScanArgs[P Pointer] struct {
	Bcnt, Boff, Sorted, BlockExpert, Npost P
	TK, E, BM, Cap, NB, First              int32
}

func (a AlignScanArgs[P]) args() []any {
	return []any{a.Bcnt, a.Boff, a.Sorted, a.BlockExpert, a.Npost, a.TK, a.E, a.BM, a.Cap, a.NB, a.First}
}

// AlignScatterArgs are the parameters of gpuctx_moe_align_scatter.
type AlignScatterArgs[P Pointer] struct {
	TopkIdx, Boff, Npost, Sorted P
	TK, E                        int32
}

func (a AlignScatterArgs[P]) args() []any {
	return []any{a.TopkIdx, a.Boff, a.Npost, a.Sorted, a.TK, a.E}
}

// RouteAlignArgs are the parameters of gpuctx_moe_route_align.
type RouteAlignArgs[P Pointer] struct {
	X, Router, Bias, Logits, TopkIdx, TopkW, Sorted, BlockExpert, Npost, Ticket P
	T, H, E, K                                                                  int32
	Rule                                                                        RouteRule
	Ks, Ns, BM, Cap                                                             int32
	// Xq and Xs receive x's E4M3 codes and scales where QuantX is not 0.
	Xq, Xs P
	QuantX int32
}

func (a RouteAlignArgs[P]) args() []any {
	return []any{a.X, a.Router, a.Bias, a.Logits, a.TopkIdx, a.TopkW, a.Sorted, a.BlockExpert, a.Npost,
		a.Ticket, a.T, a.H, a.E, a.K, a.Rule.Scoring, a.Rule.Method, a.Rule.Groups, a.Rule.TopkGroups,
		a.Rule.HasBias, a.Rule.Norm, a.Rule.NormEps, a.Rule.Scale, a.Ks, a.Ns, a.BM, a.Cap, a.Xq, a.Xs, a.QuantX}
}

// CombineRowsArgs are the parameters of gpuctx_moe_combine_rows.
type CombineRowsArgs[P Pointer] struct {
	Out, W, Shared, Gate, Y                      P
	T, K, H, HasRouted, HasShared, HasGate, BF16 int32
}

func (a CombineRowsArgs[P]) args() []any {
	return []any{a.Out, a.W, a.Shared, a.Gate, a.Y, a.T, a.K, a.H, a.HasRouted, a.HasShared, a.HasGate, a.BF16}
}

// UpArgs are the parameters of every gpuctx_moe_up_<tag> (MoEGemm.UpName).
type UpArgs[P Pointer] struct {
	X, Gu, Sorted, BlockExpert, Npost, Act P
	TK, K, H, I, E0, Ns                    int32
}

func (a UpArgs[P]) args() []any {
	return []any{a.X, a.Gu, a.Sorted, a.BlockExpert, a.Npost, a.Act, a.TK, a.K, a.H, a.I, a.E0, a.Ns}
}

// DownArgs are the parameters of every gpuctx_moe_down_<tag>
// (MoEGemm.DownName).
type DownArgs[P Pointer] struct {
	Act, Down, Sorted, BlockExpert, Npost, Out P
	TK, H, I                                   int32
}

func (a DownArgs[P]) args() []any {
	return []any{a.Act, a.Down, a.Sorted, a.BlockExpert, a.Npost, a.Out, a.TK, a.H, a.I}
}

// The launch arguments (Launcher) of each kernel.
type (
	Route        = RouteArgs[*gpuctx.Buffer]
	Plan         = PlanArgs[*gpuctx.Buffer]
	Gather       = GatherArgs[*gpuctx.Buffer]
	Swiglu       = SwigluArgs[*gpuctx.Buffer]
	Combine      = CombineArgs[*gpuctx.Buffer]
	ExpertUp     = ExpertUpArgs[*gpuctx.Buffer]
	ExpertDown   = ExpertDownArgs[*gpuctx.Buffer]
	Align        = AlignArgs[*gpuctx.Buffer]
	AlignCount   = AlignCountArgs[*gpuctx.Buffer]
	AlignScan    = AlignScanArgs[*gpuctx.Buffer]
	AlignScatter = AlignScatterArgs[*gpuctx.Buffer]
	RouteAlign   = RouteAlignArgs[*gpuctx.Buffer]
	CombineRows  = CombineRowsArgs[*gpuctx.Buffer]
	Up           = UpArgs[*gpuctx.Buffer]
	Down         = DownArgs[*gpuctx.Buffer]
)

// The arguments the Go twins receive.
type (
	routeArgs        = RouteArgs[Ptr]
	planArgs         = PlanArgs[Ptr]
	gatherArgs       = GatherArgs[Ptr]
	swigluArgs       = SwigluArgs[Ptr]
	combineArgs      = CombineArgs[Ptr]
	expertUpArgs     = ExpertUpArgs[Ptr]
	expertDownArgs   = ExpertDownArgs[Ptr]
	alignArgs        = AlignArgs[Ptr]
	alignCountArgs   = AlignCountArgs[Ptr]
	alignScanArgs    = AlignScanArgs[Ptr]
	alignScatterArgs = AlignScatterArgs[Ptr]
	routeAlignArgs   = RouteAlignArgs[Ptr]
	combineRowsArgs  = CombineRowsArgs[Ptr]
	upArgs           = UpArgs[Ptr]
	downArgs         = DownArgs[Ptr]
)

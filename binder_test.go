package gpuctx

import (
	"sync"
	"testing"

	"github.com/gpuctx/gpuctx/backend/cpu"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// This file tests the cuBLAS side of the binding rule (hal.StreamBinder)
// against a fake cuBLAS handle: the CPU backend's handle wrapped so that
// SetStream drops the workspace, as cublasSetStream_v2 does ("cublasSetStream
// ... resets the user workspace to the default workspace pool", cuBLAS docs,
// cublasSetWorkspace). A GEMM that runs with no user workspace counts as a
// violation: on a GPU it would run on cuBLAS's default pool, shared by every
// stream. The rocBLAS side is tested in backend/rocm against fake HIP and
// rocBLAS tables.

// cublasLike wraps a CPU BLAS handle with cuBLAS's SetStream semantics.
type cublasLike struct {
	hal.BlasHandle
	mu         sync.Mutex
	ws         hal.Ptr
	violations *int
}

func (h *cublasLike) SetStreamKeepsWorkspace() bool { return false }
func (h *cublasLike) NeedsOldStreamIdle() bool      { return false }

func (h *cublasLike) SetStream(s hal.Stream) error {
	h.mu.Lock()
	h.ws = 0 // cublasSetStream_v2 resets the workspace
	h.mu.Unlock()
	return h.BlasHandle.SetStream(s)
}

func (h *cublasLike) SetWorkspace(p hal.Ptr, n int) error {
	h.mu.Lock()
	h.ws = p
	h.mu.Unlock()
	return h.BlasHandle.SetWorkspace(p, n)
}

func (h *cublasLike) use() {
	h.mu.Lock()
	if h.ws == 0 {
		*h.violations++
	}
	h.mu.Unlock()
}

func (h *cublasLike) Gemm(d hal.GemmDesc) error { h.use(); return h.BlasHandle.Gemm(d) }
func (h *cublasLike) GemmStridedBatched(d hal.GemmDesc, b hal.StridedBatch) error {
	h.use()
	return h.BlasHandle.GemmStridedBatched(d, b)
}
func (h *cublasLike) GemmGrouped(ds []hal.GemmDesc) error {
	h.use()
	return h.BlasHandle.GemmGrouped(ds)
}
func (h *cublasLike) Geam(d hal.GeamDesc) error { h.use(); return h.BlasHandle.Geam(d) }

// cublasDevice is a CPU device whose BLAS handles behave as cuBLAS's.
type cublasDevice struct {
	hal.Device
	violations int
}

func (d *cublasDevice) NewBlasHandle() (hal.BlasHandle, error) {
	h, err := d.Device.NewBlasHandle()
	if err != nil {
		return nil, err
	}
	return &cublasLike{BlasHandle: h, violations: &d.violations}, nil
}

func TestBindRuleCublasReappliesWorkspace(t *testing.T) {
	be, err := cpu.Open()
	if err != nil {
		t.Fatal(err)
	}
	hd, err := be.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	fd := &cublasDevice{Device: hd}
	rt := &Runtime{be: be, devices: map[int]*Device{}}
	d := newDevice(rt, fd)
	rt.devices[0] = d
	t.Cleanup(func() { _ = rt.Close() })

	const n = 8
	a, _ := d.Alloc(4 * n * n)
	b, _ := d.Alloc(4 * n * n)
	cA, _ := d.Alloc(4 * n * n) // one output per stream: the streams run at once
	cB, _ := d.Alloc(4 * n * n)
	sA, _ := d.NewStream(StreamOptions{})
	sB, _ := d.NewStream(StreamOptions{})
	// With per-stream workspaces every rebind changes the workspace anyway;
	// with one workspace per handle (UnsafeSharedWorkspace) only the rule
	// re-applies it, so that case catches a bind that trusts SetStream.
	for _, tc := range []struct {
		pol      HandlePolicy
		sharedWS bool
	}{{SharedHandle, false}, {PooledHandles, false}, {SharedHandle, true}} {
		pol := tc.pol
		name := pol.String()
		if tc.sharedWS {
			name += "/handle-workspace"
		}
		t.Run(name, func(t *testing.T) {
			fd.violations = 0
			ctx, err := d.NewContext(ContextOptions{Stream: sA, Policy: pol, UnsafeSharedWorkspace: tc.sharedWS})
			if err != nil {
				t.Fatal(err)
			}
			defer ctx.Close()
			if pol == PooledHandles {
				if err := d.SetBlasHandleLimit(1); err != nil { // one handle: every switch rebinds it
					t.Fatal(err)
				}
			}
			for i := range 20 {
				s, c := sA, cA
				if i%2 == 1 {
					s, c = sB, cB
				}
				if _, err := ctx.SetStream(s); err != nil {
					t.Fatal(err)
				}
				err := ctx.Blas(func(h Blas) error {
					return h.Gemm(Gemm{M: n, N: n, K: n, Alpha: 1, A: a, B: b, C: c, AB: F32, CType: F32})
				})
				if err != nil {
					t.Fatalf("gemm %d: %v", i, err)
				}
			}
			if err := d.Synchronize(); err != nil {
				t.Fatal(err)
			}
			if tc.sharedWS {
				for _, s := range []*Stream{sA, sB} {
					if err := s.Synchronize(); err != nil {
						t.Fatal(err)
					}
				}
			}
			if fd.violations != 0 {
				t.Errorf("%d GEMMs ran on cuBLAS's default workspace: the workspace was not re-applied after a rebind", fd.violations)
			}
			if st := ctx.Stats(); st.Rebinds == 0 || st.WorkspaceApplies < st.Binds {
				t.Errorf("stats %+v: want rebinds, and a workspace apply after every bind", st)
			}
		})
	}
}

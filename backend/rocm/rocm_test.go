package rocm_test

import (
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/backend/rocm"
	"github.com/gpuctx/gpuctx/conformance"
)

func openFake(t *testing.T) (*rocm.Fake, *gpuctx.Device) {
	t.Helper()
	fk, undo := rocm.InstallFake()
	t.Cleanup(undo)
	rt, err := gpuctx.OpenBackend("rocm")
	if err != nil {
		t.Fatalf("OpenBackend(rocm) on the fake tables: %v", err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	return fk, d
}

// TestConformanceFake runs the backend-neutral suite on the ROCm backend over
// fake HIP, hipRTC and rocBLAS tables.
func TestConformanceFake(t *testing.T) {
	fk, d := openFake(t)
	conformance.Run(t, d)
	if !fk.HeaderSeen() {
		t.Error("hipRTC never compiled a source starting with the HIP vendor header")
	}
	if v, c := fk.Violations(), fk.Conflicts(); v != 0 || c != 0 {
		t.Errorf("rocBLAS model: %d handle moves before the old stream finished, %d workspace conflicts", v, c)
	}
	for _, n := range rocm.PortNotes() {
		t.Log("kernel port:", n)
	}
}

// TestBindRuleRocblas switches one Context between two streams while the old
// stream is held back, so that its GEMM is still pending when the handle
// moves: the binding rule must order the new stream after it (rocBLAS keeps a
// user-owned workspace across rocblas_set_stream).
func TestBindRuleRocblas(t *testing.T) {
	fk, d := openFake(t)
	const n = 16
	a, _ := d.Alloc(4 * n * n)
	b, _ := d.Alloc(4 * n * n)
	c, _ := d.Alloc(4 * n * n)
	c2, _ := d.Alloc(4 * n * n)
	sA, _ := d.NewStream(gpuctx.StreamOptions{})
	sB, _ := d.NewStream(gpuctx.StreamOptions{})
	for _, tc := range []struct {
		name string
		o    gpuctx.ContextOptions
	}{
		{"shared-handle", gpuctx.ContextOptions{Policy: gpuctx.SharedHandle}},
		{"handle-workspace", gpuctx.ContextOptions{Policy: gpuctx.SharedHandle, UnsafeSharedWorkspace: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v0, c0 := fk.Violations(), fk.Conflicts()
			tc.o.Stream = sA
			ctx, err := d.NewContext(tc.o)
			if err != nil {
				t.Fatal(err)
			}
			defer ctx.Close()
			gemm := func(out *gpuctx.Buffer) error {
				return ctx.Blas(func(h gpuctx.Blas) error {
					return h.Gemm(gpuctx.Gemm{M: n, N: n, K: n, Alpha: 1, A: a, B: b, C: out, AB: gpuctx.F32, CType: gpuctx.F32})
				})
			}
			for i := range 6 {
				from, to := sA, sB
				if i%2 == 1 {
					from, to = sB, sA
				}
				if _, err := ctx.SetStream(from); err != nil {
					t.Fatal(err)
				}
				raw := fk.Stream(0) // sA, the first stream made on the fake
				if from == sB {
					raw = fk.Stream(1)
				}
				release := fk.Gate(raw)
				if err := gemm(c); err != nil { // queued behind the gate
					t.Fatal(err)
				}
				if _, err := ctx.SetStream(to); err != nil {
					t.Fatal(err)
				}
				if err := gemm(c2); err != nil { // moves the handle while from's GEMM is pending
					t.Fatal(err)
				}
				release()
				for _, s := range []*gpuctx.Stream{sA, sB} {
					if err := s.Synchronize(); err != nil {
						t.Fatal(err)
					}
				}
			}
			if v, c := fk.Violations()-v0, fk.Conflicts()-c0; v != 0 || c != 0 {
				t.Errorf("%d rocBLAS handle moves before the old stream's work finished, %d workspace conflicts", v, c)
			}
			if st := ctx.Stats(); st.Rebinds < 5 {
				t.Errorf("stats %+v: want a rebind per switch", st)
			}
		})
	}
}

// TestOpenDiagnosis: without ROCm, a forced rocm backend explains itself.
func TestOpenDiagnosis(t *testing.T) {
	_, err := rocm.Open()
	if err == nil {
		t.Skip("ROCm is installed here")
	}
	if !errors.Is(err, gpuctx.ErrUnavailable) {
		t.Errorf("Open error %v does not wrap ErrUnavailable", err)
	}
	t.Log(err)
}

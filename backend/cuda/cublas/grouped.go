package cublas

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// group is a run of consecutive descs ds[first:first+count] that share every
// scalar argument of cublasGemmGroupedBatchedEx (one group of that call).
type group struct{ first, count int }

// sameGroup reports whether a and b can be in one group: equal transposes,
// shapes, leading dimensions and scalars.
func sameGroup(a, b hal.GemmDesc) bool {
	return a.TransA == b.TransA && a.TransB == b.TransB &&
		a.M == b.M && a.N == b.N && a.K == b.K &&
		a.LDA == b.LDA && a.LDB == b.LDB && a.LDC == b.LDC &&
		a.Alpha == b.Alpha && a.Beta == b.Beta
}

// groupDescs splits ds into runs of consecutive equal-shape descs. Only
// consecutive descs are merged so that the pointer arrays keep the caller's
// order.
func groupDescs(ds []hal.GemmDesc) []group {
	var gs []group
	for i, d := range ds {
		if n := len(gs); n > 0 && sameGroup(ds[gs[n-1].first], d) {
			gs[n-1].count++
			continue
		}
		gs = append(gs, group{first: i, count: 1})
	}
	return gs
}

// groupedArgs holds the host arrays of one cublasGemmGroupedBatchedEx call.
type groupedArgs struct {
	transa, transb, m, n, k, lda, ldb, ldc, size []int32
	alpha, beta                                  []scalar // one per group, of the compute scale type
	// ptrs is A pointers, then B pointers, then C pointers, len(ds) each,
	// in desc order; it is copied to the device.
	ptrs []uintptr
}

// marshalGrouped builds the host arrays for ds split into gs.
func marshalGrouped(ds []hal.GemmDesc, gs []group, k scaleKind) (groupedArgs, error) {
	const call = "cublasGemmGroupedBatchedEx"
	var a groupedArgs
	ng := len(gs)
	for _, p := range []*[]int32{&a.transa, &a.transb, &a.m, &a.n, &a.k, &a.lda, &a.ldb, &a.ldc, &a.size} {
		*p = make([]int32, ng)
	}
	a.alpha = make([]scalar, ng)
	a.beta = make([]scalar, ng)
	for i, g := range gs {
		d := ds[g.first]
		g32, err := convertGemm(call, d, false)
		if err != nil {
			return a, fmt.Errorf("desc %d: %w", g.first, err)
		}
		a.transa[i], a.transb[i] = g32.ta, g32.tb
		a.m[i], a.n[i], a.k[i] = g32.m, g32.n, g32.k
		a.lda[i], a.ldb[i], a.ldc[i] = g32.lda, g32.ldb, g32.ldc
		if a.size[i], err = i32(call, "group size", g.count); err != nil {
			return a, err
		}
		a.alpha[i].set(k, complex(d.Alpha, 0))
		a.beta[i].set(k, complex(d.Beta, 0))
	}
	n := len(ds)
	a.ptrs = make([]uintptr, 3*n)
	for i, d := range ds {
		a.ptrs[i], a.ptrs[n+i], a.ptrs[2*n+i] = uintptr(d.A), uintptr(d.B), uintptr(d.C)
	}
	return a, nil
}

// packScalars lays out per-group scalars as the C array the call reads:
// float[] for scaleF32, double[] for scaleF64.
func packScalars(s []scalar, k scaleKind) unsafe.Pointer {
	switch k {
	case scaleF32:
		out := make([]float32, len(s))
		for i := range s {
			out[i] = *(*float32)(s[i].ptr())
		}
		return unsafe.Pointer(&out[0])
	default:
		out := make([]float64, len(s))
		for i := range s {
			out[i] = *(*float64)(s[i].ptr())
		}
		return unsafe.Pointer(&out[0])
	}
}

// groupedSupported reports whether cublasGemmGroupedBatchedEx supports inputs
// ab with output c: per its documentation, C of the same type as A/B for f32,
// f64, f16 and bf16.
func groupedSupported(ab, c hal.DType) bool {
	switch ab {
	case hal.F32, hal.F64, hal.F16, hal.BF16:
		return c == ab
	}
	return false
}

// GemmGrouped queues len(ds) independent GEMMs on the bound stream and returns
// without waiting for them. With the native path (GroupedNative) consecutive
// descs of equal shape form one group of one cublasGemmGroupedBatchedEx call;
// its device pointer arrays are staged through a per-handle ring of pinned and
// device buffers (cuMemcpyHtoDAsync_v2 on the bound stream), and the call may
// block the host only when the ring slot it reuses is still in flight.
// Otherwise it queues one cublasGemmEx per desc, in order. All descs must share
// AB and CType.
func (h *handle) GemmGrouped(ds []hal.GemmDesc) error {
	if err := h.lock("GemmGrouped"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	if len(ds) == 0 {
		return nil
	}
	for i, d := range ds[1:] {
		if d.AB != ds[0].AB || d.CType != ds[0].CType {
			return fmt.Errorf("cublas: GemmGrouped: desc %d has types %v/%v but desc 0 has %v/%v; all descs must share AB and CType", i+1, d.AB, d.CType, ds[0].AB, ds[0].CType)
		}
	}
	if !h.native || !groupedSupported(ds[0].AB, ds[0].CType) {
		return h.gemmLoop(ds)
	}
	return h.gemmGroupedNative(ds)
}

// gemmLoop runs each desc with cublasGemmEx in one runner call.
func (h *handle) gemmLoop(ds []hal.GemmDesc) error {
	args := make([]gemmArgs, len(ds))
	for i, d := range ds {
		g, err := convertGemm("cublasGemmEx", d, h.tf32)
		if err != nil {
			return fmt.Errorf("GemmGrouped desc %d: %w", i, err)
		}
		args[i] = g
	}
	return h.r.Do(func() error {
		for i, d := range ds {
			if err := h.st.b.statusError("cublasGemmEx", h.gemmEx(d, args[i])); err != nil {
				return fmt.Errorf("GemmGrouped desc %d: %w", i, err)
			}
		}
		return nil
	})
}

// gemmGroupedNative issues one cublasGemmGroupedBatchedEx for ds.
func (h *handle) gemmGroupedNative(ds []hal.GemmDesc) error {
	const call = "cublasGemmGroupedBatchedEx"
	t, err := gemmTypesFor(ds[0].AB, ds[0].CType, h.tf32)
	if err != nil {
		return fmt.Errorf("%s: %w", call, err)
	}
	gs := groupDescs(ds)
	a, err := marshalGrouped(ds, gs, t.scale)
	if err != nil {
		return err
	}
	ng, err := i32(call, "group count", len(gs))
	if err != nil {
		return err
	}
	alpha, beta := packScalars(a.alpha, t.scale), packScalars(a.beta, t.scale)
	n := uintptr(len(ds))
	const ptrSize = unsafe.Sizeof(uintptr(0))
	return h.r.Do(func() error {
		slot, err := h.scr.stage(&h.st.d, a.ptrs, h.stream)
		if err != nil {
			return err
		}
		dev := h.scr.devAddr(slot)
		st := h.st.b.gemmGroupedBatchedEx(h.h, &a.transa[0], &a.transb[0], &a.m[0], &a.n[0], &a.k[0],
			alpha, dev, t.ab, &a.lda[0],
			dev+n*ptrSize, t.ab, &a.ldb[0],
			beta, dev+2*n*ptrSize, t.c, &a.ldc[0],
			ng, &a.size[0], t.compute)
		// Record even on failure: the copy into the slot is queued either way.
		return errors.Join(h.st.b.statusError(call, st), h.scr.release(&h.st.d, slot, h.stream))
	})
}

// scratchSlots is the number of pointer-array buffers in a handle's ring: up
// to this many native grouped GEMMs can be in flight before one waits.
const scratchSlots = 4

// scratch is a ring of staging slots for the device pointer arrays of native
// grouped GEMMs. Slot i is host[i*slotBytes:] (pinned) and dev+i*slotBytes;
// events[i] is recorded on the stream after the GEMM that reads the slot, and
// the slot is reused only after cuEventSynchronize(events[i]): then both the
// host-to-device copy from the pinned buffer and the GEMM reading the device
// buffer are done, whatever stream they ran on. All methods run inside the
// runner with the handle locked.
type scratch struct {
	slotBytes int
	host      unsafe.Pointer // cuMemAllocHost_v2, scratchSlots*slotBytes
	dev       uintptr        // cuMemAlloc_v2, scratchSlots*slotBytes
	events    [scratchSlots]uintptr
	pending   [scratchSlots]bool
	next      int
}

// devAddr is the device address of slot i.
func (s *scratch) devAddr(i int) uintptr { return s.dev + uintptr(i*s.slotBytes) }

// stage waits until the next slot is free, grows the buffers if ptrs does not
// fit, writes ptrs to the slot's pinned memory and queues its copy to the
// slot's device memory on stream. It returns the slot, which the caller must
// hand to release after queueing the GEMM.
func (s *scratch) stage(d *drvAPI, ptrs []uintptr, stream uintptr) (int, error) {
	need := len(ptrs) * int(unsafe.Sizeof(uintptr(0)))
	if need > s.slotBytes {
		if err := s.grow(d, need); err != nil {
			return 0, err
		}
	}
	i := s.next
	s.next = (s.next + 1) % scratchSlots
	if s.pending[i] {
		if err := d.driverError("cuEventSynchronize", d.eventSync(s.events[i])); err != nil {
			return 0, err
		}
		s.pending[i] = false
	}
	host := unsafe.Add(s.host, i*s.slotBytes)
	copy(unsafe.Slice((*uintptr)(host), len(ptrs)), ptrs)
	if err := d.driverError("cuMemcpyHtoDAsync_v2", d.memcpyHtoDAsyn(s.devAddr(i), host, uint64(need), stream)); err != nil {
		return 0, err
	}
	return i, nil
}

// release records slot i's event on stream after the work that uses it.
func (s *scratch) release(d *drvAPI, i int, stream uintptr) error {
	if err := d.driverError("cuEventRecord", d.eventRecord(s.events[i], stream)); err != nil {
		// Without the event the slot could be reused while still in flight:
		// wait for the stream instead.
		return errors.Join(err, d.driverError("cuStreamSynchronize", d.streamSync(stream)))
	}
	s.pending[i] = true
	return nil
}

// waitAll waits for every slot in flight.
func (s *scratch) waitAll(d *drvAPI) error {
	var errs []error
	for i := range s.pending {
		if s.pending[i] {
			errs = append(errs, d.driverError("cuEventSynchronize", d.eventSync(s.events[i])))
			s.pending[i] = false
		}
	}
	return errors.Join(errs...)
}

// grow replaces the buffers with ones of at least need bytes per slot, after
// the old ones are no longer in use, and creates the events on first use.
func (s *scratch) grow(d *drvAPI, need int) error {
	size := 4096
	for size < need {
		size *= 2
	}
	if err := s.freeBuffers(d); err != nil {
		return err
	}
	if s.events[0] == 0 {
		for i := range s.events {
			// CU_EVENT_DISABLE_TIMING (2): cheapest event, used only to wait.
			if err := d.driverError("cuEventCreate", d.eventCreate(&s.events[i], 2)); err != nil {
				return err
			}
		}
	}
	var host unsafe.Pointer
	if err := d.driverError("cuMemAllocHost_v2", d.memAllocHost(&host, uint64(size*scratchSlots))); err != nil {
		return err
	}
	var dev uintptr
	if err := d.driverError("cuMemAlloc_v2", d.memAlloc(&dev, uint64(size*scratchSlots))); err != nil {
		d.memFreeHost(host)
		return err
	}
	s.host, s.dev, s.slotBytes, s.next = host, dev, size, 0
	return nil
}

// freeBuffers waits for the slots in flight and frees the buffers (not the
// events).
func (s *scratch) freeBuffers(d *drvAPI) error {
	err := s.waitAll(d)
	if s.host != nil {
		err = errors.Join(err, d.driverError("cuMemFreeHost", d.memFreeHost(s.host)))
		s.host = nil
	}
	if s.dev != 0 {
		err = errors.Join(err, d.driverError("cuMemFree_v2", d.memFree(s.dev)))
		s.dev = 0
	}
	s.slotBytes = 0
	return err
}

// free waits for the slots in flight and releases buffers and events.
func (s *scratch) free(d *drvAPI) error {
	err := s.freeBuffers(d)
	for i := range s.events {
		if s.events[i] != 0 {
			err = errors.Join(err, d.driverError("cuEventDestroy_v2", d.eventDestroy(s.events[i])))
			s.events[i] = 0
		}
	}
	return err
}

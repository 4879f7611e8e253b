package gpuctx

import "github.com/gpuctx/gpuctx/internal/hal"

// WorkspaceCounts reports how many per-stream BLAS workspaces, cuBLASLt
// workspaces and retired (grown-out, not yet freed) cuBLASLt workspaces d holds.
func WorkspaceCounts(d *Device) (perStream, lt, retired int) {
	return d.blas.spaces.Counts()
}

// StreamWorkspace returns the address and size of s's eager BLAS workspace
// (0, 0: none yet).
func StreamWorkspace(s *Stream) (uintptr, int) {
	if w := s.dev.blas.spaces.Eager(s); w != nil {
		return uintptr(w.Ptr), w.Size
	}
	return 0, 0
}

// HandleBinding reports what the library handle lent as h holds: the ID of its
// bound stream (0: none) and its workspace. ok is false when the backend cannot
// tell (CUDA). Call it inside the callback.
func HandleBinding(h Blas) (streamID uint64, ws uintptr, n int, ok bool) {
	in, ok := h.sl.Handle.blas.(hal.BlasInspector)
	if !ok {
		return 0, 0, 0, false
	}
	if st := in.BoundStream(); st != nil {
		streamID = st.ID()
	}
	p, n := in.BoundWorkspace()
	return streamID, uintptr(p), n, true
}

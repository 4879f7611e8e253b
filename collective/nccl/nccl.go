//go:generate go run ../../internal/cmd/gensyms -spec nccl.spec -out nccl_syms.go -pkg nccl -type ncclSyms

// Package nccl implements collective.Comm with NVIDIA NCCL, loaded at run time
// (libnccl.so.2 through internal/dynload, no cgo): AllToAllV is a group of
// ncclSend/ncclRecv calls queued on the caller's CUDA stream, AllGather of
// counts the same on a stream of the Comm's own.
//
// Every rank needs the same 128-byte unique id, made by rank 0
// (Lib.UniqueID). ShareID passes it over TCP (rank 0 listens, the others
// connect; bounded in time), or set it in $GPUCTX_NCCL_ID (hex) on every rank
// and use IDFromEnv.
//
// NVLink multicast (NVLS) is turned off: Load sets NCCL_NVLS_ENABLE=0 in the
// process environment before NCCL can read it (the purego runtime forwards
// os.Setenv to the C environment).
//
// Every NCCL call that takes a stream or buffers runs inside
// gpuctx.Stream.WithNative: the stream cannot close and the buffers cannot be
// freed while the call queues its work.
//
// TestOneRankCUDA runs a one-rank communicator (send/recv and all-to-all)
// through the real libnccl where CUDA and NCCL are present, and skips
// elsewhere; the binding has not run on a multi-GPU machine yet.
package nccl

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/internal/dynload"
)

// ncclUniqueID is ncclUniqueId: a struct of 128 bytes, passed by value to
// ncclCommInitRank.
type ncclUniqueID struct{ Internal [128]byte }

// UniqueID is the id every rank of a communicator passes to NewComm.
type UniqueID [128]byte

// Spec is where Load looks for NCCL.
var Spec = dynload.Spec{
	Name:    "NCCL",
	Sonames: []string{"libnccl.so.2", "libnccl.so"},
	Pip:     []string{"nvidia/nccl/lib", "nvidia/*/lib"},
	Install: "NCCL 2 (the libnccl2 package, or pip install nvidia-nccl-cu13)",
}

// NVLSEnv is the variable Load sets to "0": NVLink SHARP / multicast stays
// off (it needs fabric-manager support that shared machines lack).
const NVLSEnv = "NCCL_NVLS_ENABLE"

// Lib is the loaded NCCL library and its function table. Safe for concurrent
// use.
type Lib struct {
	lib     *dynload.Library
	s       ncclSyms
	version int
}

var (
	loadMu   sync.Mutex
	loaded   *Lib
	loadErrs error
)

// Load sets NCCL_NVLS_ENABLE=0, then loads NCCL once per process (later calls
// return the same *Lib or the same error). A missing library is a
// *dynload.LoadError (errors.Is dynload.ErrNotFound) that lists every path
// tried; a library without the symbols of nccl.spec is a
// *dynload.MissingSymbolsError naming each missing one.
func Load() (*Lib, error) {
	loadMu.Lock()
	defer loadMu.Unlock()
	if loaded != nil || loadErrs != nil {
		return loaded, loadErrs
	}
	if err := os.Setenv(NVLSEnv, "0"); err != nil {
		return nil, fmt.Errorf("nccl: setting %s=0: %w", NVLSEnv, err)
	}
	loaded, loadErrs = load(Spec)
	return loaded, loadErrs
}

// load opens spec's library and binds the table; on any failure the library
// is closed again.
func load(spec dynload.Spec) (*Lib, error) {
	dl, err := dynload.Open(spec)
	if err != nil {
		return nil, fmt.Errorf("nccl: %w", err)
	}
	l := &Lib{lib: dl}
	if err := dl.Bind(l.s.symbols()); err != nil {
		_ = dl.Close()
		return nil, fmt.Errorf("nccl: %w", err)
	}
	var v int32
	if err := l.check("ncclGetVersion", l.s.ncclGetVersion(&v)); err != nil {
		_ = dl.Close()
		return nil, err
	}
	l.version = int(v)
	return l, nil
}

// Version returns NCCL's version code (e.g. 22703 for 2.27.3).
func (l *Lib) Version() int { return l.version }

// Path returns the file NCCL was loaded from.
func (l *Lib) Path() string { return l.lib.Path() }

// Error is a failed NCCL call.
type Error struct {
	Op   string // the NCCL function
	Code int    // its ncclResult_t
	Msg  string // ncclGetErrorString
}

func (e *Error) Error() string {
	return fmt.Sprintf("nccl: %s: %s (ncclResult_t %d)", e.Op, e.Msg, e.Code)
}

// ErrNCCL is wrapped by every *Error.
var ErrNCCL = errors.New("nccl call failed")

// Unwrap returns ErrNCCL.
func (e *Error) Unwrap() error { return ErrNCCL }

// Is maps the ncclResult_t to the gpuctx sentinel it means:
// ncclInvalidArgument (4) and ncclInvalidUsage (5) are gpuctx.ErrInvalid.
// Other failures (CUDA, system, internal, remote) match only ErrNCCL.
func (e *Error) Is(target error) bool {
	return target == gpuctx.ErrInvalid && (e.Code == 4 || e.Code == 5)
}

// check turns an ncclResult_t into an error.
func (l *Lib) check(op string, r int32) error {
	if r == 0 {
		return nil
	}
	msg := "unknown error"
	if l.s.ncclGetErrorString != nil {
		msg = l.s.ncclGetErrorString(r)
	}
	return &Error{Op: op, Code: int(r), Msg: msg}
}

// UniqueID makes a new communicator id (on rank 0; share it with the others).
func (l *Lib) UniqueID() (UniqueID, error) {
	var id ncclUniqueID
	if err := l.check("ncclGetUniqueId", l.s.ncclGetUniqueId(&id)); err != nil {
		return UniqueID{}, err
	}
	return UniqueID(id.Internal), nil
}

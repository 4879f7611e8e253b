package rocm

import (
	"math"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// This file is a test-only ROCm: Go functions in place of the purego-bound
// symbols of libamdhip64, libhiprtc and librocblas, executing on host memory,
// so that the backend's own code (argument packing, status mapping, the
// binding rule in the root package) runs in CI. What they model:
//
//   - HIP streams run asynchronously, in order, on one goroutine each;
//     hipEventRecord/hipStreamWaitEvent/hipEventSynchronize order them as HIP
//     documents (an event never recorded is complete); hipStreamQuery and
//     hipEventQuery return hipErrorNotReady (600) while work is pending.
//   - hipMemcpy{HtoD,DtoH,DtoD} are synchronous; the *Async forms are queued.
//   - hipRTC "compiles" by keeping the source (which must start with the
//     vendor header); hipModuleLaunchKernel runs Go twins of the basic
//     kernels with the arguments read back from the void** array.
//   - rocBLAS (docs: "Device Memory Allocation", "Handle, Stream, and Device
//     Management"; ROCm/rocBLAS issue #1253): rocblas_set_stream keeps the
//     workspace; with a user-owned workspace, moving the handle while work it
//     queued on the old stream is still pending is a violation, detected when
//     the handle's next call runs on the new stream before that work is done;
//     one workspace used by two streams at the same time is a conflict.
//     Operations use rocBLAS enum values (111/112, 151/152, ...) and
//     rocblas_gemm_ex's D = C.

type fakeTask struct {
	run  func()
	done chan struct{}
}

type fakeStream struct {
	q       chan *fakeTask
	mu      sync.Mutex
	pending []*fakeTask
}

func (s *fakeStream) enqueue(f func()) *fakeTask {
	t := &fakeTask{run: f, done: make(chan struct{})}
	s.mu.Lock()
	s.pending = append(s.pending, t)
	s.mu.Unlock()
	s.q <- t
	return t
}

func (s *fakeStream) loop() {
	for t := range s.q {
		t.run()
		s.mu.Lock() // off the pending list before done, so a query after a wait sees it finished
		s.pending = s.pending[1:]
		s.mu.Unlock()
		close(t.done)
	}
}

func (s *fakeStream) last() *fakeTask {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.pending) == 0 {
		return nil
	}
	return s.pending[len(s.pending)-1]
}

type fakeEvent struct {
	mu   sync.Mutex
	done chan struct{} // nil: never recorded
	at   time.Time
}

type fakeHandle struct {
	stream    uintptr
	ws        uintptr
	oldWork   []*fakeTask // the handle's work on the stream it left
	lastTasks map[uintptr]*fakeTask
}

// fakeROCm is the fake driver state.
type fakeROCm struct {
	mu      sync.Mutex
	next    uintptr
	mem     map[uintptr][]byte
	streams map[uintptr]*fakeStream
	events  map[uintptr]*fakeEvent
	handles map[uintptr]*fakeHandle
	progs   map[uintptr]string
	mods    map[uintptr]string
	funcs   map[uintptr]string

	created    []uintptr    // stream handles in creation order
	violations atomic.Int64 // handle moved while its old stream still ran its work
	conflicts  atomic.Int64 // one workspace used by two streams at once
	wsBusy     sync.Map     // workspace -> *atomic.Int64 (stream using it, 0: none)
	headerSeen atomic.Bool
}

func newFake() *fakeROCm {
	f := &fakeROCm{next: 1 << 20, mem: map[uintptr][]byte{}, streams: map[uintptr]*fakeStream{},
		events: map[uintptr]*fakeEvent{}, handles: map[uintptr]*fakeHandle{}, progs: map[uintptr]string{},
		mods: map[uintptr]string{}, funcs: map[uintptr]string{}}
	f.streams[0] = f.newStream()
	return f
}

func (f *fakeROCm) newStream() *fakeStream {
	s := &fakeStream{q: make(chan *fakeTask, 1<<16)}
	go s.loop()
	return s
}

func (f *fakeROCm) id() uintptr { f.next += 16; return f.next }

func (f *fakeROCm) stream(h uintptr) *fakeStream {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.streams[h]
}

// syncAll waits for every stream.
func (f *fakeROCm) syncAll() {
	f.mu.Lock()
	var ss []*fakeStream
	for _, s := range f.streams {
		ss = append(ss, s)
	}
	f.mu.Unlock()
	for _, s := range ss {
		if t := s.last(); t != nil {
			<-t.done
		}
	}
}

func bytesAt(p uintptr, n int) []byte { return unsafe.Slice((*byte)(ptr(p)), n) }

// gate blocks stream h until the returned func is called: "the old stream
// still runs".
func (f *fakeROCm) gate(h uintptr) func() {
	ch := make(chan struct{})
	f.stream(h).enqueue(func() { <-ch })
	return func() { close(ch) }
}

func (f *fakeROCm) hip() *hipAPI {
	a := &hipAPI{}
	ok := func() int32 { return hipSuccess }
	a.init = func(uint32) int32 { return ok() }
	a.driverGetVersion = func(v *int32) int32 { *v = 60241134; return 0 }
	a.runtimeGetVersion = func(v *int32) int32 { *v = 60241134; return 0 }
	a.getErrorName = func(e int32) string {
		return map[int32]string{1: "hipErrorInvalidValue", 2: "hipErrorOutOfMemory", 17: "hipErrorInvalidDevicePointer", 400: "hipErrorInvalidHandle", 600: "hipErrorNotReady"}[e]
	}
	a.getErrorString = a.getErrorName
	a.getDeviceCount = func(n *int32) int32 { *n = 1; return 0 }
	a.setDevice = func(d int32) int32 {
		if d != 0 {
			return hipErrorInvalidDevice
		}
		return 0
	}
	a.deviceGetName = func(name *byte, n int32, dev int32) int32 {
		copy(unsafe.Slice(name, n), "Fake AMD Instinct (host memory)\x00")
		return 0
	}
	a.deviceGetAttribute = func(v *int32, attr int32, dev int32) int32 {
		*v = map[int32]int32{attrL2CacheSize: 4 << 20, attrComputeMajor: 9, attrComputeMinor: 4, attrMultiprocessors: 8, attrWarpSize: 64}[attr]
		return 0
	}
	a.deviceTotalMem = func(b *uintptr, dev int32) int32 { *b = 1 << 30; return 0 }
	a.deviceSynchronize = func() int32 { f.syncAll(); return 0 }
	a.deviceGetStreamPriorityR = func(l, g *int32) int32 { *l, *g = 0, -1; return 0 }
	a.memGetInfo = func(fr, t *uintptr) int32 { *fr, *t = 1<<29, 1<<30; return 0 }
	a.malloc = func(p *uintptr, n uintptr) int32 {
		if n > 1<<30 {
			return hipErrorOutOfMemory
		}
		b := make([]byte, n+256)
		addr := (uintptr(unsafe.Pointer(&b[0])) + 255) &^ 255
		f.mu.Lock()
		f.mem[addr] = b
		f.mu.Unlock()
		*p = addr
		return 0
	}
	a.free = func(p uintptr) int32 {
		f.syncAll() // hipFree synchronises the device
		f.mu.Lock()
		defer f.mu.Unlock()
		if _, ok := f.mem[p]; !ok {
			return hipErrorInvalidDevicePointer
		}
		delete(f.mem, p)
		return 0
	}
	a.hostMalloc = func(p *unsafe.Pointer, n uintptr, _ uint32) int32 {
		var addr uintptr
		if r := a.malloc(&addr, n); r != 0 {
			return r
		}
		*p = ptr(addr)
		return 0
	}
	a.hostFree = func(p unsafe.Pointer) int32 { return a.free(uintptr(p)) }
	a.memcpyHtoD = func(dst uintptr, src unsafe.Pointer, n uintptr) int32 {
		f.syncAll()
		copy(bytesAt(dst, int(n)), unsafe.Slice((*byte)(src), n))
		return 0
	}
	a.memcpyDtoH = func(dst unsafe.Pointer, src uintptr, n uintptr) int32 {
		f.syncAll()
		copy(unsafe.Slice((*byte)(dst), n), bytesAt(src, int(n)))
		return 0
	}
	a.memcpyDtoD = func(dst, src uintptr, n uintptr) int32 {
		f.syncAll()
		copy(bytesAt(dst, int(n)), bytesAt(src, int(n)))
		return 0
	}
	async := func(s uintptr, fn func()) int32 {
		st := f.stream(s)
		if st == nil {
			return hipErrorInvalidHandle
		}
		st.enqueue(fn)
		return 0
	}
	a.memcpyHtoDAsync = func(dst uintptr, src unsafe.Pointer, n uintptr, s uintptr) int32 {
		return async(s, func() { copy(bytesAt(dst, int(n)), unsafe.Slice((*byte)(src), n)) })
	}
	a.memcpyDtoHAsync = func(dst unsafe.Pointer, src uintptr, n uintptr, s uintptr) int32 {
		return async(s, func() { copy(unsafe.Slice((*byte)(dst), n), bytesAt(src, int(n))) })
	}
	a.memcpyDtoDAsync = func(dst, src uintptr, n uintptr, s uintptr) int32 {
		return async(s, func() { copy(bytesAt(dst, int(n)), bytesAt(src, int(n))) })
	}
	a.memsetD8Async = func(dst uintptr, v uint8, n uintptr, s uintptr) int32 {
		return async(s, func() {
			b := bytesAt(dst, int(n))
			for i := range b {
				b[i] = v
			}
		})
	}
	a.streamCreateWithPriority = func(s *uintptr, _ uint32, _ int32) int32 {
		st := f.newStream()
		f.mu.Lock()
		h := f.id()
		f.streams[h] = st
		f.created = append(f.created, h)
		f.mu.Unlock()
		*s = h
		return 0
	}
	a.streamSynchronize = func(s uintptr) int32 {
		st := f.stream(s)
		if st == nil {
			return hipErrorInvalidHandle
		}
		if t := st.last(); t != nil {
			<-t.done
		}
		return 0
	}
	a.streamDestroy = func(s uintptr) int32 {
		if r := a.streamSynchronize(s); r != 0 {
			return r
		}
		f.mu.Lock()
		st := f.streams[s]
		delete(f.streams, s)
		f.mu.Unlock()
		close(st.q)
		return 0
	}
	a.streamQuery = func(s uintptr) int32 {
		st := f.stream(s)
		if st == nil {
			return hipErrorInvalidHandle
		}
		if st.last() != nil {
			return hipErrorNotReady
		}
		return 0
	}
	ev := func(e uintptr) *fakeEvent { f.mu.Lock(); defer f.mu.Unlock(); return f.events[e] }
	a.eventCreateWithFlags = func(e *uintptr, _ uint32) int32 {
		f.mu.Lock()
		h := f.id()
		f.events[h] = &fakeEvent{}
		f.mu.Unlock()
		*e = h
		return 0
	}
	a.eventRecord = func(e, s uintptr) int32 {
		x := ev(e)
		if x == nil {
			return hipErrorInvalidHandle
		}
		done := make(chan struct{})
		x.mu.Lock()
		x.done = done
		x.mu.Unlock()
		return async(s, func() {
			x.mu.Lock()
			x.at = time.Now()
			x.mu.Unlock()
			close(done)
		})
	}
	wait := func(x *fakeEvent) {
		x.mu.Lock()
		d := x.done
		x.mu.Unlock()
		if d != nil {
			<-d
		}
	}
	a.streamWaitEvent = func(s, e uintptr, _ uint32) int32 {
		x := ev(e)
		if x == nil {
			return hipErrorInvalidHandle
		}
		x.mu.Lock()
		d := x.done
		x.mu.Unlock()
		return async(s, func() {
			if d != nil {
				<-d
			}
		})
	}
	a.eventSynchronize = func(e uintptr) int32 {
		x := ev(e)
		if x == nil {
			return hipErrorInvalidHandle
		}
		wait(x)
		return 0
	}
	a.eventQuery = func(e uintptr) int32 {
		x := ev(e)
		if x == nil {
			return hipErrorInvalidHandle
		}
		x.mu.Lock()
		defer x.mu.Unlock()
		if x.done == nil {
			return 0
		}
		select {
		case <-x.done:
			return 0
		default:
			return hipErrorNotReady
		}
	}
	a.eventElapsedTime = func(ms *float32, start, end uintptr) int32 {
		s, e := ev(start), ev(end)
		if s == nil || e == nil {
			return hipErrorInvalidHandle
		}
		s.mu.Lock()
		t0 := s.at
		s.mu.Unlock()
		e.mu.Lock()
		t1 := e.at
		e.mu.Unlock()
		*ms = float32(t1.Sub(t0).Seconds() * 1e3)
		return 0
	}
	a.eventDestroy = func(e uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.events, e)
		return 0
	}
	a.moduleLoadData = func(m *uintptr, image unsafe.Pointer) int32 {
		src := cString(unsafe.Slice((*byte)(image), 1<<20)[:strings.IndexByte(unsafe.String((*byte)(image), 1<<20), 0)+1])
		f.mu.Lock()
		h := f.id()
		f.mods[h] = src
		f.mu.Unlock()
		*m = h
		return 0
	}
	a.moduleGetFunction = func(fn *uintptr, m uintptr, name *byte) int32 {
		n := cString(unsafe.Slice(name, 256))
		f.mu.Lock()
		defer f.mu.Unlock()
		if !regexp.MustCompile(`__global__ void ` + n + `\(`).MatchString(f.mods[m]) {
			return 500 // hipErrorNotFound
		}
		h := f.id()
		f.funcs[h] = n
		*fn = h
		return 0
	}
	a.moduleUnload = func(m uintptr) int32 { return 0 }
	a.moduleLaunchKernel = func(fn uintptr, gx, gy, gz, bx, by, bz uint32, shared uint32, s uintptr, params, extra unsafe.Pointer) int32 {
		f.mu.Lock()
		name := f.funcs[fn]
		f.mu.Unlock()
		arg := func(i int) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Add(params, i*8)) }
		switch name {
		case "gpuctx_empty":
			return async(s, func() {})
		case "gpuctx_fill_f32":
			y, v, n := *(*uintptr)(arg(0)), *(*float32)(arg(1)), *(*int64)(arg(2))
			return async(s, func() {
				ys := unsafe.Slice((*float32)(ptr(y)), n)
				for i := range ys {
					ys[i] = v
				}
			})
		case "gpuctx_axpby_f32":
			y, x, al, be, n := *(*uintptr)(arg(0)), *(*uintptr)(arg(1)), *(*float32)(arg(2)), *(*float32)(arg(3)), *(*int64)(arg(4))
			return async(s, func() {
				ys := unsafe.Slice((*float32)(ptr(y)), n)
				xs := unsafe.Slice((*float32)(ptr(x)), n)
				for i := range ys {
					ys[i] = al*xs[i] + be*ys[i]
				}
			})
		case "gpuctx_add_i32":
			y, v, n := *(*uintptr)(arg(0)), *(*int32)(arg(1)), *(*int64)(arg(2))
			return async(s, func() {
				ys := unsafe.Slice((*int32)(ptr(y)), n)
				for i := range ys {
					ys[i] += v
				}
			})
		}
		return hipErrorNotSupported
	}
	return a
}

func (f *fakeROCm) hiprtc() *hiprtcAPI {
	a := &hiprtcAPI{}
	a.version = func(maj, min *int32) int32 { *maj, *min = 6, 2; return 0 }
	a.getErrorString = func(r int32) string { return "HIPRTC_ERROR" }
	a.createProgram = func(p *uintptr, src, name *byte, _ int32, _, _ **byte) int32 {
		s := cString(unsafe.Slice(src, 1<<22))
		f.mu.Lock()
		h := f.id()
		f.progs[h] = s
		f.mu.Unlock()
		*p = h
		return 0
	}
	a.compileProgram = func(p uintptr, n int32, opts **byte) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		if strings.HasPrefix(f.progs[p], hipHeader) {
			f.headerSeen.Store(true)
		}
		return 0
	}
	a.getCodeSize = func(p uintptr, n *uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		*n = uintptr(len(f.progs[p]) + 1)
		return 0
	}
	a.getCode = func(p uintptr, code *byte) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		copy(unsafe.Slice(code, len(f.progs[p])+1), f.progs[p]+"\x00")
		return 0
	}
	a.getLogSize = func(p uintptr, n *uintptr) int32 { *n = 1; return 0 }
	a.getLog = func(p uintptr, l *byte) int32 { *l = 0; return 0 }
	a.destroyProgram = func(p *uintptr) int32 { return 0 }
	return a
}

// op queues a rocBLAS operation of handle hh on its stream, applying the
// documented stream and workspace model, and returns 0 or a status.
func (f *fakeROCm) op(hh uintptr, work func()) int32 {
	f.mu.Lock()
	h := f.handles[hh]
	if h == nil {
		f.mu.Unlock()
		return 1 // rocblas_status_invalid_handle
	}
	st := f.streams[h.stream]
	old := h.oldWork
	h.oldWork = nil
	ws, sid := h.ws, int64(h.stream)+1
	f.mu.Unlock()
	t := st.enqueue(func() {
		for _, o := range old {
			select {
			case <-o.done:
			default:
				f.violations.Add(1) // moved while its old stream still ran this handle's work
			}
		}
		if ws != 0 {
			v, _ := f.wsBusy.LoadOrStore(ws, new(atomic.Int64))
			busy := v.(*atomic.Int64)
			if !busy.CompareAndSwap(0, sid) {
				f.conflicts.Add(1)
			} else {
				defer busy.Store(0)
			}
		}
		work()
	})
	f.mu.Lock()
	h.lastTasks[h.stream] = t
	f.mu.Unlock()
	return 0
}

func (f *fakeROCm) rocblas() *rocblasAPI {
	a := &rocblasAPI{}
	a.createHandle = func(h *uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		id := f.id()
		f.handles[id] = &fakeHandle{lastTasks: map[uintptr]*fakeTask{}}
		*h = id
		return 0
	}
	a.destroyHandle = func(h uintptr) int32 { f.syncAll(); return 0 }
	a.setStream = func(hh, s uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		h := f.handles[hh]
		if h == nil || f.streams[s] == nil {
			return 1
		}
		if s != h.stream && h.ws != 0 {
			if t := h.lastTasks[h.stream]; t != nil {
				h.oldWork = append(h.oldWork, t) // the workspace stays: this work must be done first
			}
		}
		h.stream = s
		return 0
	}
	a.setWorkspace = func(hh, addr, size uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		h := f.handles[hh]
		if h == nil {
			return 1
		}
		h.ws = addr
		return 0
	}
	a.setPointerMode = func(h uintptr, m int32) int32 { return 0 }
	a.gemmEx = func(hh uintptr, ta, tb, m, n, k int32, alpha unsafe.Pointer, ap uintptr, at, lda int32,
		bp uintptr, bt, ldb int32, beta unsafe.Pointer, cp uintptr, ct, ldc int32, dp uintptr, dt, ldd int32,
		compute, algo, sol int32, flags uint32) int32 {
		return a.gemmStridedBatchedEx(hh, ta, tb, m, n, k, alpha, ap, at, lda, 0, bp, bt, ldb, 0, beta, cp, ct, ldc, 0, dp, dt, ldd, 0, 1, compute, algo, sol, flags)
	}
	a.gemmStridedBatchedEx = func(hh uintptr, ta, tb, m, n, k int32, alpha unsafe.Pointer, ap uintptr, at, lda int32, sa int64,
		bp uintptr, bt, ldb int32, sb int64, beta unsafe.Pointer, cp uintptr, ct, ldc int32, sc int64,
		dp uintptr, dt, ldd int32, sd int64, batch, compute, algo, sol int32, flags uint32) int32 {
		if at != bt || ct != dt || cp != dp || ldc != ldd || (at != rbF32R && at != rbF64R) || ct != at || compute != at {
			return 2 // rocblas_status_not_implemented (this fake: f32 and f64 only)
		}
		if m < 0 || n < 0 || k < 0 || batch < 0 || (ta != rbOpNone && ta != rbOpTranspose) || (tb != rbOpNone && tb != rbOpTranspose) {
			return 4 // rocblas_status_invalid_size
		}
		var al, be float64
		if at == rbF32R {
			al, be = float64(*(*float32)(alpha)), float64(*(*float32)(beta))
		} else {
			al, be = *(*float64)(alpha), *(*float64)(beta)
		}
		return f.op(hh, func() {
			es := 4
			if at == rbF64R {
				es = 8
			}
			get := func(p uintptr, i int64) float64 {
				q := ptr(p + uintptr(i)*uintptr(es))
				if es == 4 {
					return float64(*(*float32)(q))
				}
				return *(*float64)(q)
			}
			set := func(p uintptr, i int64, v float64) {
				q := ptr(p + uintptr(i)*uintptr(es))
				if es == 4 {
					*(*float32)(q) = float32(v)
				} else {
					*(*float64)(q) = v
				}
			}
			for bi := int64(0); bi < int64(batch); bi++ {
				for j := int64(0); j < int64(n); j++ {
					for i := int64(0); i < int64(m); i++ {
						var sum float64
						for l := int64(0); l < int64(k); l++ {
							ai, bj := i+l*int64(lda), l+j*int64(ldb)
							if ta == rbOpTranspose {
								ai = l + i*int64(lda)
							}
							if tb == rbOpTranspose {
								bj = j + l*int64(ldb)
							}
							sum += get(ap, bi*sa+ai) * get(bp, bi*sb+bj)
						}
						ci := bi*sc + i + j*int64(ldc)
						v := al * sum
						if be != 0 {
							v += be * get(cp, ci)
						}
						set(cp, ci, v)
					}
				}
			}
		})
	}
	geam := func(es int) geamFn {
		return func(hh uintptr, ta, tb, m, n int32, alpha unsafe.Pointer, ap uintptr, lda int32, beta unsafe.Pointer, bp uintptr, ldb int32, cp uintptr, ldc int32) int32 {
			var al, be float64
			if es == 4 {
				al, be = float64(*(*float32)(alpha)), float64(*(*float32)(beta))
			} else {
				al, be = *(*float64)(alpha), *(*float64)(beta)
			}
			return f.op(hh, func() {
				at := func(p uintptr, tr int32, ld int32, i, j int64) float64 {
					idx := i + j*int64(ld)
					if tr == rbOpTranspose {
						idx = j + i*int64(ld)
					}
					q := ptr(p + uintptr(idx)*uintptr(es))
					if es == 4 {
						return float64(*(*float32)(q))
					}
					return *(*float64)(q)
				}
				for j := int64(0); j < int64(n); j++ {
					for i := int64(0); i < int64(m); i++ {
						v := al*at(ap, ta, lda, i, j) + be*at(bp, tb, ldb, i, j)
						q := ptr(cp + uintptr(i+j*int64(ldc))*uintptr(es))
						if es == 4 {
							*(*float32)(q) = float32(v)
						} else {
							*(*float64)(q) = v
						}
					}
				}
			})
		}
	}
	a.sgeam, a.dgeam = geam(4), geam(8)
	a.cgeam = func(uintptr, int32, int32, int32, int32, unsafe.Pointer, uintptr, int32, unsafe.Pointer, uintptr, int32, uintptr, int32) int32 {
		return 2
	}
	a.zgeam = a.cgeam
	return a
}

var _ = math.MaxInt32

// installFake makes Open use f's tables (process-wide) until the returned
// func restores the real loaders.
func installFake(f *fakeROCm) func() {
	resetForTest()
	loadHIP = func() (*hipAPI, string, error) { return f.hip(), "fake:libamdhip64.so", nil }
	loadRocblas = func() (*rocblasAPI, string, error) { return f.rocblas(), "fake:librocblas.so", nil }
	loadHIPRTC = func() (*hiprtcAPI, string, error) { return f.hiprtc(), "fake:libhiprtc.so", nil }
	return func() {
		loadHIP, loadRocblas, loadHIPRTC = loadHIPReal, loadRocblasReal, loadHIPRTCReal
		resetForTest()
	}
}

// ptr turns a fake device address (Go memory kept alive in f.mem) back into a
// pointer.
func ptr(p uintptr) unsafe.Pointer { return *(*unsafe.Pointer)(unsafe.Pointer(&p)) }

package rocm

// Fake is the test-only ROCm (fake_test.go) for package rocm_test.
type Fake struct{ f *fakeROCm }

// InstallFake makes Open (and so gpuctx.OpenBackend("rocm")) use fake HIP,
// hipRTC and rocBLAS tables executing on host memory; the func undoes it.
func InstallFake() (*Fake, func()) {
	f := newFake()
	return &Fake{f}, installFake(f)
}

// Violations counts rocBLAS handles moved while their old stream still ran
// their work; Conflicts counts workspaces used by two streams at once.
func (x *Fake) Violations() int64 { return x.f.violations.Load() }
func (x *Fake) Conflicts() int64  { return x.f.conflicts.Load() }

// HeaderSeen reports whether hipRTC compiled a source with the vendor header.
func (x *Fake) HeaderSeen() bool { return x.f.headerSeen.Load() }

// Gate blocks the stream with raw handle h until the func is called.
func (x *Fake) Gate(h uintptr) func() { return x.f.gate(h) }

// PortNotes is hipPortNotes.
var PortNotes = hipPortNotes

// Stream returns the raw handle of the i-th stream created (from 0).
func (x *Fake) Stream(i int) uintptr {
	x.f.mu.Lock()
	defer x.f.mu.Unlock()
	return x.f.created[i]
}

package nccl

import (
	"errors"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ebitengine/purego"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/internal/dynload"
)

// TestLoad: where NCCL is missing (CI), Load fails with the loader's
// diagnosis; either way NCCL_NVLS_ENABLE is 0 afterwards.
func TestLoad(t *testing.T) {
	l, err := Load()
	if got := os.Getenv(NVLSEnv); got != "0" {
		t.Errorf("%s = %q after Load, want 0", NVLSEnv, got)
	}
	if err == nil {
		t.Logf("NCCL %d loaded from %s", l.Version(), l.Path())
		return
	}
	var miss *dynload.MissingSymbolsError
	if !errors.Is(err, dynload.ErrNotFound) && !errors.As(err, &miss) {
		t.Fatalf("Load: %v: want a load or missing-symbols error", err)
	}
	if errors.Is(err, dynload.ErrNotFound) && !strings.Contains(err.Error(), "libnccl.so.2") {
		t.Errorf("Load error does not name libnccl.so.2: %v", err)
	}
	if l2, err2 := Load(); l2 != l || err2 != err {
		t.Errorf("second Load gave a different result: %v", err2)
	}
}

func TestLoadNotFound(t *testing.T) {
	_, err := load(dynload.Spec{Name: "NCCL", Sonames: []string{"libnccl-gpuctx-test-missing.so.2"}, Install: Spec.Install})
	if !errors.Is(err, dynload.ErrNotFound) || !strings.Contains(err.Error(), "libnccl-gpuctx-test-missing.so.2") || !strings.Contains(err.Error(), "NCCL 2") {
		t.Errorf("err = %v: want ErrNotFound naming the soname and what to install", err)
	}
}

// TestLoadMissingSymbols: a library that is not NCCL (libc) fails the bind
// with every symbol of nccl.spec named, and nothing bound.
func TestLoadMissingSymbols(t *testing.T) {
	_, err := load(dynload.Spec{Name: "not NCCL", Sonames: []string{"libc.so.6"}})
	if errors.Is(err, dynload.ErrNotFound) {
		t.Skipf("libc.so.6 not loadable here: %v", err)
	}
	var miss *dynload.MissingSymbolsError
	if !errors.As(err, &miss) {
		t.Fatalf("err = %v, want *dynload.MissingSymbolsError", err)
	}
	var s ncclSyms
	if len(miss.Missing) != len(s.symbols()) {
		t.Errorf("missing %v, want all %d symbols", miss.Missing, len(s.symbols()))
	}
}

// TestSignatures: purego accepts every Go signature of the table (the
// 128-byte ncclUniqueId by value included). Registering does not call.
func TestSignatures(t *testing.T) {
	var s ncclSyms
	for _, sym := range s.symbols() {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("%s: purego rejects %T: %v", sym.Name, sym.Fn, r)
				}
			}()
			purego.RegisterFunc(sym.Fn, 1)
		}()
	}
}

func TestNewCommNeedsCUDA(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	d, _ := rt.Device(0)
	if _, err := NewComm(&Lib{}, d, UniqueID{}, 2, 0); !errors.Is(err, gpuctx.ErrUnavailable) {
		t.Errorf("NewComm on cpu: %v, want ErrUnavailable", err)
	}
	if _, err := NewComm(nil, d, UniqueID{}, 2, 0); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("nil lib: %v", err)
	}
	if _, err := NewComm(&Lib{}, d, UniqueID{}, 2, 2); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("rank 2 of 2: %v", err)
	} else if msg := err.Error(); !strings.HasPrefix(msg, "nccl: NewComm: ") || !strings.HasSuffix(msg, ": "+gpuctx.ErrInvalid.Error()) {
		t.Errorf("message %q is not shaped \"nccl: Op: what: cause\"", msg)
	}
}

func TestUniqueIDText(t *testing.T) {
	var id UniqueID
	for i := range id {
		id[i] = byte(i * 7)
	}
	got, err := ParseUniqueID(id.String())
	if err != nil || got != id {
		t.Fatalf("round trip: %v", err)
	}
	if _, err := ParseUniqueID("abcd"); err == nil {
		t.Error("short id accepted")
	}
	t.Setenv(IDEnv, id.String())
	if got, ok, err := IDFromEnv(); !ok || err != nil || got != id {
		t.Errorf("IDFromEnv = %v, %v", ok, err)
	}
	os.Unsetenv(IDEnv)
	if _, ok, _ := IDFromEnv(); ok {
		t.Error("IDFromEnv reports an unset variable")
	}
}

// TestShareIDLoopback: rank 0 serves the id on 127.0.0.1 to two ranks, which
// get the same bytes; the listener is served by ServeID on a port the test
// picked (port 0), so nothing races for it.
func TestShareIDLoopback(t *testing.T) {
	var id UniqueID
	for i := range id {
		id[i] = byte(255 - i)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	deadline := time.Now().Add(10 * time.Second)
	var wg sync.WaitGroup
	got := make([]UniqueID, 3)
	errs := make([]error, 3)
	for r := 1; r < 3; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[r], errs[r] = ShareID(addr, 3, r, 10*time.Second, nil)
		}()
	}
	errs[0] = ServeID(ln, id, 2, deadline)
	wg.Wait()
	for r := 1; r < 3; r++ {
		if errs[r] != nil || got[r] != id {
			t.Errorf("rank %d: err %v, same id %v", r, errs[r], got[r] == id)
		}
	}
	if errs[0] != nil {
		t.Errorf("rank 0: %v", errs[0])
	}
}

// TestShareIDBounded: with no peer, both sides give up by themselves at the
// timeout.
func TestShareIDBounded(t *testing.T) {
	mk := func() (UniqueID, error) { return UniqueID{1}, nil }
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nobody listens there now
	start := time.Now()
	if _, err := ShareID(addr, 2, 1, 200*time.Millisecond, mk); err == nil {
		t.Error("rank 1 got an id from nobody")
	}
	if _, err := ShareID("127.0.0.1:0", 2, 0, 200*time.Millisecond, mk); err == nil || !strings.Contains(err.Error(), "served 0 of 1") {
		t.Errorf("rank 0 with no peer: %v", err)
	}
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("took %v", el)
	}
	if id, err := ShareID("127.0.0.1:0", 1, 0, time.Second, mk); err != nil || id != (UniqueID{1}) {
		t.Errorf("one rank: %v", err)
	}
	// Something that is not rank 0 answering: refused.
	ln2, _ := net.Listen("tcp", "127.0.0.1:0")
	defer ln2.Close()
	go func() {
		c, err := ln2.Accept()
		if err == nil {
			_, _ = c.Write(make([]byte, 200))
			c.Close()
		}
	}()
	if _, err := readID(ln2.Addr().String(), time.Now().Add(2*time.Second)); err == nil || !strings.Contains(err.Error(), "did not answer") {
		t.Errorf("foreign server: %v", err)
	}
}

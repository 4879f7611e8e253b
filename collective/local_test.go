package collective

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// cpuDevices opens n CPU-backend runtimes (one device each) for the test.
func cpuDevices(t *testing.T, n int) []*gpuctx.Device {
	t.Helper()
	devs := make([]*gpuctx.Device, n)
	for i := range devs {
		rt, err := gpuctx.OpenBackend("cpu")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rt.Close() })
		if devs[i], err = rt.Device(0); err != nil {
			t.Fatal(err)
		}
	}
	return devs
}

// runRanks runs f for every rank concurrently and returns their errors.
func runRanks(n int, f func(r int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r)
		}()
	}
	wg.Wait()
	return errs
}

// fill returns n bytes that name their sender, receiver and index.
func fill(from, to, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(31*from + 7*to + i)
	}
	return b
}

func TestLocalAllToAllV(t *testing.T) {
	for _, tc := range []struct {
		name  string
		n     int
		count func(from, to int) int // bytes rank from sends to rank to
	}{
		{"N=1", 1, func(int, int) int { return 12 }},
		{"N=1 zero", 1, func(int, int) int { return 0 }},
		{"N=2 even", 2, func(int, int) int { return 16 }},
		{"N=2 uneven", 2, func(f, to int) int { return 4 * (1 + 3*f + to) }},
		{"N=3 uneven with zeros", 3, func(f, to int) int { return 4 * ((f + 2*to) % 3) }},
		{"N=3 all zero", 3, func(int, int) int { return 0 }},
		{"N=3 one sender", 3, func(f, to int) int {
			if f == 1 {
				return 8 * (to + 1)
			}
			return 0
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			devs := cpuDevices(t, tc.n)
			comms, err := NewLocal(tc.n)
			if err != nil {
				t.Fatal(err)
			}
			got := make([][]byte, tc.n)
			errs := runRanks(tc.n, func(r int) error {
				c := comms[r]
				if c.Rank() != r || c.Size() != tc.n {
					return fmt.Errorf("Rank, Size = %d, %d", c.Rank(), c.Size())
				}
				st, err := devs[r].NewStream(gpuctx.StreamOptions{})
				if err != nil {
					return err
				}
				defer st.Close()
				// Counts are exchanged first, as a user of AllToAllV does.
				send := make([]int, tc.n)
				for d := range send {
					send[d] = tc.count(r, d)
				}
				all, err := c.AllGather(send)
				if err != nil {
					return err
				}
				recv := make([]int, tc.n)
				for s := range recv {
					recv[s] = all[s*tc.n+r]
				}
				var data []byte
				for d := range send {
					data = append(data, fill(r, d, send[d])...)
				}
				_, rn := Displacements(recv)
				sb, err := devs[r].Alloc(max(len(data), 1))
				if err != nil {
					return err
				}
				rb, err := devs[r].Alloc(max(rn, 1))
				if err != nil {
					return err
				}
				// The send buffer is written on the stream, so the exchange must
				// come after that copy in stream order.
				hb, err := devs[r].AllocHost(max(len(data), 1))
				if err != nil {
					return err
				}
				copy(hb.Bytes(), data)
				if len(data) > 0 {
					if err := st.CopyHtoD(sb, 0, hb, 0, len(data)); err != nil {
						return err
					}
				}
				if err := c.AllToAllV(sb, send, rb, recv, st); err != nil {
					return err
				}
				if err := st.Synchronize(); err != nil {
					return err
				}
				got[r] = make([]byte, rn)
				if rn > 0 {
					v, _ := rb.Slice(0, rn)
					return v.CopyToHost(got[r])
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Fatalf("rank %d: %v", r, err)
				}
			}
			for r := range tc.n {
				var want []byte
				for s := range tc.n {
					want = append(want, fill(s, r, tc.count(s, r))...)
				}
				if string(got[r]) != string(want) {
					t.Errorf("rank %d received %v, want %v", r, got[r], want)
				}
			}
		})
	}
}

func TestLocalAllGather(t *testing.T) {
	for n := 1; n <= 3; n++ {
		comms, _ := NewLocal(n)
		out := make([][]int, n)
		errs := runRanks(n, func(r int) error {
			var err error
			for range 3 { // several rounds in a row
				if out[r], err = comms[r].AllGather([]int{r, 10 * r}); err != nil {
					return err
				}
			}
			return nil
		})
		for r := range n {
			if errs[r] != nil {
				t.Fatalf("N=%d rank %d: %v", n, r, errs[r])
			}
			for s := range n {
				if out[r][2*s] != s || out[r][2*s+1] != 10*s {
					t.Errorf("N=%d rank %d got %v", n, r, out[r])
				}
			}
		}
	}
}

func TestLocalMismatch(t *testing.T) {
	devs := cpuDevices(t, 2)
	comms, _ := NewLocal(2)
	errs := runRanks(2, func(r int) error {
		st, err := devs[r].NewStream(gpuctx.StreamOptions{})
		if err != nil {
			return err
		}
		defer st.Close()
		b, _ := devs[r].Alloc(64)
		send := []int{8, 8}
		recv := []int{8, 8}
		if r == 1 {
			recv = []int{16, 8} // rank 0 sends 8, not 16
		}
		return comms[r].AllToAllV(b, send, b, recv, st)
	})
	for r, err := range errs {
		if !errors.Is(err, gpuctx.ErrInvalid) {
			t.Errorf("rank %d: err = %v, want ErrInvalid", r, err)
		}
	}
	// Different operations in the same round.
	comms, _ = NewLocal(2)
	errs = runRanks(2, func(r int) error {
		if r == 0 {
			_, err := comms[r].AllGather([]int{1})
			return err
		}
		st, _ := devs[r].NewStream(gpuctx.StreamOptions{})
		defer st.Close()
		return comms[r].AllToAllV(nil, []int{0, 0}, nil, []int{0, 0}, st)
	})
	for r, err := range errs {
		if !errors.Is(err, gpuctx.ErrInvalid) {
			t.Errorf("mixed ops: rank %d: err = %v, want ErrInvalid", r, err)
		}
	}
}

func TestLocalArgs(t *testing.T) {
	devs := cpuDevices(t, 1)
	comms, _ := NewLocal(2)
	st, _ := devs[0].NewStream(gpuctx.StreamOptions{})
	defer st.Close()
	b, _ := devs[0].Alloc(8)
	for name, call := range map[string]func() error{
		"nil stream":   func() error { return comms[0].AllToAllV(b, []int{0, 0}, b, []int{0, 0}, nil) },
		"short counts": func() error { return comms[0].AllToAllV(b, []int{0}, b, []int{0, 0}, st) },
		"negative":     func() error { return comms[0].AllToAllV(b, []int{-1, 0}, b, []int{0, 0}, st) },
		"too small":    func() error { return comms[0].AllToAllV(b, []int{8, 8}, b, []int{0, 0}, st) },
		"nil send":     func() error { return comms[0].AllToAllV(nil, []int{4, 0}, b, []int{0, 0}, st) },
	} {
		if err := call(); !errors.Is(err, gpuctx.ErrInvalid) && !errors.Is(err, gpuctx.ErrSize) {
			t.Errorf("%s: err = %v, want ErrInvalid or ErrSize", name, err)
		}
	}
	if _, err := NewLocal(0); !errors.Is(err, gpuctx.ErrInvalid) {
		t.Errorf("NewLocal(0): %v", err)
	}
}

// TestLocalCloseUnblocks: a rank waiting for a peer that will never come is
// released by Close, with ErrClosed.
func TestLocalCloseUnblocks(t *testing.T) {
	comms, _ := NewLocal(2)
	res := make(chan error, 1)
	go func() {
		_, err := comms[0].AllGather([]int{1})
		res <- err
	}()
	if err := comms[1].Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-res; !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("err = %v, want ErrClosed", err)
	}
	if _, err := comms[1].AllGather([]int{1}); !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
	if err := comms[1].Close(); err != nil {
		t.Errorf("double Close: %v", err)
	}
}

// arrivedAt waits until n ranks have arrived at round seq of g.
func arrivedAt(g *group, seq uint64, n int) {
	for {
		g.mu.Lock()
		r := g.rounds[seq]
		ok := r != nil && r.arrived >= n
		g.mu.Unlock()
		if ok {
			return
		}
		runtime.Gosched()
	}
}

// TestLocalLeasesInFlight: while rank 0's AllToAllV waits for rank 1, its
// send and recv buffers cannot be freed (Free fails with ErrInvalid, every
// run) and its stream's Close waits until the exchange is over; the exchange
// then delivers the right bytes and the buffers free normally.
func TestLocalLeasesInFlight(t *testing.T) {
	devs := cpuDevices(t, 2)
	comms, err := NewLocal(2)
	if err != nil {
		t.Fatal(err)
	}
	const n = 64
	send, recv, streams := make([]*gpuctx.Buffer, 2), make([]*gpuctx.Buffer, 2), make([]*gpuctx.Stream, 2)
	for r := range 2 {
		if send[r], err = devs[r].Alloc(2 * n); err != nil {
			t.Fatal(err)
		}
		if recv[r], err = devs[r].Alloc(2 * n); err != nil {
			t.Fatal(err)
		}
		if err := send[r].CopyFromHost(append(fill(r, 0, n), fill(r, 1, n)...)); err != nil {
			t.Fatal(err)
		}
		if streams[r], err = devs[r].NewStream(gpuctx.StreamOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	counts := []int{n, n}
	var mu sync.Mutex
	var order []string
	mark := func(s string) { mu.Lock(); order = append(order, s); mu.Unlock() }
	rank0 := make(chan error, 1)
	go func() {
		err := comms[0].AllToAllV(send[0], counts, recv[0], counts, streams[0])
		mark("rank 0 returned")
		rank0 <- err
	}()
	arrivedAt(comms[0].g, 0, 1)
	for name, b := range map[string]*gpuctx.Buffer{"send": send[0], "recv": recv[0]} {
		if err := b.Free(); !errors.Is(err, gpuctx.ErrInvalid) {
			t.Fatalf("Free of rank 0's %s buffer during the exchange = %v, want ErrInvalid", name, err)
		}
	}
	closed := make(chan error, 1)
	go func() {
		err := streams[0].Close()
		mark("stream closed")
		closed <- err
	}()
	for range 100 {
		runtime.Gosched() // give a Close that does not wait every chance to finish first
	}
	if err := comms[1].AllToAllV(send[1], counts, recv[1], counts, streams[1]); err != nil {
		t.Fatal(err)
	}
	if err := <-rank0; err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if order[0] != "rank 0 returned" {
		t.Errorf("order %q: the stream closed while the exchange was in flight", order)
	}
	got := make([]byte, 2*n)
	if err := recv[0].CopyToHost(got); err != nil {
		t.Fatal(err)
	}
	if want := append(fill(0, 0, n), fill(1, 0, n)...); string(got) != string(want) {
		t.Errorf("rank 0 received %v, want %v", got, want)
	}
	for r := range 2 {
		if err := errors.Join(send[r].Free(), recv[r].Free()); err != nil {
			t.Errorf("rank %d: Free after the exchange: %v", r, err)
		}
	}
}

// TestMessageShape: errors read "collective: Op: what: cause", the sentinel
// last.
func TestMessageShape(t *testing.T) {
	devs := cpuDevices(t, 1)
	small, err := devs[0].Alloc(4)
	if err != nil {
		t.Fatal(err)
	}
	comms, _ := NewLocal(1)
	_, errNew := NewLocal(0)
	for _, tc := range []struct {
		name string
		err  error
		want error
	}{
		{"NewLocal(0)", errNew, gpuctx.ErrInvalid},
		{"count length", CheckCounts("Op", 2, nil, []int{0}, nil, []int{0, 0}), gpuctx.ErrInvalid},
		{"negative count", CheckCounts("Op", 1, nil, []int{-1}, nil, []int{0}), gpuctx.ErrInvalid},
		{"nil buffer", CheckCounts("Op", 1, nil, []int{4}, nil, []int{0}), gpuctx.ErrInvalid},
		{"small buffer", CheckCounts("Op", 1, small, []int{8}, nil, []int{0}), gpuctx.ErrSize},
		{"nil stream", comms[0].AllToAllV(nil, []int{0}, nil, []int{0}, nil), gpuctx.ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !errors.Is(tc.err, tc.want) {
				t.Fatalf("err %v, want %v", tc.err, tc.want)
			}
			msg := tc.err.Error()
			if !strings.HasPrefix(msg, "collective: ") || !strings.HasSuffix(msg, ": "+tc.want.Error()) {
				t.Errorf("message %q is not shaped \"collective: Op: what: cause\"", msg)
			}
		})
	}
}

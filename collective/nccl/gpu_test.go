package nccl

import (
	"bytes"
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// cudaNCCL opens CUDA device 0 and loads NCCL, or skips the test saying
// which is missing.
func cudaNCCL(t *testing.T) (*gpuctx.Device, *Lib) {
	t.Helper()
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		t.Skipf("skipped: no CUDA backend here: %v", err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	dev, err := rt.Device(0)
	if err != nil {
		t.Skipf("skipped: no CUDA device 0: %v", err)
	}
	lib, err := Load()
	if err != nil {
		t.Skipf("skipped: NCCL not loadable: %v", err)
	}
	t.Logf("NCCL %d from %s on %s", lib.Version(), lib.Path(), dev.Info().Name)
	return dev, lib
}

// TestOneRankCUDA runs a one-rank communicator through the real libnccl on a
// CUDA stream: all-to-all (ncclSend/ncclRecv to itself in a group) of whole
// buffers, of views at offsets, and of zero bytes with nil buffers; the
// send/recv ring of AllGather; and Close. The bytes are checked.
func TestOneRankCUDA(t *testing.T) {
	dev, lib := cudaNCCL(t)
	id, err := lib.UniqueID()
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewComm(lib, dev, id, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n = 1 << 20
	send, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer send.Free()
	recv, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Free()
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i*7 + i>>8)
	}
	if err := send.CopyFromHost(want); err != nil {
		t.Fatal(err)
	}
	sendView, _ := send.Slice(4096, 1000)
	recvView, _ := recv.Slice(8192, 1000)
	for _, tc := range []struct {
		name       string
		send, recv *gpuctx.Buffer
		count      int
		check      func(got []byte) bool
	}{
		{"whole buffers", send, recv, n, func(got []byte) bool { return bytes.Equal(got, want) }},
		{"views at offsets", sendView, recvView, 1000, func(got []byte) bool { return bytes.Equal(got[8192:9192], want[4096:5096]) }},
		{"zero bytes, nil buffers", nil, nil, 0, func(got []byte) bool { return bytes.Count(got, []byte{0}) == n }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := s.Memset(recv, 0); err != nil {
				t.Fatal(err)
			}
			if err := c.AllToAllV(tc.send, []int{tc.count}, tc.recv, []int{tc.count}, s); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, n)
			if err := recv.CopyToHost(got); err != nil {
				t.Fatal(err)
			}
			if !tc.check(got) {
				t.Errorf("received bytes differ from the sent ones")
			}
		})
	}
	counts := []int{3, -5, 1 << 40, 0}
	all, err := c.AllGather(counts)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != len(counts) || all[0] != 3 || all[1] != -5 || all[2] != 1<<40 || all[3] != 0 {
		t.Errorf("AllGather(%v) = %v", counts, all)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("double Close: %v", err)
	}
	if err := c.AllToAllV(send, []int{n}, recv, []int{n}, s); !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("AllToAllV after Close = %v, want ErrClosed", err)
	}
}

// TestOneRankCUDAErrors: on CUDA, a stream of another communicator's device
// is refused, and counts that do not fit the buffers are refused before any
// NCCL call.
func TestOneRankCUDAErrors(t *testing.T) {
	dev, lib := cudaNCCL(t)
	id, err := lib.UniqueID()
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewComm(lib, dev, id, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	small, err := dev.Alloc(16)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Free()
	if err := c.AllToAllV(small, []int{32}, small, []int{32}, s); !errors.Is(err, gpuctx.ErrSize) {
		t.Errorf("counts past the buffers = %v, want ErrSize", err)
	}
	cpu, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer cpu.Close()
	cd, _ := cpu.Device(0)
	cs, err := cd.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.AllToAllV(nil, []int{0}, nil, []int{0}, cs); !errors.Is(err, gpuctx.ErrWrongDevice) {
		t.Errorf("a CPU stream = %v, want ErrWrongDevice", err)
	}
}

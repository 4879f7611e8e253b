package safetensors

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// withTimeout runs f and fails the test if it does not return within d (a call
// that blocks for ever on a FIFO, say).
func withTimeout(t *testing.T, d time.Duration, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		t.Fatalf("call still blocked after %v", d)
		return nil
	}
}

func TestOpenRefusesFIFO(t *testing.T) {
	p := filepath.Join(t.TempDir(), "pipe.safetensors")
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Skip("mkfifo:", err)
	}
	err := withTimeout(t, 3*time.Second, func() error {
		f, err := Open(p)
		if err == nil {
			f.Close()
		}
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("err = %v, want a 'not a regular file' error", err)
	}
}

func TestOpenRefusesDirectory(t *testing.T) {
	dir := t.TempDir()
	_, err := Open(dir)
	if err == nil || !strings.Contains(err.Error(), "is a directory") || strings.Contains(err.Error(), "no such device") {
		t.Fatalf("err = %v, want it to say the path is a directory", err)
	}
}

// TestTruncatedWhileOpen truncates a file after Open: reading a tensor must give
// an error, not a SIGBUS that kills the process.
func TestTruncatedWhileOpen(t *testing.T) {
	p := filepath.Join(t.TempDir(), "w.safetensors")
	ten, err := FromFloat32("w", F32, []int{512, 512}, make([]float32, 512*512))
	if err != nil {
		t.Fatal(err)
	}
	if err := Write(p, []Tensor{ten}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := os.Truncate(p, 200); err != nil {
		t.Fatal(err)
	}
	_, _, err = f.Float32("w")
	if err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("Float32 after truncation: err = %v, want a 'truncated' error", err)
	}
	if _, _, err := f.Bytes("w"); err == nil {
		t.Fatal("Bytes after truncation: want an error")
	}
	if err := f.ReadRaw("w", make([]byte, 16), 4096); err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("ReadRaw after truncation: err = %v, want a 'truncated' error", err)
	}
}

func TestParseStructureErrors(t *testing.T) {
	cases := []struct {
		name string
		file []byte
		want string
	}{
		{"duplicate name", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, 2), `"a" appears twice`},
		{"gap", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}`, 3), "gap"},
		{"leading gap", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, 2), "gap"},
		{"trailing bytes", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, 3), "unused"},
		{"overlap", header(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}`, 3), "overlap"},
		{"trailing json", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}} {}`, 1), "header JSON"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(c.file)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
		})
	}
}

// TestUnusedDTypes: a valid file holding tensors of dtypes this package cannot
// convert opens; only converting such a tensor is an error.
func TestUnusedDTypes(t *testing.T) {
	js := `{"u":{"dtype":"U32","shape":[2],"data_offsets":[0,8]},"f8":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[8,12]},` +
		`"f4":{"dtype":"F4","shape":[2,3],"data_offsets":[12,15]},"u64":{"dtype":"U64","shape":[1],"data_offsets":[15,23]},` +
		`"w":{"dtype":"F32","shape":[1],"data_offsets":[23,27]}}`
	b := header(js, 27)
	binary.LittleEndian.PutUint32(b[8+len(js)+23:], 0x3f800000)
	p := filepath.Join(t.TempDir(), "m.safetensors")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := Open(p)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer f.Close()
	if v, _, err := f.Float32("w"); err != nil || v[0] != 1 {
		t.Fatalf("Float32(w) = %v, %v", v, err)
	}
	for _, n := range []string{"u", "f8", "f4"} {
		if _, _, err := f.Float32(n); err == nil || !strings.Contains(err.Error(), "not a floating-point type") && !strings.Contains(err.Error(), "cannot be converted") {
			t.Errorf("Float32(%s): err = %v, want a dtype error", n, err)
		}
	}
	// Sub-byte dtypes must fill whole bytes.
	if _, err := Parse(header(`{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}`, 1)); err == nil {
		t.Error("F4[3] in 1 byte: want an error")
	}
}

func TestWriteFileAtomicKeepsMode(t *testing.T) {
	p := filepath.Join(t.TempDir(), "out.md")
	if err := os.WriteFile(p, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(p, []byte("new")); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v after the write, want 0600 kept", st.Mode().Perm())
	}
}

func TestWriteFileAtomicLongName(t *testing.T) {
	p := filepath.Join(t.TempDir(), strings.Repeat("y", 245))
	if err := WriteFileAtomic(p, []byte("data")); err != nil {
		t.Fatalf("245-byte name: %v", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "data" {
		t.Fatalf("read back %q", b)
	}
}

// TestWriteFileAtomicNonRegular: a FIFO target is refused (never renamed over,
// never blocked on); a character device is written through, not replaced.
func TestWriteFileAtomicNonRegular(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "pipe")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Skip("mkfifo:", err)
	}
	err := withTimeout(t, 3*time.Second, func() error { return WriteFileAtomic(fifo, []byte("x")) })
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("write to a FIFO: err = %v, want a 'not a regular file' error", err)
	}
	if st, err := os.Lstat(fifo); err != nil || st.Mode()&os.ModeNamedPipe == 0 {
		t.Errorf("the FIFO was replaced: %v %v", st.Mode(), err)
	}
	// A private null device (needs root): written through, stays a device.
	null := filepath.Join(dir, "null")
	if err := syscall.Mknod(null, syscall.S_IFCHR|0o666, 1<<8|3); err != nil {
		t.Log("mknod (needs root):", err)
		return
	}
	if err := WriteFileAtomic(null, []byte("x")); err != nil {
		t.Errorf("write to a character device: %v", err)
	}
	if st, err := os.Lstat(null); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		t.Errorf("the device node was replaced: %v %v", st.Mode(), err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Errorf("%d entries left in the directory, want 2 (no temporary files)", len(ents))
	}
}

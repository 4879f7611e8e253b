package atomicfile

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "a.txt")
	if err := WriteFile(p, []byte("one")); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != DefaultPerm {
		t.Errorf("new file mode %v, want %v", st.Mode().Perm(), DefaultPerm)
	}
	if err := os.Chmod(p, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(p, []byte("two")); err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(p); st.Mode().Perm() != 0o640 {
		t.Errorf("mode %v after overwrite, want 0640 kept", st.Mode().Perm())
	}
	// A symbolic link is kept; its target gets the data.
	link := filepath.Join(dir, "link")
	if err := os.Symlink("a.txt", link); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(link, []byte("three")); err != nil {
		t.Fatal(err)
	}
	if l, _ := os.Lstat(link); l.Mode()&os.ModeSymlink == 0 {
		t.Error("the symbolic link was replaced")
	}
	if b, _ := os.ReadFile(p); string(b) != "three" {
		t.Errorf("link target holds %q", b)
	}
	// Directories are refused.
	if err := WriteFile(dir, []byte("x")); err == nil || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("write over a directory: err = %v", err)
	}
	// Long names work: the temporary name is short.
	long := filepath.Join(dir, strings.Repeat("z", 250))
	if err := WriteFile(long, []byte("x")); err != nil {
		t.Errorf("250-byte name: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 3 {
		t.Errorf("%d entries, want 3 (no temporary files left)", len(ents))
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err == nil {
		if err := WriteFile(fifo, []byte("x")); err == nil || !strings.Contains(err.Error(), "named pipe") {
			t.Errorf("write over a FIFO: err = %v", err)
		}
	}
}

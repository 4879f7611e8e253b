//go:build unix

package safetensors

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// mapFile maps path read-only (MAP_SHARED, PROT_READ). An empty file yields an
// empty slice (mmap of length 0 is an error on Linux).
func mapFile(path string) ([]byte, func() error, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	size := st.Size()
	if size == 0 {
		return []byte{}, func() error { return nil }, nil
	}
	if size != int64(int(size)) {
		return nil, nil, fmt.Errorf("file of %d bytes is too large to map", size)
	}
	data, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("mmap: %w", err)
	}
	return data, func() error { return unix.Munmap(data) }, nil
}

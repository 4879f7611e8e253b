//go:build !unix

package safetensors

import "os"

// mapFile reads the whole file on systems without mmap support in x/sys/unix.
func mapFile(path string) ([]byte, func() error, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	return data, func() error { return nil }, nil
}

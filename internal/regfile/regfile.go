// Package regfile opens files that must be regular files: a FIFO, a device, a
// socket or a directory given where a data file is expected is refused with an
// error that says what the path is, instead of blocking for ever (a FIFO with no
// writer) or failing with an obscure system error.
package regfile

import (
	"errors"
	"fmt"
	"io"
	"os"
)

// Describe names the kind of a non-regular file mode ("a directory", "a named
// pipe (FIFO)", ...).
func Describe(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&os.ModeNamedPipe != 0:
		return "a named pipe (FIFO)"
	case m&os.ModeSocket != 0:
		return "a socket"
	case m&os.ModeCharDevice != 0:
		return "a character device"
	case m&os.ModeDevice != 0:
		return "a block device"
	case m&os.ModeIrregular != 0:
		return "an irregular file"
	}
	return "a " + m.Type().String() + " file"
}

// NotRegular returns the error for path of mode m.
func NotRegular(path string, m os.FileMode) error {
	what := Describe(m)
	if m.IsDir() {
		return fmt.Errorf("%s is a directory, expected a file: %w", path, ErrNotRegular)
	}
	return fmt.Errorf("%s is %s, expected a regular file: %w", path, what, ErrNotRegular)
}

// ErrNotRegular is wrapped by the errors of Open and ReadFile for a path that is
// not a regular file. Its text is "not a regular file".
var ErrNotRegular = errors.New("not a regular file")

// Open opens path read-only after checking (with os.Stat, then again on the open
// descriptor) that it is a regular file. The open itself never blocks: it uses
// O_NONBLOCK where the system has it, so a FIFO swapped in after the Stat is
// still refused at once.
func Open(path string) (*os.File, os.FileInfo, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, nil, NotRegular(path, st.Mode())
	}
	f, err := os.OpenFile(path, os.O_RDONLY|nonBlock, 0)
	if err != nil {
		return nil, nil, err
	}
	st, err = f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, nil, err
	}
	if !st.Mode().IsRegular() {
		_ = f.Close()
		return nil, nil, NotRegular(path, st.Mode())
	}
	return f, st, nil
}

// ReadFile reads the regular file path whole; a file larger than limit bytes is
// an error naming the limit (so a corrupt or hostile path cannot make the
// caller allocate without bound).
func ReadFile(path string, limit int64) ([]byte, error) {
	f, st, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if st.Size() > limit {
		return nil, fmt.Errorf("%s is %d bytes, more than the %d-byte limit for this file", path, st.Size(), limit)
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s grew past the %d-byte limit for this file while being read", path, limit)
	}
	return data, nil
}

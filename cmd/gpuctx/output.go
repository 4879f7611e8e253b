package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/internal/regfile"
)

// readFile is a file a command reads, with what it is for the messages.
type readFile struct {
	what, path string
}

// sameFile reports whether a and b name the same file: the same cleaned
// absolute path, or (when both exist) the same file by identity, which sees
// through symbolic links and hard links.
func sameFile(a, b string) bool {
	aa, err1 := filepath.Abs(a)
	bb, err2 := filepath.Abs(b)
	if err1 == nil && err2 == nil && aa == bb {
		return true
	}
	sa, err1 := os.Stat(a)
	sb, err2 := os.Stat(b)
	return err1 == nil && err2 == nil && os.SameFile(sa, sb)
}

// checkOutput refuses an output path (flag names the flag) that is any file the
// run reads, or that is a directory or a non-regular file other than a character
// device (/dev/null, a terminal: those are written through), and one whose
// directory does not exist. Call it before any work, so that a run that cannot
// write its result fails at once and nothing the user had is touched.
func checkOutput(flag, output string, reads []readFile) error {
	for _, r := range reads {
		if sameFile(output, r.path) {
			return fail(fmt.Sprintf("%s %s is %s (%s), which this run reads", flag, output, r.what, r.path),
				"write the output to another file; the run never overwrites its inputs", nil)
		}
	}
	st, err := os.Stat(output)
	switch {
	case err == nil && st.Mode().IsRegular():
	case err == nil && st.Mode()&os.ModeCharDevice != 0:
	case err == nil:
		return fail(fmt.Sprintf("%s %s", flag, output), "choose a regular file to write to", regfile.NotRegular(output, st.Mode()))
	case errors.Is(err, fs.ErrNotExist):
		if dst, err := os.Stat(filepath.Dir(output)); err != nil || !dst.IsDir() {
			return fail(fmt.Sprintf("%s %s: its directory does not exist", flag, output), "create the directory first or choose another path", err)
		}
	default:
		return fail(fmt.Sprintf("%s %s", flag, output), "choose a path you can write to", err)
	}
	return nil
}

// writeOutput writes data to path atomically (see internal/atomicfile): an
// existing file keeps its mode, a character device is written through, and a
// reader never sees a half-written file.
func writeOutput(path string, data []byte) error {
	return atomicfile.WriteFile(path, data)
}

// Package atomicfile writes output files so that a reader never sees a
// half-written file and nothing the user had is lost by surprise.
//
// WriteFile writes a regular file through a short-named temporary file in the
// target's directory (".tmp-<random>", so a target name up to the system's
// limit still works), syncs it and renames it over the target. An existing
// regular target keeps its permission bits; a symbolic link is followed and its
// target replaced, the link kept. A character device (/dev/null, a terminal) is
// written through, never replaced by a regular file; any other non-regular
// target (a directory, a FIFO, a socket, a block device) is refused.
package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/gpuctx/gpuctx/internal/regfile"
)

// DefaultPerm is the permission of a newly created file.
const DefaultPerm fs.FileMode = 0o644

// WriteFile writes data to path as described in the package comment.
func WriteFile(path string, data []byte) (err error) {
	target := path
	perm := DefaultPerm
	st, err := os.Stat(path) // follows symbolic links
	switch {
	case err == nil && st.Mode().IsRegular():
		perm = st.Mode().Perm()
		if target, err = filepath.EvalSymlinks(path); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
	case err == nil && st.Mode()&os.ModeCharDevice != 0:
		return writeThrough(path, data)
	case err == nil:
		return fmt.Errorf("write %s: %w; choose a regular file", path, regfile.NotRegular(path, st.Mode()))
	case errors.Is(err, fs.ErrNotExist):
		// A dangling symbolic link: write its target, keep the link.
		if l, lerr := os.Lstat(path); lerr == nil && l.Mode()&os.ModeSymlink != 0 {
			dest, rerr := os.Readlink(path)
			if rerr != nil {
				return fmt.Errorf("write %s: %w", path, rerr)
			}
			if !filepath.IsAbs(dest) {
				dest = filepath.Join(filepath.Dir(path), dest)
			}
			target = dest
		}
	default:
		return fmt.Errorf("write %s: %w", path, err)
	}
	dir := filepath.Dir(target)
	tmp, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err = tmp.Chmod(perm); err != nil {
		return fmt.Errorf("write %s: set permissions %v: %w", path, perm, err)
	}
	if err = tmp.Sync(); err != nil {
		return fmt.Errorf("write %s: sync: %w", path, err)
	}
	if err = tmp.Close(); err != nil {
		return fmt.Errorf("write %s: close: %w", path, err)
	}
	if err = os.Rename(tmp.Name(), target); err != nil {
		return fmt.Errorf("write %s: rename the temporary file into place: %w", path, err)
	}
	if d, derr := os.Open(dir); derr == nil { // make the rename durable; best effort
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

// writeThrough writes data into an existing character device.
func writeThrough(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		_ = f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

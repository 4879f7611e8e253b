// Package sysmem reads the host's memory figures from /proc/meminfo.
package sysmem

import (
	"bufio"
	"os"
	"strconv"
	"strings"
)

// Field returns a field of /proc/meminfo ("MemTotal", "MemAvailable", ...) in
// bytes, or 0 when it cannot be read (not Linux, unknown field).
func Field(name string) uint64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok || key != name {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			return 0
		}
		kb, err := strconv.ParseUint(fields[0], 10, 64)
		if err != nil {
			return 0
		}
		return kb * 1024
	}
	return 0
}

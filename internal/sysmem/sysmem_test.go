package sysmem

import (
	"runtime"
	"testing"
)

func TestField(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("/proc/meminfo is Linux-only")
	}
	total, avail := Field("MemTotal"), Field("MemAvailable")
	if total == 0 || avail == 0 || avail > total {
		t.Fatalf("MemTotal %d, MemAvailable %d: want 0 < available <= total", total, avail)
	}
	if Field("NoSuchField") != 0 {
		t.Fatal("an unknown field must read 0")
	}
}

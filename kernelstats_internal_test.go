package gpuctx

import (
	"testing"
	"time"
)

// TestKernelStatsBusy checks that kernelStats counts every lookup and charges
// the wall time during which lookups were in progress once, however many
// overlapped (on a fake clock: steps are b (begin), e (end) and t (10 ms pass)).
func TestKernelStatsBusy(t *testing.T) {
	for _, tc := range []struct {
		steps   string
		want    time.Duration
		lookups int64
	}{
		{"bte", 10 * time.Millisecond, 1},
		{"bbttee", 20 * time.Millisecond, 2},      // two together: once
		{"btebte", 20 * time.Millisecond, 2},      // one after the other
		{"btbtetettbe", 30 * time.Millisecond, 3}, // chained overlaps, idle, an instant one
		{"tbtet", 10 * time.Millisecond, 1},       // idle time is not counted
		{"btt", 20 * time.Millisecond, 0},         // a lookup still in progress
	} {
		var clock time.Time
		k := kernelStats{now: func() time.Time { return clock }}
		for _, s := range tc.steps {
			switch s {
			case 'b':
				k.begin()
			case 'e':
				k.end()
			case 't':
				clock = clock.Add(10 * time.Millisecond)
			}
		}
		if got := k.busy(); got != tc.want {
			t.Errorf("%s: busy %v, want %v", tc.steps, got, tc.want)
		}
		if n := k.lookups.Load(); n != tc.lookups {
			t.Errorf("%s: %d lookups, want %d", tc.steps, n, tc.lookups)
		}
	}
}

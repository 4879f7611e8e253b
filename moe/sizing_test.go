package moe

import "testing"

// heavyShapes picks a heavy test's shapes: all of them in a plain go test,
// the reduced list under the race detector or -short (CI's race step), where
// the CPU backend's twins are too slow for every shape. The reduced list still
// runs every tile and mode the test covers, on fewer token counts.
func heavyShapes(all, reduced []int) []int {
	if raceEnabled || testing.Short() {
		return reduced
	}
	return all
}

// parallelHeavy lets a heavy test run beside the other heavy ones under the
// race detector or -short (CI's race step, on 2 cores, where the CPU
// backend's twins keep one core busy per test). A plain go test (and the GPU
// machine's runs) keeps them serial. The tests it is called from change no
// package-level state.
func parallelHeavy(t *testing.T) {
	if raceEnabled || testing.Short() {
		t.Parallel()
	}
}

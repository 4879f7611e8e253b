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

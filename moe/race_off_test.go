//go:build !race

package moe

// raceEnabled: the race detector is off; heavy tests run every shape.
const raceEnabled = false

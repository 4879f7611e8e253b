//go:build race

package moe

// raceEnabled: the race detector is on (go test -race), which makes the
// CPU backend's kernel twins 10-20 times slower; heavy tests then run fewer
// shapes (see heavyShapes).
const raceEnabled = true

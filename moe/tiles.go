package moe

import "github.com/gpuctx/gpuctx/moe/internal/moekernels"

// TileTags returns every tag LayerOptions.Tile accepts (moe bench --tile):
// the mma.sync tiles (compute capability 8.0 and above) first, then the
// warpgroup tiles, which only compute capability 9.0 runs. The CPU backend
// runs every tile through its Go twin.
func TileTags() []string {
	tags := make([]string, len(moekernels.MoEGemms))
	for i, c := range moekernels.MoEGemms {
		tags[i] = c.Tag()
	}
	return tags
}

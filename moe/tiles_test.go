package moe

import (
	"slices"
	"testing"
)

// TestTileTags: every tag TileTags lists is one LayerOptions.Tile accepts, once.
func TestTileTags(t *testing.T) {
	tags := TileTags()
	if len(tags) == 0 {
		t.Fatal("no tile tags")
	}
	for i, tag := range tags {
		if _, err := parseTile(tag); err != nil {
			t.Errorf("tag %s: %v", tag, err)
		}
		if slices.Index(tags, tag) != i {
			t.Errorf("tag %s listed twice", tag)
		}
	}
}

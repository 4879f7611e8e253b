package moe

import (
	"bytes"
	"os"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestFusedFullSize runs the fused path on a full-size preset layer
// (GPUCTX_FULL_SIZE=preset name, e.g. deepseek-v2-lite; CUDA only: it needs
// about 2 GB of device memory and 5 GB of host memory): the tuned tiles per
// bucket are logged, and every batch must equal the grouped-GEMM path within
// bf16 tolerance and the small-batch path's tokens.
func TestFusedFullSize(t *testing.T) {
	name := os.Getenv("GPUCTX_FULL_SIZE")
	if name == "" {
		t.Skip("set GPUCTX_FULL_SIZE=<preset> to run (CUDA, full-size weights)")
	}
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		t.Skipf("needs CUDA: %v", firstLine(err))
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := Preset(name)
	if err != nil {
		t.Fatal(err)
	}
	w, err := RandomWeights(cfg, 3)
	if err != nil {
		t.Fatal(err)
	}
	fused, err := NewLayer(dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer fused.Close()
	gemm, err := NewLayer(dev, cfg, w, LayerOptions{DType: gpuctx.BF16, SmallBatchTokens: -1, NoFused: true})
	if err != nil {
		t.Fatal(err)
	}
	defer gemm.Close()
	for _, T := range []int{1, 8, 64, 256, 1024, 4096} {
		x := randomX(T, cfg.HiddenSize, uint64(T))
		got := deviceRun(t, fused, x, T, Dual, Whole)
		want := deviceRun(t, gemm, x, T, Single, Whole)
		checkClose(t, "fused vs grouped GEMM", fused.decode(got), gemm.decode(want), nil, 2e-2)
		if again := deviceRun(t, fused, x, T, Single, Whole); !bytes.Equal(again, got) {
			t.Errorf("T=%d: fused single differs from fused dual (graph replay)", T)
		}
	}
	for _, line := range fused.TileChoices() {
		t.Log(line)
	}
}

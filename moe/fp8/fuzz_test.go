package fp8

import (
	"encoding/json"
	"math"
	"testing"
)

// FuzzE4M3: for any float32, E4M3 equals the clamp-then-PyTorch-cast oracle
// and round-trips through FromE4M3 to the same code (NaN to NaN).
func FuzzE4M3(f *testing.F) {
	for _, v := range []uint32{0, 0x80000000, 0x43e00000, 0x43e80000, 0x3b000000, 0x7f800000, 0x7fc00000, 0x3c7fffff} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, bits uint32) {
		v := math.Float32frombits(bits)
		c := E4M3(v)
		if want := clampedTorchE4M3(v); c != want {
			t.Fatalf("E4M3(%v) = %#02x, clamp + PyTorch cast gives %#02x", v, c, want)
		}
		if E4M3(FromE4M3(c)) != c {
			t.Fatalf("code %#02x does not round-trip", c)
		}
	})
}

// FuzzParseQuantConfig: ParseQuantConfig never panics, and what it accepts
// is the one supported configuration.
func FuzzParseQuantConfig(f *testing.F) {
	f.Add([]byte(deepseekV3Quant))
	f.Add([]byte(`{"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}`))
	f.Add([]byte(`{"quant_method": "fp8", "weight_block_size": [128.0, 1e2]}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		q, err := ParseQuantConfig(json.RawMessage(raw))
		if err != nil {
			return
		}
		if q.QuantMethod != "fp8" || q.Fmt != "e4m3" || q.ActivationScheme != "dynamic" || q.Block() != defaultBlock {
			t.Fatalf("accepted %s as %+v", raw, q)
		}
	})
}

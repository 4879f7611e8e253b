package safetensors

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func mustEncode(t testing.TB, tensors []Tensor) []byte {
	t.Helper()
	b, err := Encode(tensors, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestRoundTripDTypes(t *testing.T) {
	// Values exactly representable in every dtype, so all three round-trip exactly.
	vals := []float32{0, 1, -2, 0.5, -0.25, 3, 96, -1024}
	for _, dt := range []DType{F32, F16, BF16} {
		t.Run(string(dt), func(t *testing.T) {
			ten, err := FromFloat32("w", dt, []int{2, 4}, vals)
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			p := filepath.Join(dir, "a.safetensors")
			if err := Write(p, []Tensor{ten}, nil); err != nil {
				t.Fatal(err)
			}
			f, err := Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			got, info, err := f.Float32("w")
			if err != nil {
				t.Fatal(err)
			}
			if info.DType != dt || len(info.Shape) != 2 || info.Shape[0] != 2 || info.Shape[1] != 4 {
				t.Fatalf("info = %+v", info)
			}
			for i := range vals {
				if got[i] != vals[i] {
					t.Fatalf("value %d: got %v want %v", i, got[i], vals[i])
				}
			}
			if f.Header.DataOffset%8 != 0 {
				t.Errorf("data section offset %d not 8-byte aligned", f.Header.DataOffset)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil { // double Close is harmless
				t.Fatal(err)
			}
			if _, _, err := f.Bytes("w"); err == nil {
				t.Fatal("Bytes after Close: want error")
			}
			// No temporary files left behind.
			ents, _ := os.ReadDir(dir)
			if len(ents) != 1 {
				t.Fatalf("dir has %d entries, want 1", len(ents))
			}
		})
	}
}

func TestBF16Rounding(t *testing.T) {
	cases := []struct {
		in   float32
		want uint16
	}{
		{1, 0x3f80},
		{math.Float32frombits(0x3f808000), 0x3f80}, // tie, even stays
		{math.Float32frombits(0x3f818000), 0x3f82}, // tie, odd rounds up
		{math.Float32frombits(0x3f808001), 0x3f81}, // above half
		{float32(math.Inf(1)), 0x7f80},
		{float32(math.Copysign(0, -1)), 0x8000},
	}
	for _, c := range cases {
		if got := Float32ToBF16(c.in); got != c.want {
			t.Errorf("Float32ToBF16(%#x) = %#x, want %#x", math.Float32bits(c.in), got, c.want)
		}
	}
	if got := Float32ToBF16(float32(math.NaN())); BF16ToFloat32(got) == BF16ToFloat32(got) {
		t.Errorf("NaN converted to non-NaN %#x", got)
	}
	// Every bf16 value round-trips exactly (no double rounding).
	for b := 0; b < 1<<16; b++ {
		f := BF16ToFloat32(uint16(b))
		if f != f {
			continue
		}
		if got := Float32ToBF16(f); got != uint16(b) {
			t.Fatalf("bf16 %#x -> %v -> %#x", b, f, got)
		}
	}
}

func header(js string, data int) []byte {
	b := make([]byte, 8+len(js)+data)
	binary.LittleEndian.PutUint64(b, uint64(len(js)))
	copy(b[8:], js)
	return b
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name string
		file []byte
		want string
	}{
		{"short", []byte{1, 2, 3}, "shorter than"},
		{"huge length", func() []byte { b := make([]byte, 16); binary.LittleEndian.PutUint64(b, 1<<40); return b }(), "exceeds"},
		{"length past end", func() []byte { b := make([]byte, 16); binary.LittleEndian.PutUint64(b, 100); return b }(), "past the end"},
		{"not json", header("hello", 0), "not a JSON object"},
		{"bad json", header("{\"a\":", 0), "header JSON"},
		{"bad dtype", header(`{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}`, 1), "unsupported dtype"},
		{"size mismatch", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, 8), "needs 8"},
		{"past data", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 4), "outside"},
		{"negative offset", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}}`, 4), "outside"},
		{"reversed", header(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[3,2]}}`, 4), "outside"},
		{"negative dim", header(`{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}`, 4), "dimension"},
		{"overflow", header(`{"a":{"dtype":"F64","shape":[2147483647,2147483647,2147483647],"data_offsets":[0,8]}}`, 8), "overflows"},
		{"offsets count", header(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}}`, 4), "data_offsets"},
		{"overlap", header(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}`, 4), "overlap"},
		{"metadata type", header(`{"__metadata__":{"a":1}}`, 0), "__metadata__"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(c.file)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to mention %q", err, c.want)
			}
		})
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := Open(filepath.Join(dir, "missing.safetensors")); err == nil {
		t.Fatal("missing file: want error")
	}
	p := filepath.Join(dir, "empty.safetensors")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(p); err == nil {
		t.Fatal("empty file: want error")
	}
	ten, _ := FromInt32("idx", []int{2}, []int32{1, -1})
	q := filepath.Join(dir, "i.safetensors")
	if err := Write(q, []Tensor{ten}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(q)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, _, err := f.Float32("idx"); err == nil || !strings.Contains(err.Error(), "not a floating-point") {
		t.Fatalf("Float32 of I32: err = %v", err)
	}
	if _, _, err := f.Float32("nope"); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("missing tensor: err = %v", err)
	}
}

func TestEncodeErrors(t *testing.T) {
	good, _ := FromFloat32("a", F32, []int{1}, []float32{1})
	cases := []struct {
		name    string
		tensors []Tensor
	}{
		{"duplicate", []Tensor{good, good}},
		{"empty name", []Tensor{{Name: "", DType: F32, Shape: []int{1}, Data: make([]byte, 4)}}},
		{"bad size", []Tensor{{Name: "b", DType: F32, Shape: []int{2}, Data: make([]byte, 4)}}},
		{"bad dtype", []Tensor{{Name: "b", DType: "X", Shape: []int{1}, Data: make([]byte, 4)}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := Encode(c.tensors, nil); err == nil {
				t.Fatal("want error")
			}
		})
	}
	if _, err := FromFloat32("a", I32, []int{1}, []float32{1}); err == nil {
		t.Fatal("FromFloat32 to I32: want error")
	}
	if _, err := FromFloat32("a", F32, []int{3}, []float32{1}); err == nil {
		t.Fatal("FromFloat32 shape mismatch: want error")
	}
}

func FuzzParse(f *testing.F) {
	a, _ := FromFloat32("a", F32, []int{2, 2}, []float32{1, 2, 3, 4})
	b, _ := FromFloat32("b", BF16, []int{3}, []float32{1, 2, 3})
	c, _ := FromInt32("c", []int{1}, []int32{7})
	f.Add(mustEncode(f, []Tensor{a, b, c}))
	f.Add(mustEncode(f, nil))
	f.Add(header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, 8))
	f.Add(header(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}`, 4))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := Parse(data)
		if err != nil {
			return
		}
		// Every accepted tensor must be readable without panicking.
		for _, ti := range h.Tensors {
			raw := data[h.DataOffset+ti.Begin : h.DataOffset+ti.End]
			switch ti.DType {
			case F32, F16, BF16, F64:
				dst := make([]float32, ti.NumElements())
				if err := DecodeFloat32(dst, raw, ti.DType); err != nil {
					t.Fatalf("accepted tensor %q does not decode: %v", ti.Name, err)
				}
			}
		}
	})
}

// TestReadRaw reads byte ranges of tensors as they are in the file, and refuses
// ranges outside a tensor, unknown names, and closed or nil Files.
func TestReadRaw(t *testing.T) {
	a, err := FromFloat32("a", BF16, []int{3, 4}, []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	if err != nil {
		t.Fatal(err)
	}
	b, err := FromFloat32("b", F32, []int{5}, []float32{-1, -2, -3, -4, -5})
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "w.safetensors")
	if err := Write(p, []Tensor{a, b}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, c := range []struct {
		name    string
		tensor  string
		off, n  int64
		want    []byte // nil: an error containing wantErr
		wantErr string
	}{
		{"whole a", "a", 0, 24, a.Data, ""},
		{"row 1 of a", "a", 8, 8, a.Data[8:16], ""},
		{"one byte", "b", 19, 1, b.Data[19:], ""},
		{"whole b", "b", 0, 20, b.Data, ""},
		{"empty at the end", "b", 20, 0, []byte{}, ""},
		{"past the end", "a", 20, 8, nil, `tensor "a": bytes [20,28) are outside its 24 bytes`},
		{"negative offset", "b", -4, 4, nil, "outside its 20 bytes"},
		{"offset past the end", "b", 21, 0, nil, "outside"},
		{"unknown tensor", "c", 0, 1, nil, `tensor "c" not found`},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := make([]byte, c.n)
			err := f.ReadRaw(c.tensor, dst, c.off)
			if c.want == nil {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if string(dst) != string(c.want) {
				t.Fatalf("got % x, want % x", dst, c.want)
			}
		})
	}
	var nilFile *File
	if err := nilFile.ReadRaw("a", make([]byte, 1), 0); err == nil {
		t.Error("ReadRaw on a nil File: want an error")
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.ReadRaw("a", make([]byte, 2), 0); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("ReadRaw after Close: err = %v, want a 'closed' error", err)
	}
}

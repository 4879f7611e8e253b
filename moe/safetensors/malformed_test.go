package safetensors

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMalformedHeaders is a held-out set of malformed headers (none of them
// in TestParseErrors or the fuzz seeds): each error is one line that names the
// tensor, the field and the value in the file's terms, says what the value
// must be, matches ErrMalformed, and carries no Go decoder wording.
func TestMalformedHeaders(t *testing.T) {
	for _, tc := range []struct {
		name string
		file []byte
		want []string // every one must appear in the message
	}{
		{"fractional dimension", header(`{"w":{"dtype":"F32","shape":[8.5],"data_offsets":[0,32]}}`, 32),
			[]string{`tensor "w"`, "shape[0]", "8.5", "whole number"}},
		{"exponent dimension", header(`{"w":{"dtype":"U8","shape":[1e3],"data_offsets":[0,1000]}}`, 1000),
			[]string{`tensor "w"`, "shape[0]", "1e3", "whole number"}},
		{"string dimension", header(`{"w":{"dtype":"U8","shape":[2,"4"],"data_offsets":[0,8]}}`, 8),
			[]string{`tensor "w"`, "shape[1]", `"4"`, "whole number"}},
		{"shape not a list", header(`{"w":{"dtype":"U8","shape":"8","data_offsets":[0,8]}}`, 8),
			[]string{`tensor "w"`, "shape", `"8"`, "list"}},
		{"shape missing", header(`{"w":{"dtype":"U8","data_offsets":[0,8]}}`, 8),
			[]string{`tensor "w"`, "shape", "missing"}},
		{"huge dimension", header(`{"w":{"dtype":"U8","shape":[3000000000],"data_offsets":[0,8]}}`, 8),
			[]string{`tensor "w"`, "shape[0]", "3000000000", "2147483647"}},
		{"negative dimension", header(`{"w":{"dtype":"U8","shape":[2,-3],"data_offsets":[0,8]}}`, 8),
			[]string{`tensor "w"`, "shape[1]", "-3", ">= 0"}},
		{"dtype a number", header(`{"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}`, 1),
			[]string{`tensor "w"`, "dtype", "7", "BF16"}},
		{"dtype lower case", header(`{"w":{"dtype":"bf16","shape":[1],"data_offsets":[0,2]}}`, 2),
			[]string{`tensor "w"`, "dtype", `"bf16"`, "BF16"}},
		{"fractional offset", header(`{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4.0]}}`, 4),
			[]string{`tensor "w"`, "data_offsets[1]", "4.0", "whole number"}},
		{"offsets a string", header(`{"w":{"dtype":"U8","shape":[4],"data_offsets":"0,4"}}`, 4),
			[]string{`tensor "w"`, "data_offsets", `"0,4"`, "[begin, end]"}},
		{"offsets three", header(`{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,2,4]}}`, 4),
			[]string{`tensor "w"`, "data_offsets", "3", "[begin, end]"}},
		{"offset past int64", header(`{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,99999999999999999999]}}`, 4),
			[]string{`tensor "w"`, "data_offsets[1]", "99999999999999999999"}},
		{"entry not an object", header(`{"w":[1,2]}`, 0),
			[]string{`tensor "w"`, "[1,2]", "object"}},
		{"metadata value a number", header(`{"__metadata__":{"format":1}}`, 0),
			[]string{"__metadata__", `"format"`, "1", "string"}},
		{"metadata a list", header(`{"__metadata__":["pt"]}`, 0),
			[]string{"__metadata__", "object"}},
		{"header a list", header(`[{"dtype":"U8"}]`, 0),
			[]string{"header", "object"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.file)
			if err == nil {
				t.Fatal("accepted")
			}
			msg := err.Error()
			if !errors.Is(err, ErrMalformed) {
				t.Errorf("%q does not match ErrMalformed", msg)
			}
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("%q does not mention %q", msg, w)
				}
			}
			for _, bad := range []string{"json:", "Go struct", "rawEntry", "int64", "unmarshal", "\n"} {
				if strings.Contains(msg, bad) {
					t.Errorf("%q contains %q", msg, bad)
				}
			}
		})
	}
}

// TestOpenMalformed: Open names the file once, before what is wrong with it,
// and a missing file is fs.ErrNotExist, not ErrMalformed.
func TestOpenMalformed(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "model.safetensors")
	js := `{"w":{"dtype":"F32","shape":[8.5],"data_offsets":[0,32]}}`
	b := make([]byte, 8+len(js)+32)
	binary.LittleEndian.PutUint64(b, uint64(len(js)))
	copy(b[8:], js)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := Open(p)
	if !errors.Is(err, ErrMalformed) || !strings.HasPrefix(err.Error(), "safetensors: "+p+": tensor \"w\": shape[0] is 8.5") || strings.Count(err.Error(), p) != 1 {
		t.Errorf("Open = %v", err)
	}
	_, err = Open(filepath.Join(dir, "missing.safetensors"))
	if !errors.Is(err, os.ErrNotExist) || errors.Is(err, ErrMalformed) {
		t.Errorf("Open of a missing file = %v, want fs.ErrNotExist only", err)
	}
}

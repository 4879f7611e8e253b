// Package safetensors reads and writes the safetensors tensor file format used by
// Hugging Face checkpoints: an 8-byte little-endian header length N, N bytes of
// JSON header mapping tensor names to {dtype, shape, data_offsets}, then the raw
// little-endian tensor data. Offsets are relative to the first byte after the
// header.
//
// Parse validates everything it reads (header length, JSON, dtype, shape, offsets
// and sizes, overlap) and returns an error, never panics, on a corrupt file. Open
// maps the file read-only instead of reading it, so only the pages of the tensors
// that are converted are read from disk.
//
// Nothing here touches a device: every function runs on the calling goroutine.
// A *File is safe for concurrent reads from many goroutines until Close.
package safetensors

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/gpuctx/gpuctx/half"
)

// DType is a safetensors element type, spelled as in the file header.
type DType string

// The element types this package knows. Parse accepts all of them; conversion to
// float32 supports F32, F16, BF16 and F64.
const (
	F64  DType = "F64"
	F32  DType = "F32"
	F16  DType = "F16"
	BF16 DType = "BF16"
	I64  DType = "I64"
	I32  DType = "I32"
	I16  DType = "I16"
	I8   DType = "I8"
	U8   DType = "U8"
	Bool DType = "BOOL"
)

// Size returns the size in bytes of one element, or 0 for an unknown dtype.
func (d DType) Size() int {
	switch d {
	case F64, I64:
		return 8
	case F32, I32:
		return 4
	case F16, BF16, I16:
		return 2
	case I8, U8, Bool:
		return 1
	}
	return 0
}

// MaxHeaderBytes bounds the JSON header so a corrupt length cannot make Parse
// allocate or scan an absurd amount of memory (the Rust reference uses 100 MB).
const MaxHeaderBytes = 100 << 20

// TensorInfo describes one tensor in a file.
type TensorInfo struct {
	Name  string
	DType DType
	Shape []int
	// Begin and End are byte offsets into the data section (after the header).
	Begin, End int64
}

// NumElements returns the product of the shape (1 for a scalar).
func (t TensorInfo) NumElements() int64 {
	n := int64(1)
	for _, d := range t.Shape {
		n *= int64(d)
	}
	return n
}

// Header is a parsed safetensors header.
type Header struct {
	// DataOffset is the file offset of the data section: 8 + header length.
	DataOffset int64
	Tensors    map[string]TensorInfo
	Metadata   map[string]string
}

// Names returns the tensor names in sorted order.
func (h *Header) Names() []string {
	names := make([]string, 0, len(h.Tensors))
	for n := range h.Tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

type rawEntry struct {
	DType       string  `json:"dtype"`
	Shape       []int64 `json:"shape"`
	DataOffsets []int64 `json:"data_offsets"`
}

// ParseHeader parses and validates the header of a safetensors file of fileSize
// bytes whose first bytes are prefix (prefix must hold at least the 8-byte length
// and the whole JSON header; a longer prefix, such as the whole file, is fine).
// Every tensor's data must lie inside the file, match dtype size times element
// count, and not overlap another tensor.
func ParseHeader(prefix []byte, fileSize int64) (*Header, error) {
	if len(prefix) < 8 || fileSize < 8 {
		return nil, fmt.Errorf("safetensors: file is %d bytes, shorter than the 8-byte header length", fileSize)
	}
	n := binary.LittleEndian.Uint64(prefix[:8])
	if n > MaxHeaderBytes {
		return nil, fmt.Errorf("safetensors: header length %d exceeds the %d-byte limit (corrupt or not a safetensors file)", n, MaxHeaderBytes)
	}
	if int64(n) > fileSize-8 {
		return nil, fmt.Errorf("safetensors: header length %d runs past the end of the %d-byte file", n, fileSize)
	}
	if int64(len(prefix)) < 8+int64(n) {
		return nil, fmt.Errorf("safetensors: need %d header bytes, got %d", 8+n, len(prefix))
	}
	js := prefix[8 : 8+n]
	trimmed := strings.TrimLeft(string(js), " \t\r\n")
	if !strings.HasPrefix(trimmed, "{") {
		return nil, errors.New("safetensors: header is not a JSON object")
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(js, &raw); err != nil {
		return nil, fmt.Errorf("safetensors: header JSON: %w", err)
	}
	h := &Header{DataOffset: 8 + int64(n), Tensors: make(map[string]TensorInfo, len(raw))}
	dataSize := fileSize - h.DataOffset
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &h.Metadata); err != nil {
				return nil, fmt.Errorf("safetensors: __metadata__ must map strings to strings: %w", err)
			}
			continue
		}
		var e rawEntry
		if err := json.Unmarshal(msg, &e); err != nil {
			return nil, fmt.Errorf("safetensors: tensor %q: %w", name, err)
		}
		dt := DType(e.DType)
		if dt.Size() == 0 {
			return nil, fmt.Errorf("safetensors: tensor %q has unsupported dtype %q", name, e.DType)
		}
		if len(e.DataOffsets) != 2 {
			return nil, fmt.Errorf("safetensors: tensor %q: data_offsets has %d entries, want 2", name, len(e.DataOffsets))
		}
		numel := uint64(1)
		shape := make([]int, len(e.Shape))
		for i, d := range e.Shape {
			if d < 0 || d > math.MaxInt32 {
				return nil, fmt.Errorf("safetensors: tensor %q: dimension %d is %d", name, i, d)
			}
			hi, lo := bits.Mul64(numel, uint64(d))
			if hi != 0 || lo > math.MaxInt64/8 {
				return nil, fmt.Errorf("safetensors: tensor %q: shape %v overflows", name, e.Shape)
			}
			numel = lo
			shape[i] = int(d)
		}
		b, en := e.DataOffsets[0], e.DataOffsets[1]
		if b < 0 || en < b || en > dataSize {
			return nil, fmt.Errorf("safetensors: tensor %q: data_offsets [%d,%d] outside the %d-byte data section", name, b, en, dataSize)
		}
		if want := numel * uint64(dt.Size()); uint64(en-b) != want {
			return nil, fmt.Errorf("safetensors: tensor %q: %d data bytes, but %s%v needs %d", name, en-b, dt, shape, want)
		}
		h.Tensors[name] = TensorInfo{Name: name, DType: dt, Shape: shape, Begin: b, End: en}
	}
	// No two tensors may share bytes.
	infos := make([]TensorInfo, 0, len(h.Tensors))
	for _, t := range h.Tensors {
		if t.End > t.Begin {
			infos = append(infos, t)
		}
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].Begin < infos[j].Begin })
	for i := 1; i < len(infos); i++ {
		if infos[i].Begin < infos[i-1].End {
			return nil, fmt.Errorf("safetensors: tensors %q and %q overlap", infos[i-1].Name, infos[i].Name)
		}
	}
	return h, nil
}

// Parse parses a whole safetensors file held in memory.
func Parse(data []byte) (*Header, error) {
	return ParseHeader(data, int64(len(data)))
}

// File is a safetensors file mapped read-only into memory.
type File struct {
	Path   string
	Header *Header
	data   []byte // the whole file (mapped, or read on systems without mmap)
	unmap  func() error
}

// Open maps path read-only and parses its header. The caller must Close the File;
// slices returned by Bytes are valid only until then.
func Open(path string) (*File, error) {
	data, unmap, err := mapFile(path)
	if err != nil {
		return nil, fmt.Errorf("safetensors: open %s: %w", path, err)
	}
	h, err := Parse(data)
	if err != nil {
		_ = unmap()
		return nil, fmt.Errorf("%w (file %s)", err, path)
	}
	return &File{Path: path, Header: h, data: data, unmap: unmap}, nil
}

// Close unmaps the file. Calling Close twice is harmless.
func (f *File) Close() error {
	if f == nil || f.unmap == nil {
		return nil
	}
	u := f.unmap
	f.unmap, f.data = nil, nil
	return u()
}

// Info returns the description of tensor name.
func (f *File) Info(name string) (TensorInfo, bool) {
	if f == nil || f.Header == nil {
		return TensorInfo{}, false
	}
	t, ok := f.Header.Tensors[name]
	return t, ok
}

// Bytes returns the raw little-endian bytes of tensor name. The slice aliases
// the mapping: do not modify it or use it after Close.
func (f *File) Bytes(name string) ([]byte, TensorInfo, error) {
	if f == nil || f.data == nil {
		return nil, TensorInfo{}, errors.New("safetensors: Bytes on a closed File")
	}
	t, ok := f.Header.Tensors[name]
	if !ok {
		return nil, TensorInfo{}, fmt.Errorf("safetensors: tensor %q not found in %s", name, f.Path)
	}
	return f.data[f.Header.DataOffset+t.Begin : f.Header.DataOffset+t.End], t, nil
}

// Float32 converts tensor name to a new float32 slice (F32, F16, BF16 or F64 on
// disk; F16 and BF16 convert exactly, F64 rounds to nearest).
func (f *File) Float32(name string) ([]float32, TensorInfo, error) {
	b, t, err := f.Bytes(name)
	if err != nil {
		return nil, t, err
	}
	out := make([]float32, t.NumElements())
	if err := DecodeFloat32(out, b, t.DType); err != nil {
		return nil, t, fmt.Errorf("safetensors: tensor %q: %w", name, err)
	}
	return out, t, nil
}

// DecodeFloat32 converts len(dst) little-endian elements of dtype dt in src to
// float32. src must hold exactly len(dst) elements.
func DecodeFloat32(dst []float32, src []byte, dt DType) error {
	if dt.Size() == 0 || len(src) != len(dst)*dt.Size() {
		return fmt.Errorf("cannot decode %d bytes of %s into %d float32 values", len(src), dt, len(dst))
	}
	switch dt {
	case F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
		}
	case BF16:
		for i := range dst {
			dst[i] = BF16ToFloat32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case F16:
		for i := range dst {
			dst[i] = half.FromF16(binary.LittleEndian.Uint16(src[2*i:]))
		}
	case F64:
		for i := range dst {
			dst[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(src[8*i:])))
		}
	default:
		return fmt.Errorf("dtype %s is not a floating-point type (want F32, F16, BF16 or F64)", dt)
	}
	return nil
}

// BF16ToFloat32 widens a bfloat16 bit pattern to float32 (exact).
func BF16ToFloat32(b uint16) float32 { return half.FromBF16(b) }

// Float32ToBF16 rounds f to the nearest bfloat16, ties to even (as PyTorch does).
// NaN stays NaN. A value that came from a bfloat16 round-trips exactly, so
// converting weights loaded from a BF16 file back to BF16 never rounds twice.
func Float32ToBF16(f float32) uint16 { return half.BF16(f) }

// Tensor is one tensor to write.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte // little-endian, len = product(Shape) * DType.Size()
}

// FromFloat32 builds a Tensor of dtype dt (F32, F16 or BF16, rounding to nearest
// even) from float32 data laid out row-major with the given shape.
func FromFloat32(name string, dt DType, shape []int, data []float32) (Tensor, error) {
	n := 1
	for _, d := range shape {
		if d < 0 {
			return Tensor{}, fmt.Errorf("safetensors: tensor %q: negative dimension in shape %v", name, shape)
		}
		n *= d
	}
	if n != len(data) {
		return Tensor{}, fmt.Errorf("safetensors: tensor %q: shape %v needs %d values, got %d", name, shape, n, len(data))
	}
	t := Tensor{Name: name, DType: dt, Shape: append([]int(nil), shape...)}
	switch dt {
	case F32:
		t.Data = make([]byte, 4*n)
		for i, v := range data {
			binary.LittleEndian.PutUint32(t.Data[4*i:], math.Float32bits(v))
		}
	case BF16:
		t.Data = make([]byte, 2*n)
		for i, v := range data {
			binary.LittleEndian.PutUint16(t.Data[2*i:], Float32ToBF16(v))
		}
	case F16:
		t.Data = make([]byte, 2*n)
		for i, v := range data {
			binary.LittleEndian.PutUint16(t.Data[2*i:], half.F16(v))
		}
	default:
		return Tensor{}, fmt.Errorf("safetensors: tensor %q: FromFloat32 cannot write dtype %q (want F32, F16 or BF16)", name, dt)
	}
	return t, nil
}

// FromInt32 builds an I32 Tensor.
func FromInt32(name string, shape []int, data []int32) (Tensor, error) {
	n := 1
	for _, d := range shape {
		n *= d
	}
	if n != len(data) {
		return Tensor{}, fmt.Errorf("safetensors: tensor %q: shape %v needs %d values, got %d", name, shape, n, len(data))
	}
	t := Tensor{Name: name, DType: I32, Shape: append([]int(nil), shape...), Data: make([]byte, 4*n)}
	for i, v := range data {
		binary.LittleEndian.PutUint32(t.Data[4*i:], uint32(v))
	}
	return t, nil
}

// Encode serialises tensors (in the given order) and optional metadata into the
// safetensors format. The header is padded with spaces to a multiple of 8 bytes
// so that the data section is 8-byte aligned, as the reference writer does.
func Encode(tensors []Tensor, metadata map[string]string) ([]byte, error) {
	header := make(map[string]any, len(tensors)+1)
	if len(metadata) > 0 {
		header["__metadata__"] = metadata
	}
	var off int64
	for _, t := range tensors {
		if t.Name == "" || t.Name == "__metadata__" {
			return nil, fmt.Errorf("safetensors: invalid tensor name %q", t.Name)
		}
		if _, dup := header[t.Name]; dup {
			return nil, fmt.Errorf("safetensors: tensor %q appears twice", t.Name)
		}
		if t.DType.Size() == 0 {
			return nil, fmt.Errorf("safetensors: tensor %q has unsupported dtype %q", t.Name, t.DType)
		}
		n := int64(1)
		for _, d := range t.Shape {
			if d < 0 {
				return nil, fmt.Errorf("safetensors: tensor %q: negative dimension in shape %v", t.Name, t.Shape)
			}
			n *= int64(d)
		}
		if int64(len(t.Data)) != n*int64(t.DType.Size()) {
			return nil, fmt.Errorf("safetensors: tensor %q: %d data bytes, but %s%v needs %d", t.Name, len(t.Data), t.DType, t.Shape, n*int64(t.DType.Size()))
		}
		shape := t.Shape
		if shape == nil {
			shape = []int{}
		}
		header[t.Name] = map[string]any{"dtype": t.DType, "shape": shape, "data_offsets": []int64{off, off + int64(len(t.Data))}}
		off += int64(len(t.Data))
	}
	js, err := json.Marshal(header)
	if err != nil {
		return nil, fmt.Errorf("safetensors: encode header: %w", err)
	}
	for len(js)%8 != 0 {
		js = append(js, ' ')
	}
	out := make([]byte, 8, 8+int64(len(js))+off)
	binary.LittleEndian.PutUint64(out, uint64(len(js)))
	out = append(out, js...)
	for _, t := range tensors {
		out = append(out, t.Data...)
	}
	return out, nil
}

// Write writes tensors to path atomically: it writes a temporary file in the same
// directory, syncs it, and renames it over path, so a reader never sees a
// half-written file. On error the temporary file is removed.
func Write(path string, tensors []Tensor, metadata map[string]string) error {
	data, err := Encode(tensors, metadata)
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, data)
}

// WriteFileAtomic writes data to a temporary file next to path and renames it
// over path.
func WriteFileAtomic(path string, data []byte) (err error) {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err = tmp.Write(data); err != nil {
		return fmt.Errorf("safetensors: write %s: %w", path, err)
	}
	if err = tmp.Sync(); err != nil {
		return fmt.Errorf("safetensors: sync %s: %w", path, err)
	}
	if err = tmp.Close(); err != nil {
		return fmt.Errorf("safetensors: close %s: %w", path, err)
	}
	if err = os.Chmod(tmp.Name(), 0o644); err != nil {
		return fmt.Errorf("safetensors: chmod %s: %w", path, err)
	}
	if err = os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("safetensors: rename onto %s: %w", path, err)
	}
	return nil
}

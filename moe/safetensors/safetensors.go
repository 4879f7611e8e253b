// Package safetensors reads and writes the safetensors tensor file format used by
// Hugging Face checkpoints: an 8-byte little-endian header length N, N bytes of
// JSON header mapping tensor names to {dtype, shape, data_offsets}, then the raw
// little-endian tensor data. Offsets are relative to the first byte after the
// header.
//
// Parse validates everything it reads (header length, JSON, duplicate names,
// dtype, shape, offsets and sizes; the tensors must tile the data section with
// no gap, overlap or trailing bytes, as the reference implementation requires)
// and returns an error, never panics, on a corrupt file. Open reads only the
// header; each tensor is read (pread) when it is converted, so only the bytes of
// the tensors used are read from disk, and a file truncated or rewritten while
// open gives an error, never a crash (no memory mapping is involved).
//
// Nothing here touches a device: every function runs on the calling goroutine.
// A *File is safe for concurrent reads from many goroutines until Close.
package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/internal/regfile"
)

// DType is a safetensors element type, spelled as in the file header.
type DType string

// The element types of the safetensors format. Parse accepts all of them (a
// file may hold tensors a caller never uses); conversion to float32 supports
// F32, F16, BF16 and F64 only.
const (
	F64     DType = "F64"
	F32     DType = "F32"
	F16     DType = "F16"
	BF16    DType = "BF16"
	I64     DType = "I64"
	I32     DType = "I32"
	I16     DType = "I16"
	I8      DType = "I8"
	U64     DType = "U64"
	U32     DType = "U32"
	U16     DType = "U16"
	U8      DType = "U8"
	Bool    DType = "BOOL"
	F8E4M3  DType = "F8_E4M3"
	F8E5M2  DType = "F8_E5M2"
	F8E8M0  DType = "F8_E8M0"
	F6E2M3  DType = "F6_E2M3"
	F6E3M2  DType = "F6_E3M2"
	F4      DType = "F4"
	C64     DType = "C64"
	F8E4M3N DType = "F8_E4M3FNUZ"
	F8E5M2N DType = "F8_E5M2FNUZ"
)

// Bits returns the size of one element in bits, or 0 for an unknown dtype.
func (d DType) Bits() int {
	switch d {
	case F64, I64, U64, C64:
		return 64
	case F32, I32, U32:
		return 32
	case F16, BF16, I16, U16:
		return 16
	case I8, U8, Bool, F8E4M3, F8E5M2, F8E8M0, F8E4M3N, F8E5M2N:
		return 8
	case F6E2M3, F6E3M2:
		return 6
	case F4:
		return 4
	}
	return 0
}

// Size returns the size in bytes of one element, or 0 for an unknown dtype or
// one narrower than a byte (F4, F6_*).
func (d DType) Size() int {
	if b := d.Bits(); b%8 == 0 {
		return b / 8
	}
	return 0
}

// IsFloat reports whether Float32 can convert tensors of dtype d.
func (d DType) IsFloat() bool { return d == F32 || d == F16 || d == BF16 || d == F64 }

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

// objectEntries decodes a JSON object into its members in file order, refusing
// a key that appears twice (encoding/json would silently keep the last one) and
// anything after the closing brace.
func objectEntries(js []byte) ([]string, []json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(js))
	tok, err := dec.Token()
	if err != nil {
		return nil, nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, nil, errors.New("not a JSON object")
	}
	var keys []string
	var vals []json.RawMessage
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, err
		}
		k, ok := tok.(string)
		if !ok {
			return nil, nil, fmt.Errorf("object key is %v, not a string", tok)
		}
		if seen[k] {
			return nil, nil, fmt.Errorf("the name %q appears twice", k)
		}
		seen[k] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, err
		}
		keys, vals = append(keys, k), append(vals, v)
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return nil, nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, nil, errors.New("data after the closing brace of the header object")
	}
	return keys, vals, nil
}

// ParseHeader parses and validates the header of a safetensors file of fileSize
// bytes whose first bytes are prefix (prefix must hold at least the 8-byte length
// and the whole JSON header; a longer prefix, such as the whole file, is fine).
// Tensor names must be unique, and the tensors' data must tile the data section
// exactly (starting at 0, each where the previous one ends, the last at the end
// of the file), each matching dtype size times element count. A file that
// breaks a rule gets a *MalformedError (errors.Is ErrMalformed) that says what
// is wrong in the file's terms.
func ParseHeader(prefix []byte, fileSize int64) (*Header, error) {
	js, err := headerJSON(prefix, fileSize)
	if err != nil {
		return nil, err
	}
	keys, vals, err := objectEntries(js)
	if err != nil {
		return nil, jsonError(err)
	}
	h := &Header{DataOffset: 8 + int64(len(js)), Tensors: make(map[string]TensorInfo, len(keys))}
	dataSize := fileSize - h.DataOffset
	for i, name := range keys {
		if name == "__metadata__" {
			if h.Metadata, err = parseMetadata(vals[i]); err != nil {
				return nil, err
			}
			continue
		}
		t, err := parseEntry(name, vals[i], dataSize)
		if err != nil {
			return nil, err
		}
		h.Tensors[name] = t
	}
	if err := checkTiling(h.Tensors, dataSize); err != nil {
		return nil, err
	}
	return h, nil
}

// headerJSON checks the 8-byte header length against the limit and the file
// size and returns the JSON header it frames.
func headerJSON(prefix []byte, fileSize int64) ([]byte, error) {
	if len(prefix) < 8 || fileSize < 8 {
		return nil, malformed("", "file is %d bytes, shorter than the 8-byte header length", fileSize)
	}
	n := binary.LittleEndian.Uint64(prefix[:8])
	if n > MaxHeaderBytes {
		return nil, malformed("", "header length %d exceeds the %d-byte limit (corrupt or not a safetensors file)", n, MaxHeaderBytes)
	}
	if int64(n) > fileSize-8 {
		return nil, malformed("", "header length %d runs past the end of the %d-byte file", n, fileSize)
	}
	if int64(len(prefix)) < 8+int64(n) {
		return nil, fmt.Errorf("safetensors: ParseHeader: need %d header bytes, got %d", 8+n, len(prefix))
	}
	js := prefix[8 : 8+n]
	if !isJSON(js, '{') {
		return nil, malformed("", "the header is %s, not a JSON object", clip(js))
	}
	return js, nil
}

// jsonError says what is wrong with header JSON that objectEntries refused.
func jsonError(err error) error {
	var se *json.SyntaxError
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return malformed("", "header JSON ends before its closing brace (truncated header)")
	case errors.As(err, &se):
		return malformed("", "header JSON is not valid at byte %d: %v", se.Offset, err)
	}
	return malformed("", "header JSON: %v", err)
}

// parseMetadata decodes __metadata__: a JSON object of strings (or null).
func parseMetadata(raw json.RawMessage) (map[string]string, error) {
	if isJSON(raw, 'n') {
		return nil, nil
	}
	keys, vals, err := objectEntries(raw)
	if err != nil {
		return nil, malformed("", "__metadata__ is %s; it must be a JSON object of strings", clip(raw))
	}
	md := make(map[string]string, len(keys))
	for i, k := range keys {
		var v string
		if !isJSON(vals[i], '"') || json.Unmarshal(vals[i], &v) != nil {
			return nil, malformed("", "__metadata__ %q is %s; metadata values must be strings", k, clip(vals[i]))
		}
		md[k] = v
	}
	return md, nil
}

// parseEntry decodes and checks the header entry of tensor name: its dtype,
// shape and data_offsets, and that the offsets hold exactly the shape's bytes
// inside a data section of dataSize bytes.
func parseEntry(name string, raw json.RawMessage, dataSize int64) (TensorInfo, error) {
	var f map[string]json.RawMessage
	if !isJSON(raw, '{') || json.Unmarshal(raw, &f) != nil {
		return TensorInfo{}, malformed(name, "its entry is %s; it must be an object with dtype, shape and data_offsets", clip(raw))
	}
	dt, err := parseDType(name, f["dtype"])
	if err != nil {
		return TensorInfo{}, err
	}
	shape, numel, err := parseShape(name, f["shape"])
	if err != nil {
		return TensorInfo{}, err
	}
	b, en, err := parseOffsets(name, f["data_offsets"])
	if err != nil {
		return TensorInfo{}, err
	}
	if b < 0 || en < b || en > dataSize {
		return TensorInfo{}, malformed(name, "data_offsets [%d,%d] outside the %d-byte data section", b, en, dataSize)
	}
	nbits := numel * uint64(dt.Bits())
	if nbits%8 != 0 {
		return TensorInfo{}, malformed(name, "%s%v is %d bits, not a whole number of bytes", dt, shape, nbits)
	}
	if want := nbits / 8; uint64(en-b) != want {
		return TensorInfo{}, malformed(name, "data_offsets [%d,%d] hold %d data bytes, but %s%v needs %d", b, en, en-b, dt, shape, want)
	}
	return TensorInfo{Name: name, DType: dt, Shape: shape, Begin: b, End: en}, nil
}

// dtypeList names the safetensors dtypes for messages.
const dtypeList = "BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64, C64, F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F6_E2M3, F6_E3M2, F4"

// parseDType decodes a tensor's dtype field.
func parseDType(name string, raw json.RawMessage) (DType, error) {
	if raw == nil {
		return "", malformed(name, "dtype is missing; it must be a string such as \"BF16\" or \"F32\"")
	}
	var s string
	if !isJSON(raw, '"') || json.Unmarshal(raw, &s) != nil {
		return "", malformed(name, "dtype is %s; it must be a string such as \"BF16\" or \"F32\"", clip(raw))
	}
	if DType(s).Bits() == 0 {
		return "", malformed(name, "unsupported dtype %s (not a safetensors dtype; those are %s)", clip(raw), dtypeList)
	}
	return DType(s), nil
}

// parseShape decodes a tensor's shape field: whole numbers in [0, 2^31), whose
// product, times 64 bits, fits an int64. numel is the product.
func parseShape(name string, raw json.RawMessage) (shape []int, numel uint64, err error) {
	const must = "it must be a list of whole numbers, such as [2048, 1408] ([] for a scalar)"
	dims, err := wholeNumbers(name, "shape", raw, must)
	if err != nil {
		return nil, 0, err
	}
	numel = 1
	shape = make([]int, len(dims))
	for i, d := range dims {
		if d.err != nil || d.v < 0 || d.v > math.MaxInt32 {
			return nil, 0, malformed(name, "shape[%d] is %s; each dimension must be a whole number >= 0 and <= %d", i, clip(d.raw), math.MaxInt32)
		}
		hi, lo := bits.Mul64(numel, uint64(d.v))
		if hi != 0 || lo > math.MaxInt64/64 {
			return nil, 0, malformed(name, "shape %s overflows (more than 2^57 elements)", clip(raw))
		}
		numel = lo
		shape[i] = int(d.v)
	}
	return shape, numel, nil
}

// parseOffsets decodes a tensor's data_offsets field: two whole numbers.
func parseOffsets(name string, raw json.RawMessage) (begin, end int64, err error) {
	const must = "it must be [begin, end], byte offsets into the data section"
	offs, err := wholeNumbers(name, "data_offsets", raw, must)
	if err != nil {
		return 0, 0, err
	}
	if len(offs) != 2 {
		return 0, 0, malformed(name, "data_offsets has %d entries; %s", len(offs), must)
	}
	for i, o := range offs {
		if o.err != nil {
			return 0, 0, malformed(name, "data_offsets[%d] is %s; each offset must be a whole number of bytes, at most the data section's size", i, clip(o.raw))
		}
	}
	return offs[0].v, offs[1].v, nil
}

// number is one element of a JSON list that should hold whole numbers: its
// text, and its value or why it has none.
type number struct {
	raw json.RawMessage
	v   int64
	err error
}

// wholeNumbers decodes raw, field of tensor name, as a JSON list and parses
// each element as a whole number (the element's err says when it is not one:
// a fraction, an exponent, a string, out of the int64 range). must says what
// the field must be, for the message when it is missing or not a list.
func wholeNumbers(name, field string, raw json.RawMessage, must string) ([]number, error) {
	if raw == nil {
		return nil, malformed(name, "%s is missing; %s", field, must)
	}
	var elems []json.RawMessage
	if !isJSON(raw, '[') || json.Unmarshal(raw, &elems) != nil {
		return nil, malformed(name, "%s is %s; %s", field, clip(raw), must)
	}
	out := make([]number, len(elems))
	for i, e := range elems {
		out[i].raw = e
		out[i].v, out[i].err = strconv.ParseInt(string(bytes.TrimSpace(e)), 10, 64)
	}
	return out, nil
}

// checkTiling checks that the tensors tile the data section of dataSize bytes:
// no overlap, no gap, no trailing bytes. Empty tensors sit anywhere inside it.
func checkTiling(tensors map[string]TensorInfo, dataSize int64) error {
	infos := make([]TensorInfo, 0, len(tensors))
	for _, t := range tensors {
		if t.End > t.Begin {
			infos = append(infos, t)
		}
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].Begin < infos[j].Begin })
	var next int64
	prev := "the start of the data section"
	for _, t := range infos {
		switch {
		case t.Begin < next:
			return malformed("", "tensors %s and %q overlap (bytes [%d,%d) of the data section)", prev, t.Name, t.Begin, next)
		case t.Begin > next:
			return malformed("", "gap of %d unused bytes between %s and tensor %q (data_offsets must be contiguous)", t.Begin-next, prev, t.Name)
		}
		next, prev = t.End, fmt.Sprintf("%q", t.Name)
	}
	if next != dataSize {
		return malformed("", "%d unused bytes after the last tensor's data (the data section is %d bytes, the tensors cover %d)", dataSize-next, dataSize, next)
	}
	return nil
}

// ErrMalformed is matched (errors.Is) by every *MalformedError: the file is
// not a valid safetensors file.
var ErrMalformed = errors.New("malformed safetensors file")

// MalformedError is a safetensors header that breaks the format: it says what
// is wrong and what it must be, in the file's terms (tensor, field, value).
type MalformedError struct {
	Path    string // the file, set by Open ("" for bytes given to Parse)
	Tensor  string // the tensor whose entry is wrong ("" for the header as a whole)
	Problem string // what is wrong and what it must be
}

// Error reads "safetensors: <path>: tensor "<name>": <problem>", without the
// parts that are empty.
func (e *MalformedError) Error() string {
	var b strings.Builder
	b.WriteString("safetensors: ")
	if e.Path != "" {
		b.WriteString(e.Path + ": ")
	}
	if e.Tensor != "" {
		fmt.Fprintf(&b, "tensor %q: ", e.Tensor)
	}
	b.WriteString(e.Problem)
	return b.String()
}

// Is matches ErrMalformed.
func (e *MalformedError) Is(target error) bool { return target == ErrMalformed }

func malformed(tensor, format string, args ...any) error {
	return &MalformedError{Tensor: tensor, Problem: fmt.Sprintf(format, args...)}
}

// isJSON reports whether the JSON value raw starts with c ('{' an object,
// '[' a list, '"' a string, 'n' null).
func isJSON(raw []byte, c byte) bool {
	raw = bytes.TrimLeft(raw, " \t\r\n")
	return len(raw) > 0 && raw[0] == c
}

// clip returns the JSON text raw on one line, shortened to 40 bytes, for a
// message.
func clip(raw []byte) string {
	s := []rune(strings.Join(strings.Fields(string(raw)), " "))
	if len(s) > 40 {
		return string(s[:37]) + "..."
	}
	return string(s)
}

// Parse parses a whole safetensors file held in memory.
func Parse(data []byte) (*Header, error) {
	return ParseHeader(data, int64(len(data)))
}

// File is an open safetensors file whose header has been read. Tensor data is
// read from the file (pread) on demand.
type File struct {
	Path   string
	Header *Header

	mu sync.RWMutex
	f  *os.File // nil once closed
}

// Open opens path, which must be a regular file (a directory, FIFO or device is
// refused without blocking), and reads and parses its header. The caller must
// Close the File.
func Open(path string) (*File, error) {
	f, st, err := regfile.Open(path)
	if err != nil {
		return nil, fmt.Errorf("safetensors: open %s: %w", path, err)
	}
	h, err := readHeader(f, st.Size())
	if err != nil {
		_ = f.Close()
		var me *MalformedError
		if errors.As(err, &me) {
			me.Path = path
			return nil, me
		}
		return nil, fmt.Errorf("safetensors: %s: %w", path, err)
	}
	return &File{Path: path, Header: h, f: f}, nil
}

func readHeader(f *os.File, size int64) (*Header, error) {
	var lenb [8]byte
	if size < 8 {
		return nil, malformed("", "file is %d bytes, shorter than the 8-byte header length", size)
	}
	if _, err := f.ReadAt(lenb[:], 0); err != nil {
		return nil, fmt.Errorf("reading the header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenb[:])
	if n > MaxHeaderBytes || int64(n) > size-8 {
		return ParseHeader(lenb[:], size) // the error
	}
	buf := make([]byte, 8+n)
	if _, err := f.ReadAt(buf, 0); err != nil {
		return nil, fmt.Errorf("reading the %d-byte header: %w", n, err)
	}
	return ParseHeader(buf, size)
}

// Close closes the file. Calling Close twice is harmless.
func (f *File) Close() error {
	if f == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.f == nil {
		return nil
	}
	err := f.f.Close()
	f.f = nil
	return err
}

// Info returns the description of tensor name.
func (f *File) Info(name string) (TensorInfo, bool) {
	if f == nil || f.Header == nil {
		return TensorInfo{}, false
	}
	t, ok := f.Header.Tensors[name]
	return t, ok
}

// readAt fills b from file offset off; a short read (the file shrank since Open)
// is an error saying so.
func (f *File) readAt(b []byte, off int64, name string) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.f == nil {
		return errors.New("safetensors: read from a closed File")
	}
	n, err := f.f.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		return fmt.Errorf("safetensors: tensor %q: file %s ends at byte %d, before the tensor's data [%d,%d) ends: it was truncated or rewritten after it was opened; restore or re-download it", name, f.Path, off+int64(n), off, off+int64(len(b)))
	}
	return fmt.Errorf("safetensors: tensor %q: reading %s: %w", name, f.Path, err)
}

// Bytes returns the raw little-endian bytes of tensor name in a new slice.
func (f *File) Bytes(name string) ([]byte, TensorInfo, error) {
	if f == nil || f.Header == nil {
		return nil, TensorInfo{}, errors.New("safetensors: Bytes on a nil File")
	}
	t, ok := f.Header.Tensors[name]
	if !ok {
		return nil, TensorInfo{}, fmt.Errorf("safetensors: tensor %q not found in %s", name, f.Path)
	}
	b := make([]byte, t.End-t.Begin)
	if err := f.readAt(b, f.Header.DataOffset+t.Begin, name); err != nil {
		return nil, t, err
	}
	return b, t, nil
}

// ReadRaw fills dst with bytes [off, off+len(dst)) of tensor name's raw
// little-endian data (offsets relative to the tensor's first byte), with one
// pread. A range outside the tensor is an error naming it; so is a file that
// was truncated after Open. Safe for concurrent use, like every read of a File.
func (f *File) ReadRaw(name string, dst []byte, off int64) error {
	if f == nil || f.Header == nil {
		return errors.New("safetensors: ReadRaw on a nil File")
	}
	t, ok := f.Header.Tensors[name]
	if !ok {
		return fmt.Errorf("safetensors: tensor %q not found in %s", name, f.Path)
	}
	if size := t.End - t.Begin; off < 0 || off > size || int64(len(dst)) > size-off {
		return fmt.Errorf("safetensors: tensor %q: bytes [%d,%d) are outside its %d bytes (in %s)", name, off, off+int64(len(dst)), size, f.Path)
	}
	if len(dst) == 0 {
		return nil
	}
	return f.readAt(dst, f.Header.DataOffset+t.Begin+off, name)
}

// Float32 converts tensor name to a new float32 slice (F32, F16, BF16 or F64 on
// disk; F16 and BF16 convert exactly, F64 rounds to nearest). The data is read in
// chunks, so the only large allocation is the result.
func (f *File) Float32(name string) ([]float32, TensorInfo, error) {
	if f == nil || f.Header == nil {
		return nil, TensorInfo{}, errors.New("safetensors: Float32 on a nil File")
	}
	t, ok := f.Header.Tensors[name]
	if !ok {
		return nil, TensorInfo{}, fmt.Errorf("safetensors: tensor %q not found in %s", name, f.Path)
	}
	if !t.DType.IsFloat() {
		return nil, t, fmt.Errorf("safetensors: tensor %q has dtype %s, which is not a floating-point type Float32 converts (want F32, F16, BF16 or F64)", name, t.DType)
	}
	es := int64(t.DType.Size())
	out := make([]float32, t.NumElements())
	const chunk = 1 << 20 // elements per read
	buf := make([]byte, min(int64(len(out)), chunk)*es)
	for i := int64(0); i < int64(len(out)); i += chunk {
		m := min(int64(len(out))-i, chunk)
		b := buf[:m*es]
		if err := f.readAt(b, f.Header.DataOffset+t.Begin+i*es, name); err != nil {
			return nil, t, err
		}
		if err := DecodeFloat32(out[i:i+m], b, t.DType); err != nil {
			return nil, t, fmt.Errorf("safetensors: tensor %q: %w", name, err)
		}
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
	case BF16: // the hot path of loading bf16 checkpoints
		half.FromBF16Bytes(dst, src)
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

// WriteFileAtomic writes data to path atomically; see
// internal/atomicfile.WriteFile (it keeps an existing file's mode, writes a
// character device such as /dev/null through and refuses other non-regular
// targets).
//
// Deprecated: it writes any file, not only safetensors; new code should use
// internal/atomicfile.WriteFile.
func WriteFileAtomic(path string, data []byte) error {
	return atomicfile.WriteFile(path, data)
}

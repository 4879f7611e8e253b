package moe

import (
	"cmp"
	"fmt"
	"runtime"
	"slices"
	"sync/atomic"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/moe/safetensors"
	"golang.org/x/sync/errgroup"
)

// LoadLayer reads MoE layer `layer` of the checkpoint in dir (model.safetensors,
// or model.safetensors.index.json and its shards) and builds it on dev with
// options o, as NewLayer(dev, cfg, LoadWeights(dir, cfg, layer), o) does, with
// bit-identical device buffers and so identical outputs. It reads the layer's
// tensors and nothing else, and never holds the layer in float32 on the host.
//
// Like LoadWeights it first checks every tensor the layer needs against the
// headers (present, with the shape cfg wants and dtype F32, BF16 or F16, in
// the layouts LoadWeights reads), before any device memory is allocated; the
// error names the tensor, the file and what was expected, as LoadWeights'
// does. It then makes the layer's streams, events, Context and buffers as
// NewLayer does, and fills the buffers in chunks of whole rows, at most 8 MiB
// each where a row is smaller: where a tensor's dtype is the buffer's (BF16
// into a bf16 layer, F32 into an f32 layer or into the f32 correction bias)
// the file's bytes are read into a host staging buffer and copied as they
// are; otherwise each chunk is converted on the host (BF16 and F16 widen
// exactly; F32 and F16 round to the nearest bf16, ties to even, as NewLayer
// does; an F8_E4M3 weight of an FP8 checkpoint, cfg.Quant, is dequantized,
// code * scale_inv in float32). With o.FP8 the routed experts are read one
// projection at a time instead: an FP8 weight's codes and scales as stored,
// any other quantized in 128x128 blocks (fp8.Quantize). An FP8 weight's
// scales are checked with the headers (present, of the shape the config's
// blocks give, finite and positive) before anything is allocated; a NaN code
// is an error when it is read. The one difference from NewLayer: a signalling-NaN bf16 weight keeps
// its bits, where NewLayer's round trip through float32 quiets it.
//
// The chunks are read (pread) and uploaded by up to 8 goroutines (at most
// GOMAXPROCS), each with its own staging buffer (page-locked host memory from
// dev.AllocHost where that succeeds, freed before LoadLayer returns); the
// uploads are synchronous copies (Buffer.CopyFromHost) that wait for nothing
// queued on any stream, as NewLayer's are, and LoadLayer returns after the
// last one. Nothing is queued on the layer's streams. Errors name the bad
// value (see NewLayer for the options) and are prefixed "moe.LoadLayer"; on
// error everything made so far is released and the files are closed.
func LoadLayer(dev *gpuctx.Device, dir string, cfg *Config, layer int, o LayerOptions) (*Layer, error) {
	const prefix = "moe.LoadLayer"
	if dev == nil {
		return nil, fmt.Errorf("%s: nil device: %w", prefix, gpuctx.ErrInvalid)
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	if err := cfg.CheckMoELayer(layer); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	if err := checkLayerOptions(dev, cfg, o); err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	ck, err := openCheckpoint(dir)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", prefix, err)
	}
	defer ck.close()
	ll, err := resolveLayer(ck, cfg, layer)
	if err != nil {
		return nil, fmt.Errorf("%s layer %d: %w", prefix, layer, err)
	}
	if testHookResolved != nil {
		testHookResolved()
	}
	return buildLayer(prefix, dev, cfg, &fileWeights{ll: ll, cfg: cfg}, o)
}

// testHookResolved, when set (tests only), runs after LoadLayer has checked the
// headers and before it allocates anything.
var testHookResolved func()

// loadChunkBytes bounds the bytes of one read (and of one upload) of
// LoadLayer; a row of a tensor is never split.
var loadChunkBytes = 8 << 20

// loadWorkers is the number of goroutines LoadLayer reads and uploads with
// (0: min(8, GOMAXPROCS)); never more than there are chunks.
var loadWorkers = 0

// fileWeights is a weightSource over a checkpoint's tensors (LoadLayer).
type fileWeights struct {
	ll  *layerLayout
	cfg *Config
}

// source returns the tensor that holds part p (of routed expert e), its full
// name, and the row of that tensor, seen as a matrix of the part's columns, at
// which the part starts (nonzero in the fused layout only).
func (s *fileWeights) source(p weightPart, e int) (checkedTensor, string, int) {
	ll, I, H := s.ll, s.cfg.Intermediate, s.cfg.HiddenSize
	name, row := ll.name(p, e), 0
	switch {
	case ll.layout == Fused && p == wDown:
		row = e * H // [E, H, I]: H rows of I per expert
	case ll.layout == Fused && p == wGate:
		row = e * 2 * I // [E, 2I, H]: gate rows, then up rows
	case ll.layout == Fused && p == wUp:
		row = e*2*I + I
	}
	return ll.tensors[name], ll.prefix + name, row
}

// loadChunk is whole rows [r0, r1) of one weightCopy (r0, r1 counted as the
// copy's rows are), read from tensor name of t starting at row row0+r0.
type loadChunk struct {
	c      *weightCopy
	t      checkedTensor
	name   string
	row0   int
	r0, r1 int
	off    int64 // byte offset of the first row in the tensor's data
}

// dstType returns the dtype c writes: F32 or BF16.
func dstType(e *env, c *weightCopy) safetensors.DType {
	if c.f32 || e.dt == gpuctx.F32 {
		return safetensors.F32
	}
	return safetensors.BF16
}

// upload splits copies into chunks of whole rows and has up to loadWorkers
// goroutines read, convert where needed, and copy them to the device.
func (s *fileWeights) upload(l *env, copies []weightCopy) error {
	var chunks []loadChunk
	var stageMax, rawMax, tmpMax int
	for i := range copies {
		c := &copies[i]
		t, name, row0 := s.source(c.part, c.expert)
		sdt, ddt := t.info.DType, dstType(l, c)
		ses, des, w := sdt.Size(), ddt.Size(), c.c1-c.c0
		step := max(1, loadChunkBytes/max(c.cols*ses, w*des))
		for r := c.r0; r < c.r1; r += step {
			ch := loadChunk{c: c, t: t, name: name, row0: row0, r0: r, r1: min(r+step, c.r1)}
			ch.off = int64(row0+r) * int64(c.cols) * int64(ses)
			n := ch.r1 - ch.r0
			stageMax = max(stageMax, n*w*des)
			if !c.full() || sdt != ddt {
				rawMax = max(rawMax, n*c.cols*ses)
			}
			if ddt == safetensors.BF16 && sdt != safetensors.BF16 {
				tmpMax = max(tmpMax, n*w)
			}
			chunks = append(chunks, ch)
		}
	}
	if len(chunks) == 0 {
		return nil
	}
	// Read each file front to back, as far as the workers allow.
	slices.SortStableFunc(chunks, func(a, b loadChunk) int {
		return cmp.Or(cmp.Compare(a.t.f.Path, b.t.f.Path), cmp.Compare(a.t.info.Begin+a.off, b.t.info.Begin+b.off))
	})
	nw := loadWorkers
	if nw <= 0 {
		nw = min(8, runtime.GOMAXPROCS(0))
	}
	nw = max(1, min(nw, len(chunks)))
	var (
		next   atomic.Int64
		failed atomic.Bool
		g      errgroup.Group
	)
	for range nw {
		g.Go(func() error {
			wk := newLoadWorker(l.dev, stageMax, rawMax, tmpMax)
			defer wk.free()
			for !failed.Load() {
				k := int(next.Add(1)) - 1
				if k >= len(chunks) {
					return nil
				}
				if err := wk.do(l, &chunks[k]); err != nil {
					failed.Store(true)
					return err
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// loadWorker holds one goroutine's buffers: stage (what is copied to the
// device; page-locked when dev.AllocHost gave it), raw (file bytes that need
// converting or picking columns from) and tmp (float32 values being rounded
// to bf16).
type loadWorker struct {
	stage  []byte
	pinned *gpuctx.HostBuffer
	raw    []byte
	tmp    []float32
}

func newLoadWorker(dev *gpuctx.Device, stage, raw, tmp int) *loadWorker {
	wk := &loadWorker{raw: make([]byte, raw), tmp: make([]float32, tmp)}
	if hb, err := dev.AllocHost(stage); err == nil {
		wk.pinned, wk.stage = hb, hb.Bytes()
	} else {
		wk.stage = make([]byte, stage) // pageable: slower copies, same bytes
	}
	return wk
}

func (wk *loadWorker) free() {
	if wk.pinned != nil {
		_ = wk.pinned.Free()
	}
}

// do reads, converts and uploads one chunk.
func (wk *loadWorker) do(l *env, ch *loadChunk) error {
	c := ch.c
	sdt, ddt := ch.t.info.DType, dstType(l, c)
	ses, des := sdt.Size(), ddt.Size()
	rows, w := ch.r1-ch.r0, c.c1-c.c0
	out := wk.stage[:rows*w*des]
	switch {
	case ch.t.scales != nil: // FP8: dequantize the rows, keep columns [c0, c1)
		raw := wk.raw[:rows*c.cols]
		if err := ch.t.f.ReadRaw(ch.name, raw, ch.off); err != nil {
			return err
		}
		r0 := ch.row0 + ch.r0
		if err := ch.t.dequantRows(out, raw, ddt, r0, r0+rows, c.cols, c.c0, c.c1); err != nil {
			return fmt.Errorf("tensor %s (in %s): %w", ch.name, ch.t.f.Path, err)
		}
	case c.full() && sdt == ddt:
		if err := ch.t.f.ReadRaw(ch.name, out, ch.off); err != nil {
			return err
		}
	default:
		raw := wk.raw[:rows*c.cols*ses]
		if err := ch.t.f.ReadRaw(ch.name, raw, ch.off); err != nil {
			return err
		}
		if !c.full() { // keep columns [c0, c1) of each row
			for r := range rows {
				src := raw[(r*c.cols+c.c0)*ses : (r*c.cols+c.c1)*ses]
				if err := wk.convert(out[r*w*des:(r+1)*w*des], src, sdt, ddt); err != nil {
					return fmt.Errorf("tensor %s (in %s): %w", ch.name, ch.t.f.Path, err)
				}
			}
		} else if err := wk.convert(out, raw, sdt, ddt); err != nil {
			return fmt.Errorf("tensor %s (in %s): %w", ch.name, ch.t.f.Path, err)
		}
	}
	dst, err := c.dst.Slice((ch.r0-c.r0)*w*des, len(out))
	if err == nil {
		err = dst.CopyFromHost(out)
	}
	if err != nil {
		return fmt.Errorf("uploading rows [%d,%d) of tensor %s (in %s): %w", ch.row0+ch.r0, ch.row0+ch.r1, ch.name, ch.t.f.Path, err)
	}
	return nil
}

// convert writes the elements of src (dtype sdt) to dst in dtype ddt (F32 or
// BF16) with the conversions LoadWeights and NewLayer apply.
func (wk *loadWorker) convert(dst, src []byte, sdt, ddt safetensors.DType) error {
	switch {
	case sdt == ddt:
		copy(dst, src)
		return nil
	case ddt == safetensors.F32:
		return safetensors.DecodeFloat32(unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(dst))), len(dst)/4), src, sdt)
	}
	tmp := wk.tmp[:len(dst)/2]
	if err := safetensors.DecodeFloat32(tmp, src, sdt); err != nil {
		return err
	}
	h := unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(dst))), len(tmp))
	for i, v := range tmp {
		h[i] = half.BF16(v)
	}
	return nil
}

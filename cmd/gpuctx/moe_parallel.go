package main

import (
	"fmt"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
	"github.com/gpuctx/gpuctx/collective/nccl"
	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// moeParallelRun is what runMoe has loaded when it hands over to
// runMoeParallel (runMoeNCCL loads w itself).
type moeParallelRun struct {
	rt    *gpuctx.Runtime // the first runtime (closed by the caller)
	cfg   *moe.Config
	w     *moe.Weights
	layer int
	x     []float32
	T     int
	name  string
	reads []readFile
	dt    gpuctx.DType
	start time.Time
}

// openDevices returns n devices: 0..n-1 of rt when it has them, else (the
// CPU backend, one device per runtime) device 0 of n-1 more runtimes of the
// same backend, which the returned function closes.
func (a *app) openDevices(rt *gpuctx.Runtime, n int) ([]*gpuctx.Device, func(), error) {
	var extra []*gpuctx.Runtime
	closeAll := func() {
		for _, r := range extra {
			_ = r.Close()
		}
	}
	devs := make([]*gpuctx.Device, 0, n)
	if rt.DeviceCount() >= n {
		for i := range n {
			d, err := rt.Device(i)
			if err != nil {
				return nil, closeAll, fail(fmt.Sprintf("opening device %d", i), "check 'gpuctx info'", err)
			}
			devs = append(devs, d)
		}
		return devs, closeAll, nil
	}
	if rt.Backend() != "cpu" {
		return nil, closeAll, fail(fmt.Sprintf("--gpus %d, but backend %s has %d devices", n, rt.Backend(), rt.DeviceCount()),
			fmt.Sprintf("pass --gpus %d or less, or --backend cpu", rt.DeviceCount()), nil)
	}
	d, err := rt.Device(0)
	if err != nil {
		return nil, closeAll, fail("opening device 0", "check 'gpuctx info'", err)
	}
	devs = append(devs, d)
	for len(devs) < n {
		r, err := gpuctx.OpenBackend(rt.Backend())
		if err != nil {
			return nil, closeAll, fail(fmt.Sprintf("opening runtime %d of backend %s", len(devs), rt.Backend()), "", err)
		}
		extra = append(extra, r)
		if d, err = r.Device(0); err != nil {
			return nil, closeAll, fail(fmt.Sprintf("opening device 0 of runtime %d", len(devs)), "", err)
		}
		devs = append(devs, d)
	}
	return devs, closeAll, nil
}

// moeComm is how moe run joins the ranks of its layer.
type moeComm int

const (
	commNone  moeComm = iota // no communicator: the one-device Layer (--gpus 1)
	commLocal                // the in-process group, collective.Local (--gpus above 1)
	commNCCL                 // a one-rank NCCL communicator (--gpus 1 on CUDA)
)

// pickMoeComm chooses the communicator of moe run --gpus gpus on backend:
// above one device the in-process group (as before); an explicit --gpus 1
// (explicit) on CUDA runs expert parallel through a one-rank NCCL
// communicator when load (nccl.Load) finds NCCL, so that the NCCL path the
// multi-GPU layer takes can be run on one GPU; otherwise, without --gpus (the
// default: the one-device layer, with its modes and fused kernels), and with
// --trace (which traces the one-device layer's kernels), the one-device layer.
// load is called only on that CUDA path.
func pickMoeComm(backend string, gpus int, explicit, tracing bool, load func() (*nccl.Lib, error)) (moeComm, *nccl.Lib) {
	switch {
	case gpus > 1:
		return commLocal, nil
	case gpus != 1 || !explicit || backend != "cuda" || tracing:
		return commNone, nil
	}
	lib, err := load()
	if err != nil {
		return commNone, nil // no NCCL here: the one-device layer, as before
	}
	return commNCCL, lib
}

// runMoeParallel is moe run --gpus N (N > 1): the layer runs expert parallel
// over an in-process group.
func (a *app) runMoeParallel(o moeRunOpts, p moeParallelRun) error {
	devs, closeAll, err := a.openDevices(p.rt, o.gpus)
	defer closeAll()
	if err != nil {
		return err
	}
	for _, d := range devs {
		warmBlas(d)
	}
	ep, err := moe.NewExpertParallel(devs, p.cfg, p.w, p.dt)
	if err != nil {
		return fail(fmt.Sprintf("building the expert-parallel MoE layer on %d devices", o.gpus), fmt.Sprintf("--gpus may be at most the %d experts; try --dtype f32", p.cfg.NumExperts), err)
	}
	defer ep.Close()
	return a.runExpertParallel(o, p, ep, devs[0], "expert parallel")
}

// runMoeNCCL is moe run --gpus 1 on CUDA with NCCL (pickMoeComm): the layer
// runs expert parallel over a one-rank NCCL communicator on device 0.
func (a *app) runMoeNCCL(o moeRunOpts, p moeParallelRun, lib *nccl.Lib) error {
	w, err := loadLayerWeights(o.model, p.cfg, p.layer) // the shard is built from the weights on the host
	if err != nil {
		return err
	}
	p.w = w
	dev, err := p.rt.Device(0)
	if err != nil {
		return fail("opening device 0", "check 'gpuctx info'", err)
	}
	warmBlas(dev)
	id, err := lib.UniqueID()
	if err != nil {
		return fail("making an NCCL communicator id", "check the NCCL installation (NCCL_DEBUG=INFO says more)", err)
	}
	comm, err := nccl.NewComm(lib, dev, id, 1, 0)
	if err != nil {
		return fail("opening a one-rank NCCL communicator on device 0", "check the NCCL installation (NCCL_DEBUG=INFO says more)", err)
	}
	ep, err := moe.NewExpertParallelComms([]*gpuctx.Device{dev}, []collective.Comm{comm}, p.cfg, p.w, p.dt)
	if err != nil {
		return fail("building the expert-parallel MoE layer on device 0", "try --dtype f32", err)
	}
	defer ep.Close()
	return a.runExpertParallel(o, p, ep, dev, fmt.Sprintf("expert parallel over a one-rank NCCL %d communicator", lib.Version()))
}

// runExpertParallel runs ep's forward on p.x, writes y to --output and
// reports; how describes the parallel run for the summary.
func (a *app) runExpertParallel(o moeRunOpts, p moeParallelRun, ep *moe.ExpertParallel, dev *gpuctx.Device, how string) error {
	cfg, T := p.cfg, p.T
	load := time.Since(p.start)
	t0 := time.Now()
	y, err := ep.Forward(p.x, T)
	if err != nil {
		return fail("running the expert-parallel MoE layer", "try --gpus 1 to compare", err)
	}
	fwd := time.Since(t0)
	if len(y) != T*cfg.HiddenSize {
		return fail(fmt.Sprintf("the layer returned %d values for T=%d, H=%d", len(y), T, cfg.HiddenSize), "please report this with the command line", nil)
	}
	const mode = "expert-parallel"
	yt, err := safetensors.FromFloat32("y", safetensors.F32, []int{T, cfg.HiddenSize}, y)
	if err != nil {
		return fail("encoding the output", "", err)
	}
	meta := map[string]string{
		"producer": "gpuctx moe run", "model": o.model, "model_type": string(cfg.Family), "layer": fmt.Sprint(p.layer),
		"dtype": p.dt.String(), "mode": mode, "backend": dev.Backend(), "gpus": fmt.Sprint(o.gpus),
	}
	data, err := safetensors.Encode([]safetensors.Tensor{yt}, meta)
	if err != nil {
		return fail("encoding the output", "please report this with the command line", err)
	}
	if err := checkOutput("--output", o.output, p.reads); err != nil {
		return err
	}
	if err := writeOutput(o.output, data); err != nil {
		return fail(fmt.Sprintf("writing --output %s", o.output), "check that the directory is writable and has space", err)
	}
	rep := moeRunReport{Backend: dev.Backend(), Device: dev.Info().Name, Model: o.model, Family: string(cfg.Family), Layer: p.layer,
		Input: o.input, Tensor: p.name, Output: o.output, Tokens: T, Hidden: cfg.HiddenSize, DType: p.dt.String(), Mode: mode,
		LoadMS: float64(load.Microseconds()) / 1e3, ForwardMS: float64(fwd.Microseconds()) / 1e3, GPUs: o.gpus}
	if a.json {
		return a.jsonOut(rep)
	}
	fmt.Fprintf(a.out, "moe run: %s layer %d of %s on %d × %s (%s), %s\n", rep.Family, p.layer, o.model, o.gpus, rep.Device, rep.Backend, how)
	fmt.Fprintf(a.out, "input %s[%d×%d] from %s, dtype %s, experts split %s\n", p.name, T, cfg.HiddenSize, o.input, rep.DType, expertSplit(cfg.NumExperts, o.gpus))
	fmt.Fprintf(a.out, "load %.1f ms, forward %.3f ms (wall, host in/out); wrote y[%d×%d] F32 to %s\n", rep.LoadMS, rep.ForwardMS, T, cfg.HiddenSize, o.output)
	return nil
}

// expertSplit describes the ranks' expert ranges, e.g. "0-7 | 8-15".
func expertSplit(E, n int) string {
	s := ""
	for r := range n {
		lo, hi := moe.ExpertRange(E, n, r)
		if r > 0 {
			s += " | "
		}
		s += fmt.Sprintf("%d-%d", lo, hi-1)
	}
	return s
}

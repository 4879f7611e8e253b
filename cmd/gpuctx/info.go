package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
)

func init() { register(newInfoCmd) }

func newInfoCmd(a *app) *cobra.Command {
	var verbose bool
	cmd := &cobra.Command{
		Use:   "info",
		Short: "Print the backend, each device's properties and the libraries loaded",
		Long: `info opens the backend (--backend, else $GPUCTX_BACKEND, else auto), prints
every device's properties (name, compute capability, SMs, memory, L2 cache,
driver version), then checks each device by compiling and launching one kernel
(gpuctx_empty) and creating one BLAS handle through a Context, and finally lists
every library loaded with its path and version. A failed check is reported as a
line of the output; only a backend that cannot be opened fails the command.

When auto selection passes over a backend (no GPU, no driver), info says so in
one line per backend; -v prints the whole diagnosis: the loader's advice and
every path it tried.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rep, err := a.collectInfo()
			if err != nil {
				return err
			}
			if a.json {
				enc := json.NewEncoder(a.out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(rep); err != nil {
					return fail("writing the JSON report", "check that standard output is writable", err)
				}
				return nil
			}
			return rep.writeText(a.out, verbose)
		},
	}
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "print why each backend that auto selection passed over could not be opened, in full")
	return cmd
}

// infoReport is what info prints; its JSON form is the --json output.
type infoReport struct {
	Backend   string `json:"backend"`
	Selection string `json:"selection_note,omitempty"` // why auto selection did not pick CUDA, in full
	// Skipped lists the backends auto selection tried before Backend.
	Skipped   []skippedBackend `json:"skipped_backends,omitempty"`
	Devices   []deviceReport   `json:"devices"`
	Libraries []libraryReport  `json:"libraries"`
}

// skippedBackend is a backend that auto selection could not open.
type skippedBackend struct {
	Name   string `json:"name"`   // cuda or rocm
	Reason string `json:"reason"` // the diagnosis's first clause, e.g. "cannot load CUDA driver (libcuda.so.1, libcuda.so)"
	Full   string `json:"diagnosis"`
}

type deviceReport struct {
	Index             int           `json:"index"`
	Name              string        `json:"name,omitempty"`
	ComputeCapability string        `json:"compute_capability,omitempty"`
	SMs               int           `json:"sms"`
	TotalMemoryBytes  uint64        `json:"total_memory_bytes"`
	FreeMemoryBytes   uint64        `json:"free_memory_bytes"`
	L2Bytes           int           `json:"l2_bytes"`
	DriverVersion     int           `json:"driver_version"`
	FP8MMA            bool          `json:"fp8_mma"` // e4m3 tensor-core MMA: compute capability 8.9 or above
	Checks            []checkReport `json:"checks"`
	Error             string        `json:"error,omitempty"` // the device could not be opened
}

type checkReport struct {
	Name  string `json:"name"`
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

type libraryReport struct {
	Name    string `json:"name"`
	Path    string `json:"path"`
	Version string `json:"version"`
}

// collectInfo opens the runtime, inspects and checks every device, and lists
// the libraries loaded by then. Only failing to open the backend is an error.
func (a *app) collectInfo() (*infoReport, error) {
	rt, err := a.openRuntime()
	if err != nil {
		return nil, err
	}
	defer rt.Close()
	rep := &infoReport{Backend: rt.Backend(), Selection: oneLine(rt.SelectionNote()), Skipped: skippedBackends(rt.SelectionNote()),
		Devices: []deviceReport{}, Libraries: []libraryReport{}}
	for i := range rt.DeviceCount() {
		dr := deviceReport{Index: i, Checks: []checkReport{}}
		dev, err := rt.Device(i)
		if err != nil {
			dr.Error = oneLine(err.Error())
			rep.Devices = append(rep.Devices, dr)
			continue
		}
		info := dev.Info()
		dr.Name, dr.SMs, dr.TotalMemoryBytes, dr.L2Bytes, dr.DriverVersion =
			info.Name, info.SMCount, info.TotalMemory, info.L2Bytes, info.DriverVersion
		if info.ComputeMajor > 0 {
			dr.ComputeCapability = fmt.Sprintf("%d.%d", info.ComputeMajor, info.ComputeMinor)
		}
		dr.FP8MMA = hasFP8MMA(info.ComputeMajor, info.ComputeMinor)
		free, _, err := dev.MemInfo()
		dr.FreeMemoryBytes = free
		dr.Checks = append(dr.Checks,
			newCheck("memory info", err),
			newCheck("kernel gpuctx_empty (compile and launch)", checkKernel(dev)),
			newCheck("BLAS handle (Context.Blas)", checkBlas(dev)))
		rep.Devices = append(rep.Devices, dr)
	}
	for _, l := range rt.Libraries() {
		rep.Libraries = append(rep.Libraries, libraryReport{Name: l.Name, Path: l.Path, Version: l.Version})
	}
	return rep, nil
}

func newCheck(name string, err error) checkReport {
	if err != nil {
		return checkReport{Name: name, Error: oneLine(err.Error())}
	}
	return checkReport{Name: name, OK: true}
}

// checkKernel compiles (on CUDA, with NVRTC) and launches gpuctx_empty on a new
// stream and waits for it.
func checkKernel(dev *gpuctx.Device) error {
	k, err := dev.Kernel("gpuctx_empty")
	if err != nil {
		return err
	}
	s, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return err
	}
	one := gpuctx.Dim3{X: 1, Y: 1, Z: 1}
	err = s.Launch(k, one, one, 0)
	if err == nil {
		err = s.Synchronize()
	}
	if cerr := s.Close(); err == nil {
		err = cerr
	}
	return err
}

// checkBlas creates a Context and runs one BLAS callback, which creates a BLAS
// handle (on CUDA this loads cuBLAS) and binds it to the Context's stream.
func checkBlas(dev *gpuctx.Device) error {
	ctx, err := dev.NewContext(gpuctx.ContextOptions{})
	if err != nil {
		return err
	}
	err = ctx.Blas(func(gpuctx.Blas) error { return nil })
	if cerr := ctx.Close(); err == nil {
		err = cerr
	}
	return err
}

// skippedMarkers start each backend's part of Runtime.SelectionNote: "...
// because CUDA is unavailable: <error>\nand ROCm is unavailable: <error>".
var skippedMarkers = []struct{ marker, name string }{
	{"because CUDA is unavailable: ", "cuda"},
	{"\nand ROCm is unavailable: ", "rocm"},
}

// skippedBackends splits a selection note into one entry per backend that
// auto selection could not open. A note in another shape is one entry named
// "auto" holding all of it, so nothing is lost.
func skippedBackends(note string) []skippedBackend {
	if note == "" {
		return nil
	}
	type part struct {
		name       string
		start, end int
	}
	var parts []part
	for _, m := range skippedMarkers {
		if i := strings.Index(note, m.marker); i >= 0 {
			if n := len(parts); n > 0 && parts[n-1].end > i {
				parts[n-1].end = i
			}
			parts = append(parts, part{m.name, i + len(m.marker), len(note)})
		}
	}
	var out []skippedBackend
	for _, p := range parts {
		full := strings.TrimSpace(strings.TrimPrefix(note[p.start:p.end], p.name+": backend unavailable: "))
		out = append(out, skippedBackend{Name: p.name, Reason: firstClause(full), Full: full})
	}
	if len(out) == 0 {
		out = append(out, skippedBackend{Name: "auto", Reason: firstClause(note), Full: note})
	}
	return out
}

// firstClause is a diagnosis up to its first ": " outside parentheses,
// without a leading "dynload: ": what failed, without the advice and the
// paths tried.
func firstClause(s string) string {
	s = strings.TrimPrefix(oneLine(s), "dynload: ")
	depth := 0
	for i, r := range s {
		switch {
		case r == '(':
			depth++
		case r == ')':
			depth--
		case r == ':' && depth == 0 && strings.HasPrefix(s[i:], ": "):
			return s[:i]
		}
	}
	return s
}

func (r *infoReport) writeText(w io.Writer, verbose bool) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "backend:\t%s\n", r.Backend)
	for _, s := range r.Skipped {
		if !verbose {
			fmt.Fprintf(tw, "  not %s:\t%s (-v: why)\n", s.Name, s.Reason)
			continue
		}
		lines := strings.Split(s.Full, "\n")
		fmt.Fprintf(tw, "  not %s:\t%s\n", s.Name, lines[0])
		for _, l := range lines[1:] {
			fmt.Fprintf(tw, "    %s\n", l) // no tab: keeps the columns narrow
		}
	}
	fmt.Fprintf(tw, "devices:\t%d\n", len(r.Devices))
	for _, d := range r.Devices {
		fmt.Fprintf(tw, "device %d:\t%s\n", d.Index, orDash(d.Name))
		if d.Error != "" {
			fmt.Fprintf(tw, "  error:\t%s\n", d.Error)
			continue
		}
		fmt.Fprintf(tw, "  compute capability:\t%s\n", orDash(d.ComputeCapability))
		fmt.Fprintf(tw, "  FP8 MMA:\t%s\n", fp8MMAText(r.Backend, d))
		fmt.Fprintf(tw, "  SMs:\t%d\n", d.SMs)
		fmt.Fprintf(tw, "  memory:\t%s total, %s free\n", mib(d.TotalMemoryBytes), mib(d.FreeMemoryBytes))
		l2 := "-"
		if d.L2Bytes > 0 {
			l2 = fmt.Sprintf("%d KiB", d.L2Bytes>>10)
		}
		fmt.Fprintf(tw, "  L2 cache:\t%s\n", l2)
		drv := "-"
		if d.DriverVersion > 0 {
			drv = fmt.Sprintf("%d.%d (%d)", d.DriverVersion/1000, d.DriverVersion%1000/10, d.DriverVersion)
		}
		fmt.Fprintf(tw, "  driver version:\t%s\n", drv)
		for _, c := range d.Checks {
			res := "ok"
			if !c.OK {
				res = "FAILED: " + c.Error
			}
			fmt.Fprintf(tw, "  check: %s: %s\n", c.Name, res) // no tab: keeps the columns above narrow
		}
	}
	fmt.Fprintf(tw, "libraries:\t%d\n", len(r.Libraries))
	for _, l := range r.Libraries {
		path := l.Path
		if path == "" {
			path = "(built in)"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", l.Name, orDash(l.Version), path)
	}
	if err := tw.Flush(); err != nil {
		return fail("writing the report", "check that standard output is writable", err)
	}
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func mib(b uint64) string { return fmt.Sprintf("%d MiB", b>>20) }

// hasFP8MMA reports whether a GPU of compute capability major.minor has
// FP8 (e4m3) tensor-core MMA: 8.9 (Ada) and above.
func hasFP8MMA(major, minor int) bool { return major > 8 || (major == 8 && minor >= 9) }

// fp8MMAText says whether d has FP8 MMA and what --dtype fp8 runs there.
func fp8MMAText(backend string, d deviceReport) string {
	var major, minor int
	_, _ = fmt.Sscanf(d.ComputeCapability, "%d.%d", &major, &minor)
	switch {
	case d.FP8MMA && major == 9 && minor == 0:
		return "yes (compute capability 9.0); moe --dtype fp8 runs its w8a16 tiles, and w8a8 (FP8 x FP8 wgmma) tiles for large batches"
	case d.FP8MMA:
		return "yes (compute capability 8.9+); moe --dtype fp8 runs its w8a16 tiles"
	case backend == "cpu":
		return "no (CPU backend: moe --dtype fp8 runs the FP8 kernels' Go twins)"
	case major >= 8:
		return "no (needs compute capability 8.9); moe --dtype fp8 still runs (w8a16: bf16 MMA)"
	}
	return "no (needs compute capability 8.9)"
}

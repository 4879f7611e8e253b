package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
)

// The peer of moe bench: vLLM's Triton fused MoE rebuilt standalone
// (bench/peers/triton_fused_moe.py; torch + triton, CUDA only). It prints
// progress lines and one JSON object per token count on stdout, and a last
// line "PASS: ..." or "FAIL: ..."; it exits non-zero when a token count
// failed its check. It draws its weights from N(0, 0.02²) (moe.InitNormal),
// rotates --sets weight and input sets, and runs vLLM's tuned tile table
// where vLLM ships one for the shape (its "graph tuned" mode).
//
// bench/peers/triton_fused_moe_fp8.py is the same peer with the routed
// experts in vLLM's fp8_w8a8 path with 128x128 block scales (the peer of
// --dtype fp8): the same command line and output. Which precision a peer ran
// is what its "env: {...}" line says in "dtype" ("bf16" or "fp8"); a peer
// whose env line has no "dtype" ran bf16 (the bf16 peer predates the field).
const (
	PeerName          = "vLLM Triton fused MoE"
	PeerDefaultScript = "bench/peers/triton_fused_moe.py"
	PeerFP8Script     = "bench/peers/triton_fused_moe_fp8.py"
	// peerEnvDefaultDType is the precision of a peer whose env line names none.
	peerEnvDefaultDType = "bf16"
)

// peerScripts names the peer script of each --dtype that has one.
var peerScripts = map[string]string{"bf16": PeerDefaultScript, "fp8": PeerFP8Script}

// PeerPresets maps gpuctx preset names to the peer's --preset names.
var PeerPresets = map[string]string{
	"deepseek-v2-lite": "deepseek-v2-lite",
	"qwen1.5-moe":      "qwen1.5-moe",
	"qwen3-30b-a3b":    "qwen3-30b-a3b",
	"deepseek-v3":      "deepseek-v3",
}

// PeerSets is the number of weight sets the peer rotates by default for a
// preset (3; 2 for deepseek-v3, whose set is 22.5 GB); a fair comparison
// rotates as many in gpuctx.
func PeerSets(preset string) int {
	if preset == "deepseek-v3" {
		return 2
	}
	return 3
}

// PeerReport describes the peer runs of a bench (nil: no peer).
type PeerReport struct {
	Name       string   `json:"name"`
	Script     string   `json:"script"`
	Python     string   `json:"python"`
	Preset     string   `json:"preset"`
	Command    string   `json:"command"`
	OK         bool     `json:"ok"`
	Error      string   `json:"error,omitempty"`
	Runs       int      `json:"runs"`                  // peer invocations (one per round while it passes)
	DType      string   `json:"dtype,omitempty"`       // the precision the peer ran, from its env line; "" if no run printed one
	MinSpeedup *float64 `json:"min_speedup,omitempty"` // over token counts, of the median per token count
	MaxSpeedup *float64 `json:"max_speedup,omitempty"`
}

// PeerRow is what the bench keeps of one of the peer's JSON lines.
type PeerRow struct {
	Tokens        int
	OK            bool
	US            map[string]float64 // per mode (see peerModeName)
	ActiveExperts *float64           // distinct experts its batches touched, mean over its sets
	Errors        []string
}

// peerModeName names the peer's timing field f ("graph_dual_us"): eager,
// graph single, graph dual, graph tuned, ...; "" for a field that is not a
// timing of the layer (floor_us, compute_floor_us, anything not *_us).
func peerModeName(f string) string {
	base, ok := strings.CutSuffix(f, "_us")
	switch {
	case !ok:
		return ""
	case base == "eager":
		return "eager"
	case base == "graph":
		return "graph single"
	case strings.HasPrefix(base, "graph_"):
		return "graph " + strings.ReplaceAll(strings.TrimPrefix(base, "graph_"), "_", " ")
	}
	return ""
}

// parsePeerLine parses one JSON line of the peer. A timing of another tile
// config (graph_tuned_us) counts only if that config passed its check
// (ok_tuned is not false); null timings are left out.
func parsePeerLine(line []byte) (PeerRow, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(line, &m); err != nil {
		return PeerRow{}, err
	}
	var r PeerRow
	if err := json.Unmarshal(m["tokens"], &r.Tokens); err != nil || r.Tokens < 1 {
		return PeerRow{}, fmt.Errorf("no token count in %.80s", line)
	}
	_ = json.Unmarshal(m["ok"], &r.OK)
	_ = json.Unmarshal(m["errors"], &r.Errors)
	_ = json.Unmarshal(m["active_experts"], &r.ActiveExperts)
	r.US = map[string]float64{}
	for k, raw := range m {
		name := peerModeName(k)
		if name == "" {
			continue
		}
		if cfg, other := strings.CutPrefix(strings.TrimSuffix(k, "_us"), "graph_"); other && cfg != "dual" {
			var ok *bool
			if json.Unmarshal(m["ok_"+cfg], &ok) == nil && ok != nil && !*ok {
				continue
			}
		}
		var v *float64
		if err := json.Unmarshal(raw, &v); err != nil || v == nil || !(*v > 0) || math.IsInf(*v, 0) {
			continue
		}
		r.US[name] = *v
	}
	return r, nil
}

// best returns the fastest mode of r.
func (r PeerRow) best() (string, float64, bool) {
	names := make([]string, 0, len(r.US))
	for k := range r.US {
		names = append(names, k)
	}
	sort.Strings(names) // ties: a stable choice
	mode, us := "", 0.0
	for _, k := range names {
		if mode == "" || r.US[k] < us {
			mode, us = k, r.US[k]
		}
	}
	return mode, us, mode != ""
}

// peerOutput is what readPeerOutput found on the peer's stdout.
type peerOutput struct {
	rows    map[int]PeerRow
	verdict string   // the last "PASS: ..." or "FAIL: ..." line
	fails   []string // every line starting with FAIL
	sets    int      // the weight sets it rotated ("weights: N set(s) ..."), 0: not said
	dtype   string   // the precision its env line names (see peerEnvDType), "": no env line
}

// peerEnvDType returns the precision the peer's env line (the JSON after
// "env: ") names in "dtype", peerEnvDefaultDType if it names none, and ""
// if the line is not a JSON object.
func peerEnvDType(env string) string {
	var e struct {
		DType string `json:"dtype"`
	}
	if json.Unmarshal([]byte(env), &e) != nil {
		return ""
	}
	if e.DType == "" {
		return peerEnvDefaultDType
	}
	return e.DType
}

// readPeerOutput reads the peer's stdout: JSON lines (starting with '{') are
// parsed, every other line is copied to progress with a "peer: " prefix as it
// comes.
func readPeerOutput(r io.Reader, progress io.Writer) (peerOutput, error) {
	out := peerOutput{rows: map[int]PeerRow{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		line := bytes.TrimSpace(sc.Bytes())
		if bytes.HasPrefix(line, []byte("{")) {
			row, err := parsePeerLine(line)
			if err != nil {
				return out, fmt.Errorf("unreadable JSON line from the peer: %w", err)
			}
			out.rows[row.Tokens] = row
			continue
		}
		s := string(line)
		fmt.Fprintf(progress, "peer: %s\n", s)
		var n int
		if _, err := fmt.Sscanf(s, "weights: %d set(s)", &n); err == nil {
			out.sets = n
		}
		if env, ok := strings.CutPrefix(s, "env: "); ok {
			if d := peerEnvDType(env); d != "" {
				out.dtype = d
			}
		}
		if strings.HasPrefix(s, "PASS") || strings.HasPrefix(s, "FAIL: ") {
			out.verdict = s
		}
		if strings.HasPrefix(s, "FAIL") {
			out.fails = append(out.fails, s)
		}
	}
	return out, sc.Err()
}

// PeerRun is what one run of the peer gave: its passing rows, the number of
// weight sets it said it rotated (0: it did not say) and the precision its
// env line named ("": it printed none).
type PeerRun struct {
	Rows  map[int]PeerRow
	Sets  int
	DType string
}

// runPeer runs the peer script with python, its stderr streamed to errOut and
// its stdout's progress lines copied there too, and returns what it gave. err
// says why the peer failed: python or the script missing, a non-zero exit, a
// FAIL verdict, a token count without a passing row; the rows hold whatever
// passed.
func runPeer(ctx context.Context, python string, args []string, tokens []int, errOut io.Writer) (PeerRun, error) {
	exe, err := exec.LookPath(python)
	if err != nil {
		return PeerRun{}, fmt.Errorf("--peer-python %s: %w", python, err)
	}
	// the peer's stderr (copied by exec's goroutine) and its progress lines
	// (copied here) go to the same writer
	errOut = &lockedWriter{w: errOut}
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), "PYTHONUNBUFFERED=1")
	cmd.Stderr = errOut
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return PeerRun{}, err
	}
	if err := cmd.Start(); err != nil {
		return PeerRun{}, fmt.Errorf("starting %s: %w", python, err)
	}
	out, rerr := readPeerOutput(stdout, errOut)
	if rerr != nil {
		_, _ = io.Copy(io.Discard, stdout)
	}
	werr := cmd.Wait()
	rows, err := judgePeer(out, tokens, werr, rerr)
	return PeerRun{Rows: rows, Sets: out.sets, DType: out.dtype}, err
}

// PeerDTypeNote returns the report's note when the peer ran another
// precision (peer, from its env line) than gpuctx (ours, the report's
// dtype: bf16, f32 or fp8), naming the peer script of ours where there is
// one; "" when they match or the peer's is unknown.
func PeerDTypeNote(ours, peer string) string {
	if peer == "" || peer == ours {
		return ""
	}
	s := fmt.Sprintf("the peer runs %s weights while gpuctx runs %s: the comparison is not like for like", peer, ours)
	if script, ok := peerScripts[ours]; ok {
		s += fmt.Sprintf(" (the %s peer is --peer %s)", ours, script)
	}
	return s
}

// PeerDTypeText describes the precision a peer ran, for the report.
func PeerDTypeText(dtype string) string {
	switch dtype {
	case "":
		return "precision not reported"
	case "fp8":
		return "fp8 weights (w8a8, 128x128 block scales)"
	}
	return dtype + " weights"
}

// judgePeer returns the passing rows of out for tokens, and an error that
// says why the peer failed (exit status, unreadable output, its FAIL lines,
// else the token counts without a passing row), or nil.
func judgePeer(out peerOutput, tokens []int, werr, rerr error) (map[int]PeerRow, error) {
	rows := map[int]PeerRow{}
	var bad []string
	for _, T := range tokens {
		r, ok := out.rows[T]
		switch {
		case !ok:
			bad = append(bad, fmt.Sprintf("no result for %d tokens", T))
		case !r.OK:
			why := "its check failed"
			if len(r.Errors) > 0 {
				why = strings.Join(r.Errors, "; ")
			}
			bad = append(bad, fmt.Sprintf("%d tokens: %s", T, why))
		case len(r.US) == 0:
			bad = append(bad, fmt.Sprintf("%d tokens: no timing", T))
		default:
			rows[T] = r
		}
	}
	var why []string
	if werr != nil {
		var ee *exec.ExitError
		if errors.As(werr, &ee) {
			why = append(why, fmt.Sprintf("exit status %d", ee.ExitCode()))
		} else {
			why = append(why, werr.Error())
		}
	}
	if rerr != nil {
		why = append(why, rerr.Error())
	}
	// the peer's own FAIL lines say why a token count failed; without them,
	// say which token counts have no passing row
	why = append(why, out.fails...)
	if len(out.fails) == 0 {
		why = append(why, bad...)
	}
	if len(why) > 0 {
		return rows, errors.New(strings.Join(why, "; "))
	}
	return rows, nil
}

// lockedWriter serialises writes to w.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

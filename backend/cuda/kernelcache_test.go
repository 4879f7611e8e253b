package cuda

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
)

// fakeCompiler counts calls and returns an image derived from its name.
type fakeCompiler struct {
	calls atomic.Int64
	img   []byte
	ptx   bool
}

func (f *fakeCompiler) compile() ([]byte, bool, error) {
	f.calls.Add(1)
	return append([]byte(nil), f.img...), f.ptx, nil
}

func TestKernelCacheKey(t *testing.T) {
	opts := compileOptions("sm_90")
	base := kernelCacheKey("moe.cu", "src", opts, "sm_90", "13.0")
	if len(base) != 64 {
		t.Fatalf("key %q is not hex SHA-256", base)
	}
	if again := kernelCacheKey("moe.cu", "src", compileOptions("sm_90"), "sm_90", "13.0"); again != base {
		t.Fatal("the same inputs give different keys")
	}
	for name, k := range map[string]string{
		"source":   kernelCacheKey("moe.cu", "src2", opts, "sm_90", "13.0"),
		"file":     kernelCacheKey("basic.cu", "src", opts, "sm_90", "13.0"),
		"options":  kernelCacheKey("moe.cu", "src", append(opts[:len(opts):len(opts)], "-lineinfo"), "sm_90", "13.0"),
		"arch":     kernelCacheKey("moe.cu", "src", opts, "sm_100", "13.0"),
		"nvrtc":    kernelCacheKey("moe.cu", "src", opts, "sm_90", "12.8"),
		"boundary": kernelCacheKey("moe.c", "usrc", opts, "sm_90", "13.0"), // parts are length-prefixed
	} {
		if k == base {
			t.Errorf("changing the %s does not change the key", name)
		}
	}
}

func TestKernelCacheHitMissCorrupt(t *testing.T) {
	c := diskCache{dir: filepath.Join(t.TempDir(), "a", "b")} // made on first store
	f := &fakeCompiler{img: []byte("CUBIN image bytes"), ptx: false}
	key := kernelCacheKey("moe.cu", "src", nil, "sm_90", "13.0")
	check := func(wantDisk bool, wantCalls int64) {
		t.Helper()
		img, ptx, disk, err := c.compileCached(key, f.compile)
		if err != nil || !bytes.Equal(img, f.img) || ptx != f.ptx || disk != wantDisk || f.calls.Load() != wantCalls {
			t.Fatalf("got %q ptx=%v disk=%v err=%v after %d compiles; want the image, disk=%v, %d compiles",
				img, ptx, disk, err, f.calls.Load(), wantDisk, wantCalls)
		}
	}
	check(false, 1) // miss: compiled and stored
	check(true, 1)  // hit
	path := c.path(key)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o644 {
		t.Errorf("entry mode %v, want 0644", fi.Mode().Perm())
	}
	corrupt := map[string][]byte{
		"empty":        {},
		"short header": data[:10],
		"truncated":    data[:len(data)-3],
		"flipped byte": func() []byte { d := bytes.Clone(data); d[len(d)-1] ^= 1; return d }(),
		"bad magic":    func() []byte { d := bytes.Clone(data); d[0] = 'X'; return d }(),
		"bad kind":     func() []byte { d := bytes.Clone(data); d[len(kernelCacheMagic)] = 7; return d }(),
		"longer":       append(bytes.Clone(data), 0),
	}
	n := f.calls.Load()
	for name, d := range corrupt {
		t.Run(name, func(t *testing.T) {
			if err := os.WriteFile(path, d, 0o644); err != nil {
				t.Fatal(err)
			}
			n++
			check(false, n) // ignored and recompiled...
			if got, _ := os.ReadFile(path); !bytes.Equal(got, data) {
				t.Fatal("the corrupt entry was not rewritten")
			}
			check(true, n) // ...and rewritten
		})
	}
	// PTX round-trips its kind.
	p := &fakeCompiler{img: []byte(".version 8.0\x00"), ptx: true}
	k2 := kernelCacheKey("basic.cu", "src", nil, "sm_200", "13.0")
	for i, want := range []bool{false, true} {
		img, ptx, disk, err := c.compileCached(k2, p.compile)
		if err != nil || !ptx || disk != want || !bytes.Equal(img, p.img) {
			t.Fatalf("PTX call %d: ptx=%v disk=%v err=%v", i, ptx, disk, err)
		}
	}
	// No temporary files are left behind.
	ents, _ := os.ReadDir(c.dir)
	if len(ents) != 2 {
		t.Errorf("cache holds %d files, want 2 entries", len(ents))
	}
}

func TestKernelCacheDisabled(t *testing.T) {
	home := t.TempDir()
	for _, tc := range []struct {
		env, want string
	}{
		{"off", ""}, {"OFF", ""}, {" off ", ""},
		{"/some/dir", "/some/dir"},
	} {
		got := kernelCacheFromEnv(func(k string) string {
			if k == KernelCacheEnv {
				return tc.env
			}
			return ""
		})
		if got.dir != tc.want {
			t.Errorf("GPUCTX_KERNEL_CACHE=%q: dir %q, want %q", tc.env, got.dir, tc.want)
		}
	}
	t.Setenv("XDG_CACHE_HOME", home)
	t.Setenv("HOME", home)
	if got, want := kernelCacheFromEnv(func(string) string { return "" }).dir, filepath.Join(home, "gpuctx", "kernels"); got != want {
		// os.UserCacheDir differs off Linux; only its suffix is ours.
		if filepath.Base(filepath.Dir(got)) != "gpuctx" || filepath.Base(got) != "kernels" {
			t.Errorf("default dir %q, want %q", got, want)
		}
	}
	// A disabled cache compiles every time and writes nothing.
	f := &fakeCompiler{img: []byte("img")}
	var off diskCache
	for i := 1; i <= 2; i++ {
		if _, _, disk, err := off.compileCached("k", f.compile); err != nil || disk || f.calls.Load() != int64(i) {
			t.Fatalf("disabled cache: disk=%v err=%v compiles=%d", disk, err, f.calls.Load())
		}
	}
	// An unwritable directory is not an error.
	ro := diskCache{dir: filepath.Join(home, "file")}
	if err := os.WriteFile(ro.dir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if img, _, _, err := ro.compileCached("k", f.compile); err != nil || string(img) != "img" {
		t.Fatalf("cache dir that is a file: %q, %v", img, err)
	}
}

// Goroutines sharing one directory (as processes do) always get a whole,
// correct image, whoever wrote the entry and whenever.
func TestKernelCacheConcurrent(t *testing.T) {
	dir := t.TempDir()
	const workers, keys, rounds = 8, 4, 20
	var wg sync.WaitGroup
	errs := make(chan error, workers*keys*rounds)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := diskCache{dir: dir} // each worker its own value, as each process would
			for r := range rounds {
				k := (w + r) % keys
				want := bytes.Repeat([]byte{byte('a' + k)}, 4096+k)
				f := &fakeCompiler{img: want}
				key := kernelCacheKey(fmt.Sprint(k), "src", nil, "sm_90", "13.0")
				img, _, _, err := c.compileCached(key, f.compile)
				if err != nil || !bytes.Equal(img, want) {
					errs <- fmt.Errorf("worker %d round %d key %d: %d bytes, err %v", w, r, k, len(img), err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != keys {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("cache holds %v, want %d entries and no temporary files", names, keys)
	}
}

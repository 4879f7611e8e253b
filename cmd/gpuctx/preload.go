package main

import (
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx/backend/cuda/cublas"
)

// blasPreload is the cuBLAS library loaded in the background by
// startBlasPreload (nil: not started, or it failed).
var blasPreload struct {
	mu   sync.Mutex
	done chan *cublas.Lib
}

// startBlasPreload starts loading cuBLAS (dlopen of libcublas and
// libcublasLt, about 80 ms on the H200 machine) in a goroutine when backend
// name may open CUDA, so that it overlaps the driver's initialisation instead
// of delaying the first BLAS handle. The library is reference counted: the
// backend's own load then finds it mapped. A failure is left for the backend
// to report. releaseBlasPreload drops the reference.
func startBlasPreload(name string) {
	if n := strings.ToLower(strings.TrimSpace(name)); n != "auto" && n != "cuda" {
		return
	}
	blasPreload.mu.Lock()
	defer blasPreload.mu.Unlock()
	if blasPreload.done != nil {
		return
	}
	done := make(chan *cublas.Lib, 1)
	blasPreload.done = done
	go func() {
		l, err := cublas.Load()
		if err != nil {
			l = nil
		}
		done <- l
	}()
}

// releaseBlasPreload waits for startBlasPreload's load (if started) and
// drops its reference to the library, after the command has closed its
// runtime.
func releaseBlasPreload() {
	blasPreload.mu.Lock()
	done := blasPreload.done
	blasPreload.done = nil
	blasPreload.mu.Unlock()
	if done == nil {
		return
	}
	if l := <-done; l != nil {
		_ = l.Close()
	}
}

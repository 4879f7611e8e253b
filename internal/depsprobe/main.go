package main
import (
 _ "github.com/ebitengine/purego"
 _ "gonum.org/v1/gonum/blas/gonum"
 _ "github.com/spf13/cobra"
 _ "github.com/schollz/progressbar/v3"
 _ "golang.org/x/sys/unix"
 _ "github.com/x448/float16"
 _ "gonum.org/v1/plot"
)
func main(){}

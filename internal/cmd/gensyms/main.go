// Command gensyms generates a purego function table from C prototypes.
//
// It reads a spec file of C declarations as they appear in a library header
// (cuda.h), one per line, each optionally followed by a comment of annotations:
//
//	CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
//	CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end); // optional field=cuEventElapsedTimeV2 -- CUDA >= 12.8
//
// Annotations: "optional" (loading does not fail when the symbol is missing),
// "field=NAME" (the Go field name; default: the symbol without a trailing _v2),
// "functype=NAME" (the field's type is the named func type NAME, generated from
// the first declaration that names it; every other one must have the same Go
// signature), "PARAM=GOTYPE" (the Go type of one parameter, where the C type
// alone does not say it, e.g. a device pointer or an in-array of pointers).
// Text after "--" becomes the field's comment. Lines starting with "//" are
// copied as comments; blank lines separate groups; lines starting with "#" are
// ignored. A parameter declared as an array (T name[]) is a pointer to T.
//
// Directives start with "@":
//
//	@type NAME          the declarations after it go in the struct type NAME
//	                    ("//" lines right before it are the type's doc comment);
//	                    those before the first @type go in the -type struct
//	@map CTYPE GOTYPE   map the C type CTYPE (may contain spaces) to GOTYPE in
//	                    the declarations after it, over typeMap
//
// It writes a Go file with one struct type of func fields per @type (the C
// types mapped as listed in typeMap) and, for each, a symbols method returning
// the []dynload.Symbol table that binds them. Run it through go generate (see
// backend/cuda/driver.go and backend/cuda/cublas/symbols.go).
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"go/format"
	"go/token"
	"go/types"
	"io"
	"os"
	"regexp"
	"strings"
)

func main() {
	spec := flag.String("spec", "", "spec file of C declarations")
	out := flag.String("out", "", "Go file to write")
	pkg := flag.String("pkg", "", "package name of the output")
	typ := flag.String("type", "", "name of the struct type of the declarations before the first @type")
	flag.Parse()
	if *spec == "" || *out == "" || *pkg == "" {
		flag.Usage()
		os.Exit(2)
	}
	f, err := os.Open(*spec)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gensyms:", err)
		os.Exit(1)
	}
	defer f.Close()
	src, err := generate(f, *spec, *pkg, *typ)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gensyms:", err)
		os.Exit(1)
	}
	if err := os.WriteFile(*out, src, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "gensyms:", err)
		os.Exit(1)
	}
}

// typeMap maps C types (spaces normalised, const dropped) to Go types. A
// pointer to a mapped type maps to a pointer to its Go type.
var typeMap = map[string]string{
	"CUresult":             "int32",
	"CUdevice":             "int32",
	"int":                  "int32",
	"CUdevice_attribute":   "int32",
	"CUfunction_attribute": "int32",
	"CUstreamCaptureMode":  "int32",
	"unsigned int":         "uint32",
	"unsigned char":        "uint8",
	"unsigned long long":   "uint64",
	"float":                "float32",
	"size_t":               "uintptr",
	"CUdeviceptr":          "uintptr",
	"CUcontext":            "uintptr",
	"CUstream":             "uintptr",
	"CUevent":              "uintptr",
	"CUmodule":             "uintptr",
	"CUfunction":           "uintptr",
	"CUgraph":              "uintptr",
	"CUgraphExec":          "uintptr",
	"ncclResult_t":         "int32",
	"ncclComm_t":           "uintptr",
	"ncclDataType_t":       "int32",
	"ncclUniqueId":         "ncclUniqueID", // a [128]byte struct, defined by package nccl
	"cudaStream_t":         "uintptr",
	"void *":               "unsafe.Pointer", // host memory
	"char *":               "*byte",          // an out-buffer of characters
	"const char *":         "string",         // an in-string (purego passes a NUL-terminated copy)
	"const char **":        "**byte",         // an out-pointer to a static string

	// cuBLAS and cuBLASLt (cublas_api.h, cublasLt.h, library_types.h).
	"long long int":                        "int64",
	"int64_t":                              "int64",
	"uint64_t":                             "uint64",
	"cublasStatus_t":                       "int32",
	"cublasHandle_t":                       "uintptr",
	"cublasOperation_t":                    "int32",
	"cublasPointerMode_t":                  "int32",
	"cublasMath_t":                         "int32",
	"cublasGemmAlgo_t":                     "int32",
	"cublasComputeType_t":                  "int32",
	"cudaDataType":                         "int32",
	"cudaDataType_t":                       "int32",
	"libraryPropertyType":                  "int32",
	"cublasLtHandle_t":                     "uintptr",
	"cublasLtMatmulDesc_t":                 "uintptr",
	"cublasLtMatrixLayout_t":               "uintptr",
	"cublasLtMatmulPreference_t":           "uintptr",
	"cublasLtMatmulDescAttributes_t":       "int32",
	"cublasLtMatmulPreferenceAttributes_t": "int32",
	"cublasLtMatmulAlgo_t":                 "[8]uint64", // uint64_t data[8]
}

type decl struct {
	comment  []string // // lines before it
	blank    bool     // a blank line before it
	ret      string
	symbol   string
	field    string
	functype string // the named func type of the field, if any
	optional bool
	params   []param
	note     string
}

type param struct{ name, goType string }

// structType is one generated struct: the declarations of one @type section.
type structType struct {
	name  string
	doc   []string // // lines before its @type
	decls []decl
}

var declRE = regexp.MustCompile(`^(.+?)\s*\b(\w+)\s*\((.*)\)\s*;\s*(?://\s*(.*))?$`)

// generate turns the spec read from r into gofmt'ed Go source. typ names the
// struct of the declarations before the first @type directive.
func generate(r io.Reader, specName, pkg, typ string) ([]byte, error) {
	types := []*structType{{name: typ}}
	local := map[string]string{} // @map entries so far
	var pendingComment []string
	blank := false
	sc := bufio.NewScanner(r)
	line := 0
	for sc.Scan() {
		line++
		t := strings.TrimSpace(sc.Text())
		cur := types[len(types)-1]
		switch {
		case t == "":
			blank = len(cur.decls) > 0
			continue
		case strings.HasPrefix(t, "#"):
			continue
		case strings.HasPrefix(t, "//"):
			pendingComment = append(pendingComment, t)
			continue
		case strings.HasPrefix(t, "@"):
			f := strings.Fields(t)
			switch {
			case f[0] == "@type" && len(f) == 2 && token.IsIdentifier(f[1]):
				types = append(types, &structType{name: f[1], doc: pendingComment})
			case f[0] == "@map" && len(f) >= 3:
				local[normType(strings.Join(f[1:len(f)-1], " "))] = f[len(f)-1]
			default:
				return nil, fmt.Errorf("%s:%d: bad directive %q", specName, line, t)
			}
			pendingComment, blank = nil, false
			continue
		}
		d, err := parseDeclTypes(t, local)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", specName, line, err)
		}
		d.comment, d.blank = pendingComment, blank
		pendingComment, blank = nil, false
		cur.decls = append(cur.decls, d)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(types[0].decls) == 0 {
		types = types[1:]
	} else if typ == "" {
		return nil, fmt.Errorf("%s: declarations before the first @type and no -type", specName)
	}
	if len(types) == 0 {
		return nil, fmt.Errorf("%s: no declarations", specName)
	}

	// Check the names and collect the named func types, in order of first use.
	var all []decl
	seenType := map[string]bool{}
	funcTypes := map[string]decl{}
	var funcTypeOrder []string
	for _, st := range types {
		if seenType[st.name] {
			return nil, fmt.Errorf("%s: type %s defined twice", specName, st.name)
		}
		seenType[st.name] = true
		seen := map[string]bool{}
		for _, d := range st.decls {
			if seen[d.field] {
				return nil, fmt.Errorf("%s: field %s.%s defined twice", specName, st.name, d.field)
			}
			seen[d.field] = true
			all = append(all, d)
			if d.functype == "" {
				continue
			}
			first, ok := funcTypes[d.functype]
			if !ok {
				funcTypes[d.functype] = d
				funcTypeOrder = append(funcTypeOrder, d.functype)
			} else if first.String() != d.String() || first.ret != d.ret {
				return nil, fmt.Errorf("%s: %s does not have the signature of func type %s (from %s)", specName, d.symbol, d.functype, first.symbol)
			}
		}
	}
	for _, ft := range funcTypeOrder {
		if seenType[ft] {
			return nil, fmt.Errorf("%s: func type %s is also a struct type", specName, ft)
		}
	}

	var b bytes.Buffer
	fmt.Fprintf(&b, "// Code generated by gensyms from %s; DO NOT EDIT.\n\n", specName)
	fmt.Fprintf(&b, "package %s\n\n", pkg)
	fmt.Fprintf(&b, "import (\n")
	if strings.Contains(fmt.Sprint(all), "unsafe.Pointer") {
		fmt.Fprintf(&b, "\t\"unsafe\"\n\n")
	}
	fmt.Fprintf(&b, "\t\"github.com/gpuctx/gpuctx/internal/dynload\"\n)\n")
	for _, st := range types {
		b.WriteString("\n")
		if len(st.doc) > 0 {
			for _, c := range st.doc {
				b.WriteString(c + "\n")
			}
		} else {
			fmt.Fprintf(&b, "// %s is the function table bound from %s (one func field per C function).\n", st.name, specName)
		}
		fmt.Fprintf(&b, "type %s struct {\n", st.name)
		for i, d := range st.decls {
			if d.blank && i > 0 {
				b.WriteString("\n")
			}
			for _, c := range d.comment {
				b.WriteString("\t" + c + "\n")
			}
			if d.functype != "" {
				fmt.Fprintf(&b, "\t%s %s", d.field, d.functype)
			} else {
				fmt.Fprintf(&b, "\t%s %s", d.field, d.signature())
			}
			var notes []string
			if d.field != d.symbol {
				notes = append(notes, d.symbol)
			}
			if d.optional {
				notes = append(notes, "optional")
			}
			if d.note != "" {
				notes = append(notes, d.note)
			}
			if len(notes) > 0 {
				fmt.Fprintf(&b, " // %s", strings.Join(notes, "; "))
			}
			b.WriteString("\n")
		}
		b.WriteString("}\n\n")
		fmt.Fprintf(&b, "// symbols is the one table that maps C symbol names to the fields of a.\n")
		fmt.Fprintf(&b, "func (a *%s) symbols() []dynload.Symbol {\n\treturn []dynload.Symbol{\n", st.name)
		for _, d := range st.decls {
			opt := ""
			if d.optional {
				opt = ", Optional: true"
			}
			fmt.Fprintf(&b, "\t\t{Name: %q, Fn: &a.%s%s},\n", d.symbol, d.field, opt)
		}
		b.WriteString("\t}\n}\n")
	}
	for _, ft := range funcTypeOrder {
		var users []string
		for _, d := range all {
			if d.functype == ft {
				users = append(users, d.symbol)
			}
		}
		fmt.Fprintf(&b, "\n// %s is the func type of the fields bound to %s.\n", ft, strings.Join(users, ", "))
		fmt.Fprintf(&b, "type %s %s\n", ft, funcTypes[ft].signature())
	}
	src, err := format.Source(b.Bytes())
	if err != nil {
		return nil, fmt.Errorf("formatting the output: %w\n%s", err, b.Bytes())
	}
	return src, nil
}

func (d decl) String() string {
	var s []string
	for _, p := range d.params {
		s = append(s, p.goType)
	}
	return strings.Join(s, " ")
}

// signature is the Go func type of d, with parameter names.
func (d decl) signature() string {
	var s []string
	for _, p := range d.params {
		s = append(s, p.name+" "+p.goType)
	}
	return "func(" + strings.Join(s, ", ") + ") " + d.ret
}

// parseDecl parses one declaration with the C types of typeMap only.
func parseDecl(t string) (decl, error) { return parseDeclTypes(t, nil) }

// parseDeclTypes parses one declaration; local (the spec's @map entries)
// takes precedence over typeMap.
func parseDeclTypes(t string, local map[string]string) (decl, error) {
	m := declRE.FindStringSubmatch(t)
	if m == nil {
		return decl{}, fmt.Errorf("not a C declaration: %q", t)
	}
	d := decl{symbol: m[2], field: strings.TrimSuffix(m[2], "_v2")}
	ret, ok := goType(m[1], local)
	if !ok {
		return decl{}, fmt.Errorf("%s: unknown return type %q", d.symbol, m[1])
	}
	d.ret = ret
	over := map[string]string{}
	ann := m[4]
	if i := strings.Index(ann, "--"); i >= 0 {
		d.note = strings.TrimSpace(ann[i+2:])
		ann = ann[:i]
	}
	for _, a := range strings.Fields(ann) {
		switch k, v, ok := strings.Cut(a, "="); {
		case a == "optional":
			d.optional = true
		case ok && k == "field":
			d.field = v
		case ok && k == "functype":
			if !token.IsIdentifier(v) {
				return decl{}, fmt.Errorf("%s: bad func type name %q", d.symbol, v)
			}
			d.functype = v
		case ok:
			over[k] = v
		default:
			return decl{}, fmt.Errorf("%s: unknown annotation %q", d.symbol, a)
		}
	}
	args := strings.TrimSpace(m[3])
	if args == "void" || args == "" {
		return d, nil
	}
	for _, a := range strings.Split(args, ",") {
		a = strings.TrimSpace(a)
		array := false
		if s, ok := strings.CutSuffix(a, "[]"); ok {
			a, array = strings.TrimSpace(s), true
		}
		i := strings.LastIndexAny(a, " *")
		if i < 0 {
			return decl{}, fmt.Errorf("%s: parameter %q has no name", d.symbol, a)
		}
		name, ctype := a[i+1:], a[:i+1]
		if array {
			ctype += " *"
		}
		gt, ok := over[name]
		if ok {
			delete(over, name)
		} else if gt, ok = goType(ctype, local); !ok {
			return decl{}, fmt.Errorf("%s: parameter %s: unknown C type %q", d.symbol, name, ctype)
		}
		if token.IsKeyword(name) || types.Universe.Lookup(name) != nil {
			name += "_" // type, func, error, len, ...
		}
		d.params = append(d.params, param{name, gt})
	}
	for k := range over {
		return decl{}, fmt.Errorf("%s: annotation for unknown parameter %q", d.symbol, k)
	}
	return d, nil
}

// normType normalises a C type: single spaces, a space before each '*'.
func normType(c string) string {
	c = strings.ReplaceAll(c, "*", " * ")
	c = strings.Join(strings.Fields(c), " ")
	return strings.ReplaceAll(c, "* *", "**")
}

// goType maps a C type: an exact entry of local or typeMap, else the same with
// const dropped, else a pointer to a mapped type, recursively.
func goType(c string, local map[string]string) (string, bool) {
	n := normType(c)
	lookup := func(n string) (string, bool) {
		if g, ok := local[n]; ok {
			return g, true
		}
		g, ok := typeMap[n]
		return g, ok
	}
	if g, ok := lookup(n); ok {
		return g, true
	}
	n = strings.TrimPrefix(n, "const ")
	if g, ok := lookup(n); ok {
		return g, true
	}
	if strings.HasSuffix(n, "*") {
		if g, ok := goType(strings.TrimSpace(strings.TrimSuffix(n, "*")), local); ok {
			return "*" + g, true
		}
	}
	return "", false
}

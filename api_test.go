package gpuctx_test

import (
	"flag"
	"fmt"
	"go/ast"
	"go/build"
	"go/parser"
	"go/token"
	"go/types"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The exported API of every non-internal package of the module is written
// to api/<package>.txt (api/gpuctx.txt for the root, api/moe.txt,
// api/backend_cpu.txt, ...), one declaration a line, sorted, as Go's own api/
// files are; TestAPI compares the source with them, so that every change of
// the public surface is seen in review. After an intended change run:
//
//	go test -run TestAPI -update .
const apiUpdate = "go test -run TestAPI -update ."

var updateAPI = flag.Bool("update", false, "TestAPI: rewrite api/*.txt from the source")

// rawHandleAllowed are the declarations allowed to return or expose a raw
// library handle: the documented escape hatch, native.go (the file, so that
// helpers added there are allowed too); the backends, which implement
// internal/hal (their exported API is the handle layer below the Context's
// lock, usable only through internal/hal); and device addresses.
var rawHandleAllowed = struct {
	files []string // module-relative files whose declarations are the escape hatch
	dirs  []string // module-relative package trees exempt from the rule
	decls []string // "pkg.Name" of types that are device addresses, not handles
}{
	files: []string{"native.go"},
	dirs:  []string{"backend/"},
	decls: []string{"gpuctx.Ptr"},
}

// rawExempt reports whether file's declarations may expose raw handles.
func rawExempt(file string) bool {
	for _, d := range rawHandleAllowed.dirs {
		if strings.HasPrefix(file, d) {
			return true
		}
	}
	return slices.Contains(rawHandleAllowed.files, file)
}

// TestAPI checks the exported API of every non-internal package against
// api/*.txt and that no exported declaration outside the escape hatch
// (native.go) returns or exposes a raw library handle: a uintptr,
// unsafe.Pointer, a named type over one, or a type of internal/hal (the
// library handles themselves).
func TestAPI(t *testing.T) {
	pkgs := apiPackages(t)
	var raw []string
	for _, p := range pkgs {
		raw = append(raw, p.raw...)
	}
	if len(raw) > 0 {
		t.Errorf("exported declarations hand out a raw library handle (only native.go may; use a callback that holds the handle's lock, as Context.Blas does):\n\t%s", strings.Join(raw, "\n\t"))
	}
	if *updateAPI {
		writeAPI(t, pkgs)
		return
	}
	var diffs []string
	want := map[string]bool{}
	for _, p := range pkgs {
		want[p.file] = true
		old, err := os.ReadFile(p.file)
		if err != nil {
			diffs = append(diffs, fmt.Sprintf("%s: missing (new package %s)", p.file, p.path))
			continue
		}
		diffs = append(diffs, diffLines(p.file, strings.Split(strings.TrimSpace(string(old)), "\n"), p.lines)...)
	}
	files, _ := filepath.Glob("api/*.txt")
	for _, f := range files {
		if !want[filepath.ToSlash(f)] {
			diffs = append(diffs, fmt.Sprintf("%s: no such package any more", f))
		}
	}
	if len(diffs) > 0 {
		t.Errorf("the exported API differs from api/*.txt (- removed, + added):\n\t%s\nIf the change is intended, run: %s", strings.Join(diffs, "\n\t"), apiUpdate)
	}
}

// apiPackage is one package's exported API.
type apiPackage struct {
	path  string   // import path
	file  string   // api/<name>.txt
	lines []string // sorted declarations
	raw   []string // raw-handle violations
}

func writeAPI(t *testing.T, pkgs []apiPackage) {
	old, _ := filepath.Glob("api/*.txt")
	for _, f := range old {
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll("api", 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range pkgs {
		if err := os.WriteFile(p.file, []byte(strings.Join(p.lines, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("wrote the API of %d packages to api/", len(pkgs))
}

// diffLines lists the lines only in old (-) and only in cur (+).
func diffLines(file string, old, cur []string) []string {
	var d []string
	for _, l := range old {
		if _, found := slices.BinarySearch(cur, l); !found && l != "" {
			d = append(d, file+": - "+l)
		}
	}
	sorted := slices.Sorted(slices.Values(old))
	for _, l := range cur {
		if _, found := slices.BinarySearch(sorted, l); !found {
			d = append(d, file+": + "+l)
		}
	}
	return d
}

// apiPackages parses every non-internal, non-main package of the module.
func apiPackages(t *testing.T) []apiPackage {
	t.Helper()
	var pkgs []apiPackage
	err := filepath.WalkDir(".", func(p string, e fs.DirEntry, err error) error {
		if err != nil || !e.IsDir() {
			return err
		}
		name := e.Name()
		if p != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "internal" || name == "api") {
			return filepath.SkipDir
		}
		bp, err := build.ImportDir(p, 0)
		if err != nil || bp.Name == "main" {
			return nil // no Go files, or a command
		}
		pkg, err := parsePackage(filepath.ToSlash(p), bp.GoFiles)
		if err != nil {
			return err
		}
		pkgs = append(pkgs, pkg)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return pkgs
}

func parsePackage(dir string, files []string) (apiPackage, error) {
	p := apiPackage{path: module, file: "api/gpuctx.txt"}
	if dir != "." {
		p.path = module + "/" + dir
		p.file = "api/" + strings.ReplaceAll(dir, "/", "_") + ".txt"
	}
	fset := token.NewFileSet()
	var parsed []*ast.File
	for _, f := range files {
		af, err := parser.ParseFile(fset, path.Join(dir, f), nil, parser.SkipObjectResolution)
		if err != nil {
			return p, err
		}
		parsed = append(parsed, af)
	}
	w := apiWalker{pkg: path.Base(p.path), rawTypes: rawNamedTypes(parsed)}
	if dir == "." {
		w.pkg = "gpuctx"
	}
	for _, af := range parsed {
		w.file = filepath.ToSlash(fset.Position(af.Package).Filename)
		for _, d := range af.Decls {
			w.decl(d)
		}
	}
	slices.Sort(w.lines)
	p.lines = slices.Compact(w.lines)
	for i := range p.lines {
		p.lines[i] = "pkg " + p.path + ", " + p.lines[i]
	}
	p.raw = w.raw
	return p, nil
}

// rawNamedTypes returns the package's types defined over uintptr or
// unsafe.Pointer (type Handle uintptr): as raw as the underlying type.
func rawNamedTypes(files []*ast.File) map[string]bool {
	raw := map[string]bool{}
	for _, f := range files {
		for _, d := range f.Decls {
			if g, ok := d.(*ast.GenDecl); ok && g.Tok == token.TYPE {
				for _, s := range g.Specs {
					ts := s.(*ast.TypeSpec)
					if e := types.ExprString(ts.Type); e == "uintptr" || e == "unsafe.Pointer" {
						raw[ts.Name.Name] = true
					}
				}
			}
		}
	}
	return raw
}

// apiWalker collects one package's exported declarations.
type apiWalker struct {
	pkg      string
	file     string
	rawTypes map[string]bool
	lines    []string
	raw      []string
}

func (w *apiWalker) decl(d ast.Decl) {
	switch d := d.(type) {
	case *ast.FuncDecl:
		w.fn(d)
	case *ast.GenDecl:
		for _, s := range d.Specs {
			switch s := s.(type) {
			case *ast.TypeSpec:
				w.typ(s)
			case *ast.ValueSpec:
				w.value(d.Tok, s)
			}
		}
	}
}

func (w *apiWalker) fn(d *ast.FuncDecl) {
	if !d.Name.IsExported() {
		return
	}
	name := "func " + d.Name.Name
	if d.Recv != nil {
		recv := d.Recv.List[0].Type
		base := recv
		if st, ok := base.(*ast.StarExpr); ok {
			base = st.X
		}
		if ix, ok := base.(*ast.IndexExpr); ok {
			base = ix.X
		} else if ix, ok := base.(*ast.IndexListExpr); ok {
			base = ix.X
		}
		if id, ok := base.(*ast.Ident); !ok || !id.IsExported() {
			return
		}
		name = fmt.Sprintf("method (%s) %s", types.ExprString(recv), d.Name.Name)
	}
	w.add(name+signature(d.Type), d.Type.Results)
}

// signature prints a function type without parameter names.
func signature(f *ast.FuncType) string {
	s := ""
	if f.TypeParams != nil {
		s = "[" + fields(f.TypeParams, true) + "]"
	}
	s += "(" + fields(f.Params, false) + ")"
	if f.Results != nil {
		r := fields(f.Results, false)
		if len(f.Results.List) > 1 || len(f.Results.List[0].Names) > 1 {
			r = "(" + r + ")"
		}
		s += " " + r
	}
	return s
}

// fields prints a field list's types (with names for type parameters).
func fields(l *ast.FieldList, names bool) string {
	var parts []string
	for _, f := range l.List {
		typ := types.ExprString(f.Type)
		n := max(1, len(f.Names))
		for i := range n {
			if names && len(f.Names) > 0 {
				parts = append(parts, f.Names[i].Name+" "+typ)
			} else {
				parts = append(parts, typ)
			}
		}
	}
	return strings.Join(parts, ", ")
}

func (w *apiWalker) typ(s *ast.TypeSpec) {
	if !s.Name.IsExported() {
		return
	}
	name := "type " + s.Name.Name
	if s.TypeParams != nil {
		name += "[" + fields(s.TypeParams, true) + "]"
	}
	switch t := s.Type.(type) {
	case *ast.StructType:
		w.add(name+" struct", nil)
		for _, f := range t.Fields.List {
			typ := types.ExprString(f.Type)
			if len(f.Names) == 0 && ast.IsExported(typ[strings.LastIndexAny(typ, "*.")+1:]) {
				w.add(name+" struct, embedded "+typ, &ast.FieldList{List: []*ast.Field{f}})
			}
			for _, n := range f.Names {
				if n.IsExported() {
					w.add(name+" struct, "+n.Name+" "+typ, &ast.FieldList{List: []*ast.Field{f}})
				}
			}
		}
	case *ast.InterfaceType:
		w.add(name+" interface", nil)
		for _, m := range t.Methods.List {
			if ft, ok := m.Type.(*ast.FuncType); ok && len(m.Names) > 0 && m.Names[0].IsExported() {
				w.add(name+" interface, "+m.Names[0].Name+signature(ft), ft.Results)
			} else if len(m.Names) == 0 {
				w.add(name+" interface, embedded "+types.ExprString(m.Type), nil)
			}
		}
	default:
		eq := " "
		if s.Assign.IsValid() {
			eq = " = "
		}
		w.add(name+eq+types.ExprString(s.Type), nil)
	}
}

func (w *apiWalker) value(tok token.Token, s *ast.ValueSpec) {
	for _, n := range s.Names {
		if !n.IsExported() {
			continue
		}
		line := tok.String() + " " + n.Name
		var exposed *ast.FieldList
		if s.Type != nil {
			line += " " + types.ExprString(s.Type)
			exposed = &ast.FieldList{List: []*ast.Field{{Type: s.Type}}}
		}
		w.add(line, exposed)
	}
}

// add records an exported declaration and checks the types it exposes.
func (w *apiWalker) add(line string, exposed *ast.FieldList) {
	w.lines = append(w.lines, line)
	if exposed == nil || rawExempt(w.file) {
		return
	}
	for _, f := range exposed.List {
		ast.Inspect(f.Type, func(n ast.Node) bool {
			var what string
			switch n := n.(type) {
			case *ast.Ident:
				if n.Name == "uintptr" || w.rawTypes[n.Name] && !slices.Contains(rawHandleAllowed.decls, w.pkg+"."+n.Name) {
					what = n.Name
				}
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok && (x.Name == "hal" || x.Name == "unsafe" && n.Sel.Name == "Pointer") {
					what = types.ExprString(n)
				}
			}
			if what != "" {
				w.raw = append(w.raw, fmt.Sprintf("%s: %s.%s exposes %s", w.file, w.pkg, line, what))
			}
			return true
		})
	}
}

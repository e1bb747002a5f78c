package doccheck

import (
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/format"
	"go/parser"
	"go/scanner"
	"go/token"
	"go/types"
	"path"
	"slices"
	"strconv"
	"strings"
)

// Kind is how a Go block is compiled.
type Kind int

const (
	KindFile  Kind = iota + 1 // a whole file, with its package clause
	KindDecls                 // top-level declarations
	KindStmts                 // statements, the body of func _() error
)

func (k Kind) String() string {
	switch k {
	case KindFile:
		return "whole file"
	case KindDecls:
		return "declarations"
	case KindStmts:
		return "statements"
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// PackageName is the package clause of every generated snippet package, and of
// the prelude.
const PackageName = "snippet"

// KnownImports maps the package names that blocks may use without importing
// to their import paths (the module's own packages are added by
// [ModuleImports]). Add a name here when a document starts using a package.
var KnownImports = map[string]string{
	"context":    "context",
	"errors":     "errors",
	"fmt":        "fmt",
	"io":         "io",
	"log":        "log",
	"os":         "os",
	"signal":     "os/signal",
	"strings":    "strings",
	"strconv":    "strconv",
	"sync":       "sync",
	"time":       "time",
	"json":       "encoding/json",
	"slog":       "log/slog",
	"http":       "net/http",
	"sql":        "database/sql",
	"pgx":        "github.com/jackc/pgx/v5",
	"pgconn":     "github.com/jackc/pgx/v5/pgconn",
	"pgxpool":    "github.com/jackc/pgx/v5/pgxpool",
	"stdlib":     "github.com/jackc/pgx/v5/stdlib",
	"goose":      "github.com/pressly/goose/v3",
	"prometheus": "github.com/prometheus/client_golang/prometheus",
	"promhttp":   "github.com/prometheus/client_golang/prometheus/promhttp",
}

// Prelude is the parsed prelude file (see the package documentation).
type Prelude struct {
	fset *token.FileSet
	file *ast.File
}

// ParsePrelude parses the prelude's source. Its package clause must be
// [PackageName].
func ParsePrelude(src []byte) (*Prelude, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "prelude.go", src, parser.ParseComments)
	if err != nil {
		return nil, fmt.Errorf("prelude: %w", err)
	}
	if f.Name.Name != PackageName {
		return nil, fmt.Errorf("prelude: package %s, want package %s", f.Name.Name, PackageName)
	}
	return &Prelude{fset: fset, file: f}, nil
}

// without returns the prelude's source without the top-level declarations of
// the given names, and without the imports that only those used.
func (p *Prelude) without(names map[string]bool) ([]byte, error) {
	f := *p.file
	f.Decls = nil
	f.Comments = nil // keep no comment that could land in the wrong place
	for _, d := range p.file.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !names[d.Name.Name] {
				f.Decls = append(f.Decls, d)
			}
		case *ast.GenDecl:
			if d.Tok == token.IMPORT {
				continue // rebuilt below
			}
			g := *d
			g.Specs = nil
			for _, s := range d.Specs {
				if !slices.ContainsFunc(specNames(s), func(n string) bool { return names[n] }) {
					g.Specs = append(g.Specs, s)
				}
			}
			if len(g.Specs) > 0 {
				if len(g.Specs) > 1 && !g.Lparen.IsValid() {
					g.Lparen = g.Pos()
				}
				f.Decls = append(f.Decls, &g)
			}
		}
	}
	used := selectorBases(&f)
	var imports []string
	for _, s := range p.file.Imports {
		p, err := strconv.Unquote(s.Path.Value)
		if err != nil {
			return nil, err
		}
		name := importName(p)
		if s.Name != nil {
			name = s.Name.Name
		}
		if used[name] {
			imports = append(imports, fmt.Sprintf("%s %q", name, p))
		}
	}
	var buf bytes.Buffer
	buf.WriteString("package " + PackageName + "\n\n")
	for _, imp := range imports {
		buf.WriteString("import " + imp + "\n")
	}
	buf.WriteString("\n")
	for _, d := range f.Decls {
		if err := format.Node(&buf, p.fset, d); err != nil {
			return nil, err
		}
		buf.WriteString("\n\n")
	}
	return buf.Bytes(), nil
}

func specNames(s ast.Spec) []string {
	var out []string
	switch s := s.(type) {
	case *ast.ValueSpec:
		for _, n := range s.Names {
			out = append(out, n.Name)
		}
	case *ast.TypeSpec:
		out = append(out, s.Name.Name)
	}
	return out
}

func topLevelNames(f *ast.File) map[string]bool {
	names := map[string]bool{}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil {
				names[d.Name.Name] = true
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				for _, n := range specNames(s) {
					names[n] = true
				}
			}
		}
	}
	delete(names, "_")
	return names
}

// selectorBases returns the names used as X in X.Sel anywhere in f.
func selectorBases(f *ast.File) map[string]bool {
	used := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		if s, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := s.X.(*ast.Ident); ok {
				used[id.Name] = true
			}
		}
		return true
	})
	return used
}

// importName guesses the package name of an import path: its last element,
// without a /vN major-version suffix.
func importName(p string) string {
	for name, known := range KnownImports {
		if known == p {
			return name
		}
	}
	base := path.Base(p)
	if len(base) > 1 && base[0] == 'v' && strings.Trim(base[1:], "0123456789") == "" {
		base = path.Base(path.Dir(p))
	}
	return strings.TrimPrefix(base, "go-")
}

// A Snippet is a Go block turned into the files of a package.
type Snippet struct {
	Block   Block
	Kind    Kind
	Package string            // the package clause
	Files   map[string][]byte // file name → source

	// Problems found without the compiler (see UncheckedErrs).
	Problems []string
}

// Wrap turns a Go block into a package: the block's file (snippet.go, with
// //line directives that map positions back to the document; docPath is the
// document's absolute path) and, for fragments, the prelude (prelude.go).
// imports maps package names to import paths (see [KnownImports] and
// [ModuleImports]).
func Wrap(b Block, docPath string, prelude *Prelude, imports map[string]string) (*Snippet, error) {
	s, err := wrap(b, docPath, prelude, imports)
	if err != nil {
		// Messages name the document as the reader knows it.
		return nil, errors.New(strings.ReplaceAll(err.Error(), docPath, b.Doc))
	}
	for i, p := range s.Problems {
		s.Problems[i] = strings.ReplaceAll(p, docPath, b.Doc)
	}
	return s, nil
}

func wrap(b Block, docPath string, prelude *Prelude, imports map[string]string) (*Snippet, error) {
	if !b.IsGo() {
		return nil, fmt.Errorf("%s: not a Go block (%q)", b, b.Lang)
	}
	lineDir := func(line int) string { return fmt.Sprintf("//line %s:%d:1\n", docPath, line) }
	if startsWithPackage(b.Text) {
		src := lineDir(b.Line) + b.Text
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, "snippet.go", src, 0)
		if err != nil {
			return nil, err
		}
		return &Snippet{Block: b, Kind: KindFile, Package: f.Name.Name, Files: map[string][]byte{"snippet.go": []byte(src)},
			Problems: UncheckedErrs(fset, f)}, nil
	}

	importsText, bodyText, bodyLine := splitImports(b.Text, b.Line)
	var head strings.Builder
	head.WriteString("package " + PackageName + "\n\n")
	head.WriteString("import ()\n") // replaced by the added imports
	if importsText != "" {
		head.WriteString(lineDir(b.Line) + importsText)
	}
	kind := KindDecls
	src := head.String() + lineDir(bodyLine) + bodyText
	fset := token.NewFileSet()
	f, declErr := parser.ParseFile(fset, "snippet.go", src, parser.ParseComments)
	if declErr != nil {
		kind = KindStmts
		// The body sits in "if true { ... }" so that a block that ends in a
		// return leaves the final "return nil" reachable (go vet).
		src = head.String() + "func _() error {\nif true {\n" + lineDir(bodyLine) + bodyText + "\n}\nreturn nil\n}\n"
		fset = token.NewFileSet()
		var stmtErr error
		f, stmtErr = parser.ParseFile(fset, "snippet.go", src, parser.ParseComments)
		if stmtErr != nil {
			return nil, fmt.Errorf("neither declarations nor statements:\n\tas declarations: %v\n\tas statements: %v", firstError(declErr), firstError(stmtErr))
		}
	}

	if kind == KindStmts {
		// Variables a fragment declares at its top level may be left for the
		// reader's code that follows; err may not (see UncheckedErrs).
		src = keepVars(fset, fragmentBody(f), src)
		fset = token.NewFileSet()
		var err error
		if f, err = parser.ParseFile(fset, "snippet.go", src, parser.ParseComments); err != nil {
			return nil, fmt.Errorf("internal error: fragment after keepVars: %w", err)
		}
	}

	var preludeSrc []byte
	if prelude != nil {
		var err error
		if preludeSrc, err = prelude.without(topLevelNames(f)); err != nil {
			return nil, err
		}
	}
	add, err := missingImports(f, fset, preludeSrc, imports)
	if err != nil {
		return nil, err
	}
	var decl string
	if len(add) > 0 {
		var sb strings.Builder
		sb.WriteString("import (\n")
		for _, p := range add {
			fmt.Fprintf(&sb, "\t%q\n", p)
		}
		sb.WriteString(")\n")
		decl = sb.String()
	}
	src = strings.Replace(src, "import ()\n", decl, 1)
	s := &Snippet{Block: b, Kind: kind, Package: PackageName, Files: map[string][]byte{"snippet.go": []byte(src)}}
	fset = token.NewFileSet()
	if f, err = parser.ParseFile(fset, "snippet.go", src, 0); err != nil {
		return nil, fmt.Errorf("internal error: wrapped fragment: %w", err)
	}
	s.Problems = UncheckedErrs(fset, f)
	if preludeSrc != nil {
		s.Files["prelude.go"] = preludeSrc
	}
	return s, nil
}

func firstError(err error) error {
	var list scanner.ErrorList
	if errors.As(err, &list) && len(list) > 0 {
		return list[0]
	}
	return err
}

// startsWithPackage reports whether the first token of src is "package".
func startsWithPackage(src string) bool {
	var s scanner.Scanner
	fset := token.NewFileSet()
	s.Init(fset.AddFile("", -1, len(src)), []byte(src), nil, 0)
	_, tok, _ := s.Scan()
	return tok == token.PACKAGE
}

// splitImports cuts the leading import declarations off a fragment. It returns
// them, the rest, and the document line the rest starts on.
func splitImports(src string, line int) (imports, rest string, restLine int) {
	var s scanner.Scanner
	fset := token.NewFileSet()
	file := fset.AddFile("", -1, len(src))
	s.Init(file, []byte(src), nil, 0)
	next := func() (token.Pos, token.Token, string) {
		for {
			pos, tok, lit := s.Scan()
			if tok != token.SEMICOLON {
				return pos, tok, lit
			}
		}
	}
	end := 0 // offset just past the last import declaration's line
	for {
		_, tok, _ := next()
		if tok != token.IMPORT {
			break
		}
		pos, tok, lit := next()
		if tok == token.IDENT || tok == token.PERIOD {
			pos, tok, lit = next()
		}
		switch tok {
		case token.STRING:
			end = file.Offset(pos) + len(lit)
		case token.LPAREN:
			for tok != token.RPAREN && tok != token.EOF {
				pos, tok, _ = next()
			}
			if tok == token.EOF {
				return "", src, line
			}
			end = file.Offset(pos) + 1
		default:
			return "", src, line
		}
		if nl := strings.IndexByte(src[end:], '\n'); nl >= 0 {
			end += nl + 1
		} else {
			end = len(src)
		}
	}
	if end == 0 {
		return "", src, line
	}
	return src[:end], src[end:], line + strings.Count(src[:end], "\n")
}

// missingImports type-checks the snippet file and the prelude with empty
// stand-ins for every imported package, and returns the import paths of the
// known package names the snippet uses without declaring.
func missingImports(f *ast.File, fset *token.FileSet, preludeSrc []byte, known map[string]string) ([]string, error) {
	files := []*ast.File{f}
	if preludeSrc != nil {
		pf, err := parser.ParseFile(fset, "prelude.go", preludeSrc, 0)
		if err != nil {
			return nil, fmt.Errorf("prelude after filtering: %w", err)
		}
		files = append(files, pf)
	}
	bases := map[token.Pos]string{}
	ast.Inspect(f, func(n ast.Node) bool {
		if s, ok := n.(*ast.SelectorExpr); ok {
			if id, ok := s.X.(*ast.Ident); ok {
				bases[id.Pos()] = id.Name
			}
		}
		return true
	})
	need := map[string]bool{}
	conf := types.Config{
		Importer: importerFunc(func(p string) (*types.Package, error) {
			pkg := types.NewPackage(p, importName(p))
			pkg.MarkComplete()
			return pkg, nil
		}),
		Error: func(err error) {
			var te types.Error
			if !errors.As(err, &te) {
				return
			}
			if name, ok := bases[te.Pos]; ok && te.Msg == "undefined: "+name {
				if _, ok := known[name]; ok {
					need[name] = true
				}
			}
		},
	}
	_, _ = conf.Check(PackageName, fset, files, nil) // errors are expected: the stand-ins are empty
	var paths []string
	for name := range need {
		paths = append(paths, known[name])
	}
	slices.Sort(paths)
	return paths, nil
}

type importerFunc func(path string) (*types.Package, error)

func (f importerFunc) Import(path string) (*types.Package, error) { return f(path) }

// fragmentBody returns the statements of a wrapped fragment: the body of the
// "if true" block inside func _.
func fragmentBody(f *ast.File) []ast.Stmt {
	for _, d := range f.Decls {
		if fd, ok := d.(*ast.FuncDecl); ok && fd.Name.Name == "_" && fd.Body != nil && len(fd.Body.List) > 0 {
			if is, ok := fd.Body.List[0].(*ast.IfStmt); ok {
				return is.Body.List
			}
		}
	}
	return nil
}

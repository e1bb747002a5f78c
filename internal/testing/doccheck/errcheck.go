package doccheck

import (
	"fmt"
	"go/ast"
	"go/token"
	"slices"
	"strings"
)

// UncheckedErrs returns a message for every assignment to a variable named
// err whose value is never read: no later statement of its block (or of the
// enclosing blocks, up to the function's end) reads err before err is
// assigned again or the function ends. The compiler only refuses an err that
// is never read at all; this catches `_, err = f()` left unchecked after an
// earlier check. Positions honour //line directives.
func UncheckedErrs(fset *token.FileSet, f *ast.File) []string {
	var out []string
	report := func(pos token.Pos) {
		out = append(out, fmt.Sprintf("%s: err is assigned and never checked", fset.Position(pos)))
	}
	var walkFunc func(body *ast.BlockStmt)
	// walk checks the statement list, whose continuation (the statements that
	// run after it, innermost first) is conts.
	var walk func(list []ast.Stmt, conts [][]ast.Stmt)
	walk = func(list []ast.Stmt, conts [][]ast.Stmt) {
		for i, s := range list {
			if pos, ok := assignsErr(s); ok && !readsErr(s) {
				if !readBeforeWrite(append([][]ast.Stmt{list[i+1:]}, conts...)) {
					report(pos)
				}
			}
			// Nested statement lists continue with the rest of this one.
			inner := append([][]ast.Stmt{list[i+1:]}, conts...)
			ast.Inspect(s, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.FuncLit:
					walkFunc(n.Body)
					return false
				case *ast.IfStmt:
					if n.Init != nil {
						if pos, ok := assignsErr(n.Init); ok && !exprReadsErr(n.Cond) && !blockReadsErr(n.Body) && (n.Else == nil || !nodeReadsErr(n.Else)) {
							report(pos)
						}
					}
				case *ast.BlockStmt:
					walk(n.List, inner)
					return false
				case *ast.CaseClause:
					walk(n.Body, inner)
					return false
				case *ast.CommClause:
					walk(n.Body, inner)
					return false
				}
				return true
			})
		}
	}
	walkFunc = func(body *ast.BlockStmt) {
		if body != nil {
			walk(body.List, nil)
		}
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !hasNamedErrResult(d.Type) {
				walkFunc(d.Body)
			}
		case *ast.GenDecl:
			ast.Inspect(d, func(n ast.Node) bool {
				if fl, ok := n.(*ast.FuncLit); ok {
					walkFunc(fl.Body)
					return false
				}
				return true
			})
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// hasNamedErrResult: a bare return reads a named result err; such functions are
// left alone.
func hasNamedErrResult(ft *ast.FuncType) bool {
	if ft.Results == nil {
		return false
	}
	for _, r := range ft.Results.List {
		for _, n := range r.Names {
			if n.Name == "err" {
				return true
			}
		}
	}
	return false
}

// assignsErr reports whether s is an assignment (=, :=, var) to err.
func assignsErr(s ast.Stmt) (token.Pos, bool) {
	switch s := s.(type) {
	case *ast.AssignStmt:
		for _, l := range s.Lhs {
			if id, ok := l.(*ast.Ident); ok && id.Name == "err" {
				return id.Pos(), true
			}
		}
	case *ast.DeclStmt:
		if g, ok := s.Decl.(*ast.GenDecl); ok && g.Tok == token.VAR {
			for _, sp := range g.Specs {
				if v, ok := sp.(*ast.ValueSpec); ok && len(v.Values) > 0 {
					for _, n := range v.Names {
						if n.Name == "err" {
							return n.Pos(), true
						}
					}
				}
			}
		}
	}
	return token.NoPos, false
}

// readBeforeWrite reports whether the statements in conts (in order) read err
// before a statement that assigns err without reading it.
func readBeforeWrite(conts [][]ast.Stmt) bool {
	for _, list := range conts {
		for _, s := range list {
			if readsErr(s) {
				return true
			}
			if _, ok := assignsErr(s); ok {
				return false
			}
		}
	}
	return false
}

// readsErr reports whether s reads err anywhere (an assignment's left side is
// not a read; everything else, closures included, is).
func readsErr(s ast.Stmt) bool { return nodeReadsErr(s) }

func blockReadsErr(b *ast.BlockStmt) bool { return b != nil && nodeReadsErr(b) }

func exprReadsErr(e ast.Expr) bool { return e != nil && nodeReadsErr(e) }

func nodeReadsErr(n ast.Node) bool {
	found := false
	ast.Inspect(n, func(n ast.Node) bool {
		if found {
			return false
		}
		switch n := n.(type) {
		case *ast.FuncLit:
			return false // its err is its own (or read when it runs, unknown here)
		case *ast.AssignStmt:
			for _, l := range n.Lhs {
				if _, ok := l.(*ast.Ident); !ok && nodeReadsErr(l) {
					found = true
				}
			}
			for _, r := range n.Rhs {
				if nodeReadsErr(r) {
					found = true
				}
			}
			return false
		case *ast.Ident:
			if n.Name == "err" {
				found = true
			}
		}
		return true
	})
	return found
}

// keepVars appends "; _ = name" after every top-level statement of a
// statement fragment that declares variables other than err, so that a
// fragment may leave values for the reader's code that follows it. body is
// the fragment's statement list in file; src is the file's text.
func keepVars(fset *token.FileSet, body []ast.Stmt, src string) string {
	type ins struct {
		off  int
		text string
	}
	var inserts []ins
	for _, s := range body {
		var names []string
		switch s := s.(type) {
		case *ast.AssignStmt:
			if s.Tok == token.DEFINE {
				for _, l := range s.Lhs {
					if id, ok := l.(*ast.Ident); ok {
						names = append(names, id.Name)
					}
				}
			}
		case *ast.DeclStmt:
			if g, ok := s.Decl.(*ast.GenDecl); ok && g.Tok == token.VAR {
				for _, sp := range g.Specs {
					names = append(names, specNames(sp)...)
				}
			}
		}
		var b strings.Builder
		for _, n := range names {
			if n != "_" && n != "err" {
				b.WriteString("; _ = " + n)
			}
		}
		if b.Len() > 0 {
			inserts = append(inserts, ins{fset.File(s.End()).Offset(s.End()), b.String()})
		}
	}
	for i := len(inserts) - 1; i >= 0; i-- {
		src = src[:inserts[i].off] + inserts[i].text + src[inserts[i].off:]
	}
	return src
}

package doccheck_test

import (
	"go/parser"
	"go/token"
	"slices"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/doccheck"
)

func TestExtract(t *testing.T) {
	t.Parallel()
	doc := "# T\n" + // 1
		"```go\n" + // 2
		"x := 1\n" + // 3
		"```\n" + // 4
		"<!-- snippet: generated -->\n" + // 5
		"\n" + // 6
		"```go title=gen\n" + // 7
		"q := db.New(pool)\n" + // 8
		"```\n" + // 9
		"```sql\n" + // 10
		"SELECT 1;\n" + // 11
		"```\n" + // 12
		"  ~~~~Golang\n" + // 13
		"  ```\n" + // 14: not a closing fence (backticks)
		"    y := 2\n" + // 15
		"  ~~~~~\n" + // 16
		"````go\n" + // 17
		"```\n" + // 18: shorter than the opening fence
		"````\n" // 19
	blocks, err := doccheck.Extract("d.md", []byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		fence, line int
		lang, dir   string
		text        string
	}
	wants := []want{
		{2, 3, "go", "", "x := 1\n"},
		{7, 8, "go", "generated", "q := db.New(pool)\n"},
		{10, 11, "sql", "", "SELECT 1;\n"},
		{13, 14, "golang", "", "```\n  y := 2\n"},
		{17, 18, "go", "", "```\n"},
	}
	if len(blocks) != len(wants) {
		t.Fatalf("got %d blocks, want %d: %+v", len(blocks), len(wants), blocks)
	}
	for i, w := range wants {
		b := blocks[i]
		if b.FenceLine != w.fence || b.Line != w.line || b.Lang != w.lang || b.Directive != w.dir || b.Text != w.text {
			t.Errorf("block %d = %+v, want %+v", i, b, w)
		}
	}
	if !blocks[1].Generated() || blocks[0].Generated() || !blocks[3].IsGo() || blocks[2].IsGo() {
		t.Error("Generated/IsGo wrong")
	}
}

func TestExtractRefuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, doc, want string }{
		{"unknown directive", "<!-- snippet: skip it does not compile -->\n```go\nx\n```\n", `d.md:1: unknown snippet directive "skip it does not compile"`},
		{"empty directive", "<!-- snippet: -->\n```go\nx\n```\n", `d.md:1: unknown snippet directive ""`},
		{"malformed directive", "<!-- snippet: generated\n```go\nx\n```\n", "d.md:1: malformed snippet directive"},
		{"directive on a sql block", "<!-- snippet: generated -->\n```sql\nx\n```\n", "d.md:1: snippet directive \"generated\" does not come right before a ```go block"},
		{"directive before prose", "<!-- snippet: generated -->\ntext\n```go\nx\n```\n", "d.md:1: snippet directive"},
		{"directive at the end", "```go\nx\n```\n<!-- snippet: generated -->\n", "d.md:4: snippet directive"},
		{"unclosed fence", "text\n```go\nx := 1\n", "d.md:2: code fence ``` is never closed"},
	} {
		_, err := doccheck.Extract("d.md", []byte(tc.doc))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", tc.name, err, tc.want)
		}
	}
}

func wrapTest(t *testing.T, text string) *doccheck.Snippet {
	t.Helper()
	prelude, err := doccheck.ParsePrelude([]byte(`package snippet

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	ctx  context.Context
	pool *pgxpool.Pool
)

func render(ctx context.Context) string { return "" }
`))
	if err != nil {
		t.Fatal(err)
	}
	imports := map[string]string{"pglock": "github.com/pgfence/pgfence/pglock"}
	for k, v := range doccheck.KnownImports {
		imports[k] = v
	}
	s, err := doccheck.Wrap(doccheck.Block{Doc: "d.md", FenceLine: 9, Line: 10, Lang: "go", Text: text}, "/abs/d.md", prelude, imports)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestWrapKinds(t *testing.T) {
	t.Parallel()

	file := wrapTest(t, "package main\n\nfunc main() {}\n")
	if file.Kind != doccheck.KindFile || string(file.Files["snippet.go"]) != "//line /abs/d.md:10:1\npackage main\n\nfunc main() {}\n" || len(file.Files) != 1 {
		t.Errorf("whole file: %v %q", file.Kind, file.Files)
	}

	// Declarations: a block's own render replaces the prelude's, and the
	// prelude's imports follow what is left of it.
	decls := wrapTest(t, "func render(ctx context.Context) string {\n\treturn fmt.Sprint(time.Now())\n}\n")
	src := string(decls.Files["snippet.go"])
	if decls.Kind != doccheck.KindDecls || !strings.Contains(src, "\t\"fmt\"\n\t\"time\"\n") || !strings.Contains(src, "//line /abs/d.md:10:1\nfunc render") {
		t.Errorf("declarations: %v\n%s", decls.Kind, src)
	}
	if p := string(decls.Files["prelude.go"]); strings.Contains(p, "func render") || !strings.Contains(p, "pool") {
		t.Errorf("prelude not filtered:\n%s", p)
	}

	// Statements: leading imports hoisted with their line, known package names
	// imported, unknown ones left to the compiler, top-level variables kept.
	stmts := wrapTest(t, "import \"github.com/pgfence/pgfence/migrations\"\n\nlocker, err := pglock.New(pool, nil)\nif err != nil {\n\treturn err\n}\nx := unknownpkg.Thing\nreturn migrations.UpPool(ctx, pool)\n")
	src = string(stmts.Files["snippet.go"])
	for _, want := range []string{
		"import (\n\t\"github.com/pgfence/pgfence/pglock\"\n)\n",
		"//line /abs/d.md:10:1\nimport \"github.com/pgfence/pgfence/migrations\"\n",
		"//line /abs/d.md:11:1\n\nlocker, err := pglock.New(pool, nil); _ = locker\n",
		"x := unknownpkg.Thing; _ = x\n",
		"func _() error {\nif true {\n",
	} {
		if !strings.Contains(src, want) {
			t.Errorf("statements: missing %q in\n%s", want, src)
		}
	}
	if stmts.Kind != doccheck.KindStmts || strings.Contains(src, "context") {
		t.Errorf("statements: kind %v, or an import for the prelude's name ctx:\n%s", stmts.Kind, src)
	}
}

func TestWrapRefusesGarbage(t *testing.T) {
	t.Parallel()
	prelude, err := doccheck.ParsePrelude([]byte("package snippet\n"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = doccheck.Wrap(doccheck.Block{Doc: "d.md", FenceLine: 1, Line: 2, Lang: "go", Text: "if err != nil { ... }\n"}, "/abs/d.md", prelude, nil)
	if err == nil || !strings.Contains(err.Error(), "d.md:2:17: expected statement") || strings.Contains(err.Error(), "/abs/") {
		t.Fatalf("err = %v", err)
	}
}

func TestUncheckedErrs(t *testing.T) {
	t.Parallel()
	src := `package p

func f() error {
	a, err := g()
	if err != nil {
		return err
	}
	_, err = g() // line 8: overwritten below before any read
	_, err = g()
	if err != nil {
		return err
	}
	if _, err := g(); errors.Is(err, x) {
	}
	_, err = g() // line 15: never read
	for range a {
		err = h() // line 17: the rest of the loop body and of f do not read it
	}
	pgx.BeginFunc(func() error {
		_, err := g() // line 20: the closure's own err, never read
		return nil
	})
	err = h()
	return err
}

func named() (err error) {
	err = h()
	return
}
`
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	got := doccheck.UncheckedErrs(fset, f)
	want := []string{
		"p.go:15:5: err is assigned and never checked",
		"p.go:17:3: err is assigned and never checked",
		"p.go:20:6: err is assigned and never checked",
		"p.go:8:5: err is assigned and never checked",
	}
	if !slices.Equal(got, want) {
		t.Errorf("UncheckedErrs =\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

package doccheck_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/doccheck"
)

// env is what every compiling test needs: the module, the go command, the
// prelude and the import table.
type env struct {
	root, modulePath, goBin string
	prelude                 *doccheck.Prelude
	imports                 map[string]string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	root, modulePath, err := doccheck.ModuleRoot(".")
	if err != nil {
		t.Fatal(err)
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to compile the documentation's Go blocks: %v", err)
	}
	// The blocks import the observe adapters, modules of their own that only
	// the repository's go.work puts next to the library.
	out, err := exec.Command(goBin, "env", "GOWORK").Output()
	if err != nil {
		t.Fatalf("go env GOWORK: %v", err)
	}
	if gowork := strings.TrimSpace(string(out)); gowork != filepath.Join(root, "go.work") {
		t.Fatalf("the documentation's Go blocks compile in the repository's workspace (%s), the go command uses %q: unset GOWORK",
			filepath.Join(root, "go.work"), gowork)
	}
	src, err := os.ReadFile(filepath.Join("testdata", "prelude.go"))
	if err != nil {
		t.Fatal(err)
	}
	prelude, err := doccheck.ParsePrelude(src)
	if err != nil {
		t.Fatal(err)
	}
	mod, err := doccheck.ModuleImports(root, modulePath)
	if err != nil {
		t.Fatal(err)
	}
	imports := map[string]string{}
	for name, p := range doccheck.KnownImports {
		imports[name] = p
	}
	for name, p := range mod {
		imports[name] = p
	}
	return &env{root: root, modulePath: modulePath, goBin: goBin, prelude: prelude, imports: imports}
}

// workDir returns a new directory for snippet packages inside the module,
// removed when t ends. Directories left by a test binary that was killed are
// removed after an hour (a concurrent run's are younger).
func (e *env) workDir(t *testing.T) string {
	t.Helper()
	parent, err := filepath.Abs("testdata")
	if err != nil {
		t.Fatal(err)
	}
	if old, _ := filepath.Glob(filepath.Join(parent, "tmp-*")); len(old) > 0 {
		for _, d := range old {
			if fi, err := os.Stat(d); err == nil && time.Since(fi.ModTime()) > time.Hour {
				_ = os.RemoveAll(d)
			}
		}
	}
	dir, err := os.MkdirTemp(parent, "tmp-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove %s: %v", dir, err)
		}
	})
	return dir
}

// compile wraps and compiles the Go blocks (generated ones excluded) and
// returns, per block, what is wrong with it.
func (e *env) compile(t *testing.T, blocks []doccheck.Block) (checked []*doccheck.Snippet, problems map[doccheck.Block]string) {
	t.Helper()
	problems = map[doccheck.Block]string{}
	for _, b := range blocks {
		if !b.IsGo() || b.Generated() {
			continue
		}
		s, err := doccheck.Wrap(b, filepath.Join(e.root, filepath.FromSlash(b.Doc)), e.prelude, e.imports)
		if err != nil {
			problems[b] = err.Error()
			continue
		}
		if len(s.Problems) > 0 {
			problems[b] = strings.Join(s.Problems, "\n") + "\n"
		}
		checked = append(checked, s)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	failed, err := doccheck.Compile(ctx, e.goBin, e.root, e.modulePath, e.workDir(t), checked)
	if err != nil {
		t.Fatal(err)
	}
	for i, msg := range failed {
		problems[checked[i].Block] += msg
	}
	return checked, problems
}

// TestDocsCompile compiles every Go block of README.md and docs/**/*.md.
func TestDocsCompile(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	docs, err := doccheck.Docs(e.root)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []doccheck.Block
	generated := 0
	for _, doc := range docs {
		src, err := os.ReadFile(filepath.Join(e.root, filepath.FromSlash(doc)))
		if err != nil {
			t.Fatal(err)
		}
		bs, err := doccheck.Extract(doc, src)
		if err != nil {
			t.Error(err)
		}
		for _, b := range bs {
			if b.IsGo() {
				blocks = append(blocks, b)
				if b.Generated() {
					generated++
				}
			}
		}
	}
	if len(blocks) == 0 {
		t.Fatalf("no Go blocks found in %v: the extractor is broken or the README lost its examples", docs)
	}
	start := time.Now()
	checked, problems := e.compile(t, blocks)
	kinds := map[doccheck.Kind]int{}
	for _, s := range checked {
		kinds[s.Kind]++
	}
	t.Logf("%d Go blocks in %s: %d whole files, %d declarations, %d statements compiled in %v; %d generated skipped",
		len(blocks), strings.Join(docs, ", "), kinds[doccheck.KindFile], kinds[doccheck.KindDecls], kinds[doccheck.KindStmts],
		time.Since(start).Round(time.Millisecond), generated)
	for _, b := range blocks {
		if msg, ok := problems[b]; ok {
			t.Errorf("%s: the Go block does not compile:\n%s", b, indent(msg))
		}
	}
}

func indent(s string) string {
	var b strings.Builder
	for line := range strings.Lines(strings.TrimRight(s, "\n")) {
		fmt.Fprintf(&b, "\t%s", line)
	}
	return b.String()
}

// TestCompileReportsDocumentLines runs the whole pipeline on a document with
// a good block, the two usual faults and a generated block, and checks that
// each fault is reported at its document line and nothing else is.
func TestCompileReportsDocumentLines(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	doc := "# Broken\n" + // 1
		"```go\n" + // 2
		"lease, err := locker.Acquire(ctx, \"x\", time.Second)\n" + // 3
		"if err != nil {\n" + // 4
		"\treturn err\n" + // 5
		"}\n" + // 6
		"defer lease.Release(context.Background())\n" + // 7
		"```\n" + // 8
		"```go\n" + // 9
		"_, err := skiplocked.Enqueue(ctx, pool, skiplocked.EnqueueParams{Queue: \"q\"})\n" + // 10
		"```\n" + // 11
		"```go\n" + // 12
		"tag, err := pool.Exec(ctx, \"SELECT 1\")\n" + // 13
		"if err != nil {\n" + // 14
		"\treturn err\n" + // 15
		"}\n" + // 16
		"_, err = pool.Exec(ctx, \"SELECT 2\")\n" + // 17
		"return fmt.Errorf(\"%d rows\", tag.RowsAffected())\n" + // 18
		"```\n" + // 19
		"<!-- snippet: generated -->\n" + // 20
		"```go\n" + // 21
		"q := db.New(pool)\n" + // 22
		"```\n" + // 23
		"```go\n" + // 24
		"func f() { pglock.NoSuchThing() }\n" + // 25
		"```\n" // 26
	blocks, err := doccheck.Extract("fake.md", []byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	checked, problems := e.compile(t, blocks)
	if len(checked) != 4 {
		t.Fatalf("%d blocks compiled, want 4 (the generated one skipped)", len(checked))
	}
	wants := map[int][]string{ // fence line → messages
		9:  {"fake.md:10:4: declared and not used: err", "fake.md:10:4: err is assigned and never checked"},
		12: {"fake.md:17:4: err is assigned and never checked"},
		24: {"fake.md:25:19: undefined: pglock.NoSuchThing"},
	}
	for _, b := range blocks {
		msg, bad := problems[b]
		want := wants[b.FenceLine]
		if bad != (len(want) > 0) {
			t.Errorf("block at line %d: problems %q, want %q", b.FenceLine, msg, want)
		}
		for _, w := range want {
			if !strings.Contains(msg, w) {
				t.Errorf("block at line %d: problems %q, want them to contain %q", b.FenceLine, msg, w)
			}
		}
	}
}

// TestCompileMainAlone: a failing whole-file main package, built alone, leaves
// no binary in the module root.
func TestCompileMainAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	blocks, err := doccheck.Extract("fake.md", []byte("```go\npackage main\n\nfunc main() {\n\tx := 1\n}\n```\n"))
	if err != nil {
		t.Fatal(err)
	}
	_, problems := e.compile(t, blocks)
	if msg := problems[blocks[0]]; !strings.Contains(msg, "fake.md:5:2: declared and not used: x") {
		t.Fatalf("problems = %q", msg)
	}
	entries, err := os.ReadDir(e.root)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range entries {
		if strings.HasPrefix(de.Name(), "s000_") {
			t.Errorf("%s left in the module root", de.Name())
		}
	}
}

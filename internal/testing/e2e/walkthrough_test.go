package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// walkthroughScript turns the generator walk-through of docs/fencedwrite.md
// (from its heading to step 4) into one shell script, in the document's
// order: every ```sh block as written, and every other block whose
// paragraph starts with a backquoted file name (`sqlc.yaml`,
// `db/migrations/00001_invoices.sql`) written to that file.
func walkthroughScript(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "fencedwrite.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "## Generated helpers for your tables")
	end := strings.Index(doc, "**4. Call the generated methods**")
	if start < 0 || end < start {
		t.Fatal("docs/fencedwrite.md: the walk-through's heading or its step 4 is gone")
	}
	doc = doc[start:end]
	script := []string{"set -eu"}
	files := 0
	var para []string // the paragraph before the current line
	lines := strings.Split(doc, "\n")
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		lang, isFence := strings.CutPrefix(line, "```")
		if !isFence {
			if strings.TrimSpace(line) == "" {
				if len(lines) > i+1 && !strings.HasPrefix(lines[i+1], "```") {
					para = nil
				}
			} else {
				para = append(para, line)
			}
			continue
		}
		var body strings.Builder
		for i++; i < len(lines) && lines[i] != "```"; i++ {
			body.WriteString(lines[i] + "\n")
		}
		if lang == "sh" {
			script = append(script, body.String())
		} else if len(para) > 0 {
			// A paragraph that starts with a backquoted path names the file.
			if name := regexp.MustCompile("^`([^` ]+)`").FindStringSubmatch(para[0]); name != nil {
				files++
				script = append(script, "mkdir -p \"$(dirname '"+name[1]+"')\"\ncat > '"+name[1]+"' <<'PGFENCE_EOF'\n"+body.String()+"PGFENCE_EOF")
			}
		}
		para = nil
	}
	if files != 2 {
		t.Fatalf("the walk-through writes %d files, want 2 (sqlc.yaml and the table's migration)", files)
	}
	return strings.Join(script, "\n")
}

// TestFencedWalkthrough runs the generator walk-through of
// docs/fencedwrite.md as a reader would, from an empty directory: go mod
// init, the two files it shows, pgfence migrate up, goose up, gen fenced
// --check, goose up, sqlc generate. The commands are the pgfence CLI built
// from this checkout, the sqlc of `make tools`, and a stand-in for the goose
// command (testdata/goose: the goose library, `goose -dir DIR postgres DSN
// up` only).
func TestFencedWalkthrough(t *testing.T) {
	t.Parallel()
	bin := t.TempDir()
	if err := os.Symlink(sqlcBinary(t), filepath.Join(bin, "sqlc")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(pgfenceBinary(t), filepath.Join(bin, "pgfence")); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", "build", "-o", filepath.Join(bin, "goose"), "./internal/testing/e2e/testdata/goose")
	build.Dir = repoRoot(t)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the goose stand-in: %v\n%s", err, out)
	}
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	script := walkthroughScript(t)
	out := run(t, dir, []string{
		"PATH=" + bin + string(os.PathListSeparator) + filepath.Dir(gobin) + string(os.PathListSeparator) + "/usr/bin:/bin",
		"DATABASE_URL=" + pgtest.EmptyDSN(t),
	}, "bash", "-c", script)
	t.Logf("script:\n%s\noutput:\n%s", script, out)
	app := filepath.Join(dir, "invoices")
	code, err := os.ReadFile(filepath.Join(app, "db", "fenced_invoices.sql.go"))
	if err != nil {
		t.Fatalf("sqlc wrote no Go for the generated queries: %v", err)
	}
	if !strings.Contains(string(code), "func (q *Queries) FencedUpdateInvoices(") {
		t.Fatalf("db/fenced_invoices.sql.go has no FencedUpdateInvoices:\n%s", code)
	}
	migs, err := filepath.Glob(filepath.Join(app, "db", "migrations", "*_pgfence_fence_invoices.sql"))
	if err != nil || len(migs) != 1 {
		t.Fatalf("fence-column migrations: %v %v", migs, err)
	}
	if !strings.Contains(out, "OK "+filepath.Base(migs[0])) {
		t.Fatalf("goose did not apply %s:\n%s", filepath.Base(migs[0]), out)
	}
}

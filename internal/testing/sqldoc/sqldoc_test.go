package sqldoc_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/localpg"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/internal/testing/sqldoc"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The document under test, relative to this package.
const docPath = "../../../docs/sql.md"

// psqlBinary returns the psql client: on PATH, or next to the server
// binaries the test harness uses. The test fails when there is none.
func psqlBinary(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("psql"); err == nil {
		return p
	}
	if dir, err := localpg.FindBinDir(); err == nil {
		p := filepath.Join(dir, "psql")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatalf("the psql client is needed to run the blocks of docs/sql.md and was found neither on PATH " +
		"nor next to the PostgreSQL server binaries: install it (Debian/Ubuntu: apt-get install postgresql-client)")
	return ""
}

// psqlError matches psql's report of an error in a script run with -f and
// VERBOSITY verbose: "psql:FILE:LINE: ERROR:  SQLSTATE: message".
var psqlError = regexp.MustCompile(`(?m)^psql:[^\n]*?:(\d+): ERROR:  ([0-9A-Z]{5}): `)

// roleIn matches the documented role's name where an owner block grants to
// it or revokes from it.
var roleIn = regexp.MustCompile(`\b(TO|FROM)\s+app\b`)

// TestSQLDoc runs docs/sql.md as a new user would: from a fresh migrated
// database, with the application role created from docs/migrations.md's
// grants, it feeds every block marked run or fails to the psql client, in
// the document's order, as the role the block names, and checks the result
// and the output the directive expects (see package sqldoc).
func TestSQLDoc(t *testing.T) {
	src, err := os.ReadFile(docPath)
	if err != nil {
		t.Fatal(err)
	}
	steps, err := sqldoc.Parse("docs/sql.md", src)
	if err != nil {
		t.Fatal(err)
	}
	psql := psqlBinary(t)
	ownerDSN := pgtest.DSN(t)
	appName, appDSN := pgtest.DocRole(t, "migrations.md", ownerDSN, "app")
	dir := t.TempDir()

	ran := 0
	var ranText strings.Builder
	for i, s := range steps {
		if s.Skip != "" {
			continue
		}
		ran++
		text, dsn := s.Block.Text, appDSN
		if s.As == "owner" {
			text, dsn = roleIn.ReplaceAllString(text, "${1} "+appName), ownerDSN
		} else {
			ranText.WriteString(text)
		}
		file := filepath.Join(dir, "block"+strconv.Itoa(i)+".sql")
		if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		out, code := runPsql(t, psql, dsn, file)
		where := s.String() + " (as " + s.As + ")"
		errs := psqlError.FindAllStringSubmatch(out, -1)
		switch {
		case s.Fails == "" && code != 0:
			t.Fatalf("%s: psql exited with %d, want success:\n%s", where, code, out)
		case s.Fails != "" && (code != 3 || len(errs) != 1):
			t.Fatalf("%s: want psql to stop with SQLSTATE %s (exit 3, one error); exit %d:\n%s", where, s.Fails, code, out)
		case s.Fails != "" && errs[0][2] != s.Fails:
			t.Fatalf("%s: failed with SQLSTATE %s, want %s:\n%s", where, errs[0][2], s.Fails, out)
		case s.Fails != "":
			// The error names the script line where the failing statement
			// ends: it must be the block's last statement.
			if line, _ := strconv.Atoi(errs[0][1]); line != sqldoc.LastStatementLine(text) {
				t.Fatalf("%s: failed at line %d of the block, but its last statement ends at line %d: "+
					"the statements after the failure never run:\n%s", where, line, sqldoc.LastStatementLine(text), out)
			}
		}
		if missing := sqldoc.Missing(out, s.Expect); len(missing) > 0 {
			t.Fatalf("%s: output has no line containing %q:\n%s", where, missing, out)
		}
		t.Logf("%s: ok\n%s", where, out)
	}
	if ran == 0 {
		t.Fatal("docs/sql.md has no block marked run or fails")
	}

	// The reference covers every function the application role may call:
	// each appears in a block run as that role.
	calls := ranText.String()
	for _, g := range pgtest.DocGrants(t, "migrations.md", "app", "app") {
		if !strings.HasPrefix(g, "GRANT EXECUTE") {
			continue
		}
		for _, m := range regexp.MustCompile(`pgfence\.(\w+)\(`).FindAllStringSubmatch(g, -1) {
			if !strings.Contains(calls, "pgfence."+m[1]+"(") {
				t.Errorf("docs/sql.md runs no example of pgfence.%s as the application role", m[1])
			}
		}
	}
}

// runPsql feeds file to psql connected to dsn and returns its output
// (stdout and stderr, interleaved as written) and exit code.
func runPsql(t *testing.T, psql, dsn, file string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, psql, "-X", "--no-password",
		"-v", "ON_ERROR_STOP=1", "-v", "VERBOSITY=verbose", "-f", file, dsn)
	// Only the DSN says where to connect: no PG* variable of the environment.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "PGAPPNAME=pgfence-sqldoc", "PGTZ=UTC")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &exit):
		return string(out), exit.ExitCode()
	default:
		t.Fatalf("run %s: %v\n%s", psql, err, out)
		return "", -1
	}
}

// TestParse checks the directives: what each word means and what is refused.
func TestParse(t *testing.T) {
	doc := func(directive, lang string) []byte {
		return []byte("Intro.\n\n" + directive + "\n\n```" + lang + "\nSELECT 1;\n```\n")
	}
	good := []struct {
		directive, lang string
		want            sqldoc.Step
	}{
		{`<!-- sql: run -->`, "sql", sqldoc.Step{As: "app"}},
		{`<!-- sql: run as=owner -->`, "psql", sqldoc.Step{As: "owner"}},
		{`<!-- sql: fails=PF003 expect="stale token" -->`, "sql", sqldoc.Step{As: "app", Fails: "PF003", Expect: []string{"stale token"}}},
		{`<!-- sql: run expect="released   |  t" expect="(1 row)" -->`, "sql", sqldoc.Step{As: "app", Expect: []string{"released | t", "(1 row)"}}},
		{`<!-- sql: skip="pseudo-code" -->`, "text", sqldoc.Step{Skip: "pseudo-code", As: "app"}},
	}
	for _, g := range good {
		steps, err := sqldoc.Parse("d.md", doc(g.directive, g.lang))
		if err != nil {
			t.Errorf("%s: %v", g.directive, err)
			continue
		}
		if len(steps) != 1 {
			t.Fatalf("%s: %d steps, want 1", g.directive, len(steps))
		}
		s := steps[0]
		if s.As != g.want.As || s.Fails != g.want.Fails || s.Skip != g.want.Skip ||
			strings.Join(s.Expect, "\x00") != strings.Join(g.want.Expect, "\x00") || s.Block.Line != 6 {
			t.Errorf("%s: got %+v, want %+v", g.directive, s, g.want)
		}
	}
	bad := []struct{ directive, lang, why string }{
		{``, "sql", "block without a directive"},
		{`<!-- sql: -->`, "sql", "exactly one of"},
		{`<!-- sql: run fails=PF003 -->`, "sql", "exactly one of"},
		{`<!-- sql: fails=pf3 -->`, "sql", "SQLSTATE"},
		{`<!-- sql: skip="" -->`, "sql", "needs a reason"},
		{`<!-- sql: skip="x" as=owner -->`, "sql", "takes no as"},
		{`<!-- sql: run as=root -->`, "sql", "app or owner"},
		{`<!-- sql: run expct="x" -->`, "sql", "unknown word"},
		{`<!-- sql: run -->`, "sh", "only ```sql and ```psql"},
		{`<!-- sql: run expect="unterminated -->`, "sql", "malformed"},
	}
	for _, b := range bad {
		_, err := sqldoc.Parse("d.md", doc(b.directive, b.lang))
		if err == nil || !strings.Contains(err.Error(), b.why) {
			t.Errorf("%q before ```%s: error %v, want one saying %q", b.directive, b.lang, err, b.why)
		}
	}
	// A directive with no block after it.
	if _, err := sqldoc.Parse("d.md", []byte("<!-- sql: run -->\n\nText.\n\n<!-- sql: skip=\"x\" -->\n```text\nx\n```\n")); err == nil ||
		!strings.Contains(err.Error(), "d.md:1: sql directive that does not come right before") {
		t.Errorf("stray directive: error %v", err)
	}
}

// TestMissing checks the output matching of expect.
func TestMissing(t *testing.T) {
	out := " released | handed_off \n----------+-----------\n t        | f\n(1 row)\n"
	if m := sqldoc.Missing(out, []string{"t | f", "released | handed_off", "(1 row)"}); len(m) != 0 {
		t.Errorf("missing %q", m)
	}
	if m := sqldoc.Missing(out, []string{"f | t", "released | t"}); len(m) != 2 {
		t.Errorf("missing %q, want both", m)
	}
	if got := sqldoc.LastStatementLine("SELECT 1;\nSELECT 2;\n-- a comment\n\n"); got != 2 {
		t.Errorf("LastStatementLine = %d, want 2", got)
	}
}

package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// testingGuideBlock returns the Go block of docs/testing.md's "The example
// to copy", as written.
func testingGuideBlock(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "testing.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n## The example to copy\n")
	if !ok {
		t.Fatal(`docs/testing.md has no "## The example to copy" section`)
	}
	_, rest, ok = strings.Cut(rest, "```go\n")
	if !ok {
		t.Fatal("docs/testing.md's example has no Go block")
	}
	block, _, ok := strings.Cut(rest, "```")
	if !ok {
		t.Fatal("docs/testing.md's example Go block is not closed")
	}
	return block
}

// TestTestingGuideExample runs docs/testing.md's example as a user would,
// in a module of its own (saved as pay_test.go, `go test`): it passes. Then
// it runs it again with pay writing without the token, the line the guide
// shows: the test must fail, saying the write was accepted.
func TestTestingGuideExample(t *testing.T) {
	t.Parallel()
	block := testingGuideBlock(t)
	const fenced = `_, err := invoices.Update(ctx, db, lease.Token(), []any{id}, []any{status})`
	const unfenced = `_, err := db.Exec(ctx, "UPDATE invoices SET status = $2 WHERE id = $1", id, status)`
	if !strings.Contains(block, fenced) {
		t.Fatalf("the example's pay no longer has the line the mutation replaces: %s", fenced)
	}
	guide, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "testing.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(strings.Fields(string(guide)), " "), strings.TrimPrefix(unfenced, "_, err := ")) {
		t.Fatalf("docs/testing.md no longer shows the unfenced line the test runs: %s", unfenced)
	}
	// The user's test process finds the server through the documented
	// variable: this test's server (its user may CREATE DATABASE).
	env := []string{"PGFENCE_TEST_DATABASE_URL=" + pgtest.AdminDSN(t), "GOWORK=off", "GOFLAGS=-mod=mod"}

	for _, c := range []struct {
		name   string
		code   string
		pass   bool
		output string
	}{
		{"as written", block, true, "ok"},
		{"pay writes without the token", strings.Replace(block, fenced, unfenced, 1), false,
			"pgfencetest.RequireStale: the write was accepted, want it refused as stale"},
	} {
		dir := newModule(t)
		writeFile(t, filepath.Join(dir, "pay", "pay_test.go"), c.code)
		cmd := exec.Command("go", "test", "-count=1", "./pay/")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		switch {
		case c.pass && err != nil:
			t.Fatalf("%s: go test: %v\n%s", c.name, err, out)
		case !c.pass && err == nil:
			t.Fatalf("%s: go test passed, want it to fail\n%s", c.name, out)
		case !strings.Contains(string(out), c.output):
			t.Fatalf("%s: go test output lacks %q:\n%s", c.name, c.output, out)
		}
		t.Logf("%s: %s", c.name, strings.TrimSpace(lastLines(string(out), 3)))
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

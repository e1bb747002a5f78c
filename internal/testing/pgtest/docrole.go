package pgtest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DocStatements returns the statements of the ```sql block of docs/<doc>
// that creates role (the block holding "CREATE ROLE <role>"), with the role
// renamed to name, NOLOGIN made LOGIN, and the lines granting the role to a
// user (GRANT <role> TO ...) left out.
func DocStatements(t testing.TB, doc, role, name string) []string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	b, err := os.ReadFile(filepath.Join(filepath.Dir(file), "..", "..", "..", "docs", doc))
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	var block string
	for _, m := range regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatch(string(b), -1) {
		if strings.Contains(m[1], "CREATE ROLE "+role+" ") {
			block = m[1]
		}
	}
	if block == "" {
		t.Fatalf("pgtest: docs/%s has no sql block creating role %s", doc, role)
	}
	re := regexp.MustCompile(`\b` + regexp.QuoteMeta(role) + `\b`)
	// Line comments go first (the blocks have no "--" inside a string), so
	// that a comment after one statement does not hide the start of the next.
	block = regexp.MustCompile(`--[^\n]*`).ReplaceAllString(block, "")
	var stmts []string
	for _, s := range strings.Split(block, ";") {
		s = strings.TrimSpace(s)
		if s == "" || regexp.MustCompile(`(?i)^GRANT\s+`+regexp.QuoteMeta(role)+`\s+TO\b`).MatchString(s) {
			continue
		}
		s = re.ReplaceAllString(s, name)
		s = regexp.MustCompile(`(?i)\bNOLOGIN\b`).ReplaceAllString(s, "LOGIN")
		stmts = append(stmts, s)
	}
	return stmts
}

// DocGrants is DocStatements without the block's CREATE ROLE: the grants
// of the documented role, for a role name the caller created itself.
func DocGrants(t testing.TB, doc, role, name string) []string {
	t.Helper()
	var grants []string
	for _, st := range DocStatements(t, doc, role, name) {
		if !regexp.MustCompile(`(?i)^CREATE\s+ROLE\b`).MatchString(st) {
			grants = append(grants, st)
		}
	}
	return grants
}

// DocRole creates, in the database of dsn, the role that a ```sql block of
// docs/<doc> creates (the block holding "CREATE ROLE <role>"),
// with exactly the grants that block gives, under a name unique to the test
// (roles are shared by every database of the server). Lines granting the role to a user (GRANT <role> TO ...)
// are left out. It returns the role's name and a DSN of dsn's database as
// that role. The role is dropped when t ends. dsn must be a superuser's.
// Tests use it so that the documented grants are the ones tested.
func DocRole(t testing.TB, doc, dsn, role string) (name, roleDSN string) {
	t.Helper()
	name = fmt.Sprintf("%s_%d_%04d", role, time.Now().UnixNano()%1_000_000, rand.IntN(10000))
	stmts := DocStatements(t, doc, role, name)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	defer admin.Close()
	for _, s := range stmts {
		if _, err := admin.Exec(ctx, s); err != nil {
			t.Fatalf("pgtest: documented grant %q: %v", s, err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Logf("pgtest: drop role %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		id := pgx.Identifier{name}.Sanitize()
		for _, s := range []string{"DROP OWNED BY " + id, "DROP ROLE IF EXISTS " + id} {
			if _, err := conn.Exec(ctx, s); err != nil {
				t.Logf("pgtest: %s: %v", s, err)
			}
		}
	})
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("pgtest: DocRole needs a URL DSN: %v", err)
	}
	u.User = url.User(name)
	return name, u.String()
}

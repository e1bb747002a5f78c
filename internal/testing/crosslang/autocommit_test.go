package crosslang

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestPythonLeaseNeedsIdleAutocommit: the Python client refuses to call a
// lease function on a connection that is not in autocommit mode or has a
// transaction open (docs/sql.md rule 1), before sending anything. In a
// transaction begun earlier the database times the lease from that
// transaction's start, so the client's local deadline fell after the real
// expiry: another worker was granted the lease while valid() was true.
func TestPythonLeaseNeedsIdleAutocommit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	py := python(t)
	admin, roleDSN := setup(t, ctx, "SELECT 1", "SELECT 1 WHERE '%s' <> ''")
	script := `
import sys
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
dsn = sys.argv[2]
with psycopg.connect(dsn) as conn:  # psycopg's default: autocommit off
    try:
        pgfence.acquire(conn, "idle:a", 5, "py")
        print("acquire without autocommit: accepted")
    except ValueError:
        print("acquire without autocommit: refused")
with psycopg.connect(dsn, autocommit=True) as conn:
    lease = pgfence.acquire(conn, "idle:b", 5, "py")
    with conn.transaction():
        for f in (pgfence.renew, pgfence.release):
            try:
                f(conn, lease)
                print(f.__name__ + " in a transaction: accepted")
            except ValueError:
                print(f.__name__ + " in a transaction: refused")
    pgfence.release(conn, lease)
    print("release: ok")
`
	out, err := exec.CommandContext(ctx, py.exe, "-c", script, filepath.Dir(clientPath(t)), roleDSN).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	want := "acquire without autocommit: refused\nrenew in a transaction: refused\nrelease in a transaction: refused\nrelease: ok\n"
	if string(out) != want {
		t.Fatalf("python printed\n%s\nwant\n%s", out, want)
	}
	var names []string
	rows, err := admin.Query(ctx, "SELECT name || ':' || coalesce(holder, '-') FROM pgfence.locks ORDER BY name")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		names = append(names, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// idle:a was never sent; idle:b was granted, then released once.
	if got := strings.Join(names, " "); got != "idle:b:-" {
		t.Fatalf("lock rows %q, want only idle:b, released", got)
	}
}

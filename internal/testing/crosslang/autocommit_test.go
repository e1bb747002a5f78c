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

// TestPythonFencedUpdateRefusals: the Python client tells a write this
// token made already (AlreadyApplied, a StaleToken) from one a newer token
// made (StaleToken), and refuses a key column that is not unique.
func TestPythonFencedUpdateRefusals(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	py := python(t)
	admin, roleDSN := setup(t, ctx, `CREATE TABLE refusals (id int PRIMARY KEY, grp int NOT NULL, v text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO refusals VALUES (1, 1, 'a', 0), (2, 7, 'b', 0), (3, 7, 'c', 0)`,
		"GRANT SELECT, UPDATE ON refusals TO %s")
	script := `
import sys
sys.path.insert(0, sys.argv[1])
import psycopg, pgfence
with psycopg.connect(sys.argv[2], autocommit=True) as conn:
    pgfence.fenced_update(conn, "refusals", "id", 1, {"v": "x"}, 5)
    for token in (5, 4):
        try:
            pgfence.fenced_update(conn, "refusals", "id", 1, {"v": "y"}, token)
            print(token, "accepted")
        except pgfence.StaleToken as e:
            print(token, type(e).__name__, e.fence)
    try:
        pgfence.fenced_update(conn, "refusals", "grp", 7, {"v": "z"}, 9)
    except ValueError:
        print("not unique: ValueError")
`
	out, err := exec.CommandContext(ctx, py.exe, "-c", script, filepath.Dir(clientPath(t)), roleDSN).CombinedOutput()
	if err != nil {
		t.Fatalf("python: %v\n%s", err, out)
	}
	if want := "5 AlreadyApplied 5\n4 StaleToken 5\nnot unique: ValueError\n"; string(out) != want {
		t.Fatalf("python printed\n%s\nwant\n%s", out, want)
	}
	// The refused write to the rows of group 7 changed nothing.
	var rows string
	if err := admin.QueryRow(ctx, "SELECT string_agg(id || '=' || v || '/' || fence, ' ' ORDER BY id) FROM refusals").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != "1=x/5 2=b/0 3=c/0" {
		t.Fatalf("rows after the refusals: %s, want 1=x/5 2=b/0 3=c/0", rows)
	}
}

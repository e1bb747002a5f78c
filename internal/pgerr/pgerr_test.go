package pgerr_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func pg(code string) error { return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code}) }

func TestClassification(t *testing.T) {
	for _, c := range []struct {
		name                       string
		err                        error
		lost, retryable, transient bool
	}{
		{"nil", nil, false, false, false},
		{"canceled", context.Canceled, false, false, false},
		{"deadline", context.DeadlineExceeded, false, false, true},
		{"admin shutdown", pg(pgerr.AdminShutdown), true, true, true},
		{"crash shutdown", pg(pgerr.CrashShutdown), true, true, true},
		{"cannot connect now", pg(pgerr.CannotConnectNow), true, true, true},
		{"connection failure 08006", pg("08006"), true, true, true},
		{"serialization failure", pg(pgerr.SerializationFailure), false, true, true},
		{"deadlock", pg(pgerr.DeadlockDetected), false, true, true},
		{"too many connections 53300", pg("53300"), false, false, true},
		{"statement timeout", pg(pgerr.QueryCanceled), false, false, true},
		{"lock timeout", pg(pgerr.LockNotAvailable), false, false, false},
		{"unique violation", pg("23505"), false, false, false},
		{"EOF", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true, true, true},
		{"net.ErrClosed", net.ErrClosed, true, true, true},
		{"net.OpError", &net.OpError{Op: "read", Err: errors.New("connection reset")}, true, true, true},
		{"conn closed", fmt.Errorf("x: %w", pgconn.ErrConnClosed), true, true, true},
		{"tx closed", pgx.ErrTxClosed, false, false, true},
		{"plain error", errors.New("boom"), false, false, true},
	} {
		if got := pgerr.IsConnectionLost(c.err); got != c.lost {
			t.Errorf("%s: IsConnectionLost = %v, want %v", c.name, got, c.lost)
		}
		if got := pgerr.IsRetryable(c.err); got != c.retryable {
			t.Errorf("%s: IsRetryable = %v, want %v", c.name, got, c.retryable)
		}
		if got := pgerr.IsTransient(c.err); got != c.transient {
			t.Errorf("%s: IsTransient = %v, want %v", c.name, got, c.transient)
		}
	}
	if pgerr.NotExecuted(false, pg(pgerr.AdminShutdown)) {
		t.Error("NotExecuted on an open connection")
	}
	if !pgerr.NotExecuted(true, pg(pgerr.AdminShutdown)) || pgerr.NotExecuted(true, pg("23505")) {
		t.Error("NotExecuted misclassifies a closed connection's errors")
	}
	if pgerr.Code(errors.New("x")) != "" || pgerr.Code(pg("40001")) != "40001" {
		t.Error("Code")
	}
}

// A real terminated backend and a real closed pool are recognised.
func TestRealConnectionLoss(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(ctx, "SELECT 1")
	if err == nil || !pgerr.IsConnectionLost(err) || !pgerr.IsRetryable(err) || !pgerr.IsTransient(err) {
		t.Fatalf("statement on a terminated backend: %v (lost %v)", err, pgerr.IsConnectionLost(err))
	}
	if !pgerr.NotExecuted(conn.Conn().IsClosed(), err) {
		t.Errorf("NotExecuted(%v) = false for a backend terminated while idle", err)
	}
	closed, err := pgxpool.New(ctx, pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	_, err = closed.Exec(ctx, "SELECT 1")
	if !pgerr.IsConnectionLost(err) {
		t.Fatalf("closed pool: %v not a lost connection", err)
	}
}

func TestSchemaMissing(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"no schema", &pgconn.PgError{Code: pgerr.InvalidSchemaName, Message: `schema "pgfence" does not exist`}, true},
		{"no pgfence relation", &pgconn.PgError{Code: pgerr.UndefinedTable, Message: `relation "pgfence.locks" does not exist`}, true},
		{"no pgfence function (older schema)", fmt.Errorf("w: %w", &pgconn.PgError{Code: pgerr.UndefinedFunction,
			Message: "function pgfence.lock_grant(text, text, bigint, bytea) does not exist"}), true},
		{"the caller's table", &pgconn.PgError{Code: pgerr.UndefinedTable, Message: `relation "import_rows" does not exist`}, false},
		{"another schema", &pgconn.PgError{Code: pgerr.InvalidSchemaName, Message: `schema "nope" does not exist`}, false},
		{"the caller's function", &pgconn.PgError{Code: pgerr.UndefinedFunction, Message: "function public.f() does not exist"}, false},
		{"not from the server", errors.New(`relation "pgfence.locks" does not exist`), false},
		{"nil", nil, false},
	} {
		if got := pgerr.SchemaMissing(c.err); got != c.want {
			t.Errorf("%s: SchemaMissing = %v, want %v", c.name, got, c.want)
		}
		if c.err == nil {
			continue
		}
		if got := pgerr.Describe(c.err); strings.HasPrefix(got, pgerr.SchemaHint) != c.want || !strings.HasSuffix(got, c.err.Error()) {
			t.Errorf("%s: Describe = %q", c.name, got)
		}
	}
}

// TestParseGuardTokenTableNames: the token of a guard's refusal is found
// whatever the table's name holds (spaces, a newline), and a lock name
// after the token that repeats the phrase does not move it; a name with a
// space gave token 0.
func TestParseGuardTokenTableNames(t *testing.T) {
	for _, c := range []struct {
		msg  string
		want int64
	}{
		{"pgfence guard: INSERT of public.my t carries token 1 but lock 'L' has granted 2 since (superseded holder)", 1},
		{"pgfence guard: UPDATE of my schema.a\nb carries token 7 but lock 'L' issued only 3", 7},
		{"pgfence guard: UPDATE of public.t carries token 4 but lock 'x carries token 9 but lock ' has granted 5 since (superseded holder)", 4},
		{"pgfence guard: DELETE from public.my t with stale token 12 (row fence 15)", 12},
		{"pgfence guard: DELETE from public.t carries no fencing token", 0},
	} {
		if got := pgerr.ParseGuardToken(c.msg); got != c.want {
			t.Errorf("pgerr.ParseGuardToken(%q) = %d; want %d", c.msg, got, c.want)
		}
	}
}

// TestParseConfigText: the text of a parse error of pgx keeps what is wrong
// and none of the connection string, password included, even where pgx's
// own mask leaves part of it.
func TestParseConfigText(t *testing.T) {
	_, err := pgconn.ParseConfig(`host=127.0.0.1 port=abc user=ci password=hunter2\ topsecret`)
	rest, ok := pgerr.ParseConfigText(err)
	if !ok || rest != "invalid port" {
		t.Fatalf("ParseConfigText(%v) = %q, %v; want \"invalid port\", true", err, rest, ok)
	}
	if rest, ok := pgerr.ParseConfigText(errors.New("cannot parse `x`: y")); ok || rest != "" {
		t.Errorf("ParseConfigText of another error = %q, %v; want \"\", false", rest, ok)
	}
}

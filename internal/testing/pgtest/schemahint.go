package pgtest

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// WantSchemaHint fails t unless err, returned by call on a database without
// pgfence's schema, says that the schema is missing and to run
// "pgfence migrate up" as the schema owner, and still wraps the server's
// *pgconn.PgError.
func WantSchemaHint(t testing.TB, call string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s on a database without schema pgfence: no error", call)
		return
	}
	msg := err.Error()
	if !strings.Contains(msg, "schema pgfence is missing") || !strings.Contains(msg, `"pgfence migrate up"`) ||
		!strings.Contains(msg, "as the schema owner") {
		t.Errorf("%s on a database without schema pgfence: %q does not say the schema is missing and to run \"pgfence migrate up\" as the schema owner", call, msg)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		t.Errorf("%s: %v does not wrap the server's error", call, err)
	}
}

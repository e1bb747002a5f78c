package cli

import (
	"strings"
	"testing"
)

// TestConnectionErrorsHideThePassword: a malformed connection string is
// reported without its password, in every syntax libpq accepts (pgx's own
// redaction misses "password = x" with spaces around '=').
func TestConnectionErrorsHideThePassword(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"password = s3cr3tpw host=localhost port = abc",
		"host=localhost password='s3cr3tpw with space' port=abc",
		"host=localhost password=s3cr3tpw sslmode=bogus",
		"postgres://app:s3cr3tpw@localhost:abc/db",
		"postgres://app:s3cr3tpw@localhost/db?sslmode=bogus",
		"postgres://app:s3%zzcr3tpw@localhost/db",
		"postgresql://app:s3cr3tpw@[::1/db",
	} {
		r := run(t, dsn, "locks")
		if r.code != ExitUsage {
			t.Errorf("%q: exit %d, want %d (%s)", dsn, r.code, ExitUsage, r.stderr)
		}
		all := r.stdout + r.stderr
		if strings.Contains(all, "s3cr3tpw") || strings.Contains(all, "cr3tpw") {
			t.Errorf("%q: the password is printed: %s", dsn, all)
		}
		if !strings.Contains(r.stderr, "invalid connection string") {
			t.Errorf("%q: stderr = %q", dsn, r.stderr)
		}
	}
}

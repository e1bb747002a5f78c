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

// TestConnectionErrorsHideEscapedPasswords: a malformed key/value
// connection string whose password (or sslpassword) holds a backslash
// escape, read by libpq as part of the value, is reported without any part
// of it, and without the connection string: the error says what is wrong.
// pgx's masking stopped at the backslash, and "password=s3cr\ et9pw" was
// printed as "password=xxxxx et9pw".
func TestConnectionErrorsHideEscapedPasswords(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		`host=localhost password=s3cr\ et9pw port=abc`,
		`host=localhost password='s3cr\' et9pw' port=abc`,
		`host=localhost password = 's3cr\\ et9pw' port=abc`,
		`host=localhost sslpassword=s3cr\ et9pw port=abc`,
		`host=localhost password=s3cr\'\ et9pw port=abc`,
	} {
		r := run(t, dsn, "locks")
		all := r.stdout + r.stderr
		if r.code != ExitUsage || !strings.Contains(r.stderr, "invalid connection string: invalid port") {
			t.Errorf("%q: exit %d, stderr %q; want %d saying invalid port", dsn, r.code, r.stderr, ExitUsage)
		}
		for _, part := range []string{"s3cr", "et9pw", "host=localhost"} {
			if strings.Contains(all, part) {
				t.Errorf("%q: %q is printed: %s", dsn, part, all)
			}
		}
	}
}

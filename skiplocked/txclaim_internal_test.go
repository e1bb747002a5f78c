package skiplocked

import (
	"errors"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/pgident"
)

// FuzzBuildTxClaimer: whatever names and trusted fragment a spec carries,
// either it is refused with a typed error or the statement it builds quotes
// every name, contains no statement separator or comment, and ends with the
// claim clause.
func FuzzBuildTxClaimer(f *testing.F) {
	for _, seed := range [][3]string{
		{"import_rows", "id", ""},
		{"import_rows; DROP TABLE x", "id", ""},
		{"t", `id"--`, ""},
		{"t", "id", "times < 3"},
		{"t", "id", "true) OR (true"},
		{"t", "id", "a = 'x;y'"},
		{"Ünïcode_t", "col$1", "x IS NOT NULL"},
		{"t", "id", "$1 = 1"},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, table, column, trusted string) {
		c, err := buildTxClaimer(Spec{
			Table: table, Key: []string{column},
			Where:            []Cond{{Column: column, Op: OpEq, Value: 1}},
			TrustedFilterSQL: trusted, OrderBy: []Order{{Column: column}}, Limit: 10,
		}, map[string]bool{column: true})
		if err != nil {
			if !errors.Is(err, ErrInvalidIdentifier) && !errors.Is(err, ErrInvalidSpec) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		if pgident.Check("table", table) != nil || pgident.Check("column", column) != nil {
			t.Fatalf("accepted names %q %q", table, column)
		}
		for _, bad := range []string{";", "--", "/*"} {
			if strings.Contains(c.SQL(), bad) {
				t.Fatalf("statement contains %q: %s", bad, c.SQL())
			}
		}
		if !strings.Contains(c.SQL(), `FROM "`+table+`"`) || !strings.HasSuffix(c.SQL(), " LIMIT $2 FOR UPDATE SKIP LOCKED") {
			t.Fatalf("statement %s", c.SQL())
		}
	})
}

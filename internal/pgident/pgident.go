// Package pgident is pgfence's one rule for the table and column names it
// puts into SQL, and its one catalog lookup for application tables. The
// public packages (fencedwrite, skiplocked) and the CLI's generator map its
// errors to their own sentinels.
package pgident

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// MaxBytes is PostgreSQL's identifier limit (NAMEDATALEN - 1). The server
// truncates longer names silently, so they are refused.
const MaxBytes = 63

// ErrInvalid is matched by every *[Error].
var ErrInvalid = errors.New("invalid identifier")

// Error reports a name that [Check] refused.
type Error struct {
	What   string // what the name is for: "table", "schema", "key column", ...
	Value  string // the refused input, cut to 80 bytes
	Reason string // why, e.g. "empty", "starts with a digit"
}

// Error names the input and the reason.
func (e *Error) Error() string {
	return fmt.Sprintf("invalid %s name %q: %s", e.What, e.Value, e.Reason)
}

// Is reports whether target is [ErrInvalid].
func (e *Error) Is(target error) bool { return target == ErrInvalid }

// Check validates one name: 1..[MaxBytes] bytes of ASCII letters, digits and
// underscores, not starting with a digit. Case is kept (names are used
// exactly as stored in the catalog). Anything else, including quotes,
// spaces, dots, semicolons, $, NUL and non-ASCII letters, is refused with an
// *[Error]; what names the input in it.
func Check(what, name string) error {
	bad := func(reason string) error {
		v := name
		if len(v) > 80 {
			v = v[:80] + "..."
		}
		return &Error{What: what, Value: v, Reason: reason}
	}
	switch {
	case name == "":
		return bad("empty")
	case len(name) > MaxBytes:
		return bad(fmt.Sprintf("%d bytes, the limit is %d", len(name), MaxBytes))
	case name[0] >= '0' && name[0] <= '9':
		return bad("starts with a digit")
	}
	for _, r := range name { // by rune, so the error names the letter, not one of its bytes
		if !(r == '_' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9') {
			return bad(fmt.Sprintf("character %q is not allowed (ASCII letters, digits and _ only)", r))
		}
	}
	return nil
}

// TableName is a checked, optionally schema-qualified table name.
type TableName struct {
	Schema string // empty: resolved through search_path
	Name   string
}

// ParseTableName parses "table" or "schema.table" and checks each part with
// [Check] (as "schema" and "table").
func ParseTableName(s string) (TableName, error) {
	parts := strings.Split(s, ".")
	switch len(parts) {
	case 1:
		if err := Check("table", parts[0]); err != nil {
			return TableName{}, err
		}
		return TableName{Name: parts[0]}, nil
	case 2:
		if err := Check("schema", parts[0]); err != nil {
			return TableName{}, err
		}
		if err := Check("table", parts[1]); err != nil {
			return TableName{}, err
		}
		return TableName{Schema: parts[0], Name: parts[1]}, nil
	}
	return TableName{}, Check("table", s) // reports the offending character
}

// Identifier returns the name as a pgx.Identifier.
func (t TableName) Identifier() pgx.Identifier {
	if t.Schema == "" {
		return pgx.Identifier{t.Name}
	}
	return pgx.Identifier{t.Schema, t.Name}
}

// String returns the quoted name, ready for SQL.
func (t TableName) String() string { return t.Identifier().Sanitize() }

// Quote returns the parts quoted with pgx.Identifier and joined with dots.
func Quote(parts ...string) string { return pgx.Identifier(parts).Sanitize() }

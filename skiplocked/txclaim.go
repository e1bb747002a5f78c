package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgident"
)

// MaxIdentifierBytes is the longest table or column name a [Spec] accepts, in
// bytes (PostgreSQL's NAMEDATALEN - 1).
const MaxIdentifierBytes = pgident.MaxBytes

// Op is a comparison operator of a [Cond].
type Op string

// The operators a [Cond] may use. The value is always a bind parameter.
const (
	OpEq        Op = "="           // column = value
	OpNe        Op = "<>"          // column <> value
	OpLt        Op = "<"           // column < value
	OpLe        Op = "<="          // column <= value
	OpGt        Op = ">"           // column > value
	OpGe        Op = ">="          // column >= value
	OpIn        Op = "IN"          // column = ANY(value); value is a slice
	OpIsNull    Op = "IS NULL"     // column IS NULL; no value
	OpIsNotNull Op = "IS NOT NULL" // column IS NOT NULL; no value
)

// Cond is one filter condition of a [Spec]: Column Op Value, with Value sent
// as a bind parameter (never pasted into the SQL). Conditions are ANDed.
type Cond struct {
	// Column is the column compared; a plain identifier.
	Column string
	// Op is the comparison.
	Op Op
	// Value is bound as a parameter; nil for OpIsNull and OpIsNotNull, a
	// slice for OpIn.
	Value any
}

// Order is one ORDER BY term of a [Spec].
type Order struct {
	// Column to sort by; a plain identifier.
	Column string
	// Desc sorts descending. Defaults to ascending.
	Desc bool
}

// Spec describes an in-transaction claim on an application's own table:
//
//	SELECT <Key> FROM <Schema>.<Table>
//	WHERE <Where...> AND (<TrustedFilterSQL>)
//	ORDER BY <OrderBy...> LIMIT <Limit>
//	FOR UPDATE SKIP LOCKED
//
// Names must be plain identifiers (1..63 bytes of ASCII letters, digits and
// _, not starting with a digit; case is kept) and are quoted with
// pgx.Identifier; values are bind parameters.
type Spec struct {
	// Schema of the table. Defaults to the search_path when empty.
	Schema string
	// Table to claim rows from (an ordinary or partitioned table).
	Table string
	// Key lists the columns returned for each claimed row, at least one;
	// usually the primary key, but any columns may be listed.
	Key []string
	// Where holds conditions ANDed together, values bound as parameters.
	// Defaults to no condition (every row is claimable).
	Where []Cond
	// TrustedFilterSQL is an extra condition written by the programmer, for
	// what [Cond] cannot say. It is pasted into the statement, in
	// parentheses: it must NEVER contain input from users. It is refused with
	// [ErrInvalidSpec] when it contains ";", "--", "/*", "*/", "$", a
	// backslash or NUL anywhere (even inside a string), invalid UTF-8, an
	// unterminated string or quoted identifier, or unbalanced parentheses.
	// Write a quote in a string by doubling it ('it''s'). Defaults to none.
	TrustedFilterSQL string
	// OrderBy gives the claim order. Defaults to none (whatever order the
	// plan yields).
	OrderBy []Order
	// Limit is the most rows one claim takes, 1..[MaxBatch].
	Limit int
}

// TxClaimer claims rows of an application table with FOR UPDATE SKIP LOCKED
// inside the caller's transaction. Build one with [NewTxClaimer] and use it
// from many goroutines with [ClaimTx].
type TxClaimer struct {
	spec    Spec
	sql     string
	args    []any // one per Cond that takes a value, then the limit
	columns []string
}

// NewTxClaimer checks spec and builds the claim statement. It looks the
// table and columns up in the catalog through db, so a misspelt name fails
// here with [ErrUnknownTable] or [ErrUnknownColumn] instead of aborting a
// transaction later. Malformed names get [ErrInvalidIdentifier]; other
// mistakes [ErrInvalidSpec] or [ErrInvalidLimit].
func NewTxClaimer(ctx context.Context, db DBTX, spec Spec) (*TxClaimer, error) {
	if nilcheck.IsNil(db) {
		return nil, ErrNilDB
	}
	c, err := buildTxClaimer(spec, nil)
	if err != nil {
		return nil, err
	}
	builtin, err := c.checkCatalog(ctx, db)
	if err != nil {
		return nil, err
	}
	return buildTxClaimer(spec, builtin)
}

// buildTxClaimer checks spec and writes the statement. A condition on a
// column whose type is one of PostgreSQL's own (builtin) names its operator
// OPERATOR(pg_catalog.op), so no operator another role creates on the
// caller's search_path runs; a column of another schema's type (citext, a
// domain) keeps the bare operator of its own type.
func buildTxClaimer(spec Spec, builtin map[string]bool) (*TxClaimer, error) {
	if err := checkLimit(spec.Limit); err != nil {
		return nil, err
	}
	if spec.Schema != "" {
		if err := checkIdent("schema", spec.Schema); err != nil {
			return nil, err
		}
	}
	if err := checkIdent("table", spec.Table); err != nil {
		return nil, err
	}
	if len(spec.Key) == 0 {
		return nil, fmt.Errorf("%w: no key columns", ErrInvalidSpec)
	}
	c := &TxClaimer{spec: spec}
	var b strings.Builder
	b.WriteString("SELECT ")
	for i, k := range spec.Key {
		if err := checkIdent("key column", k); err != nil {
			return nil, err
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(pgx.Identifier{k}.Sanitize())
		c.columns = append(c.columns, k)
	}
	b.WriteString(" FROM ")
	b.WriteString(pgident.TableName{Schema: spec.Schema, Name: spec.Table}.String())
	var where []string
	for _, cond := range spec.Where {
		if err := checkIdent("filter column", cond.Column); err != nil {
			return nil, err
		}
		col := pgx.Identifier{cond.Column}.Sanitize()
		c.columns = append(c.columns, cond.Column)
		op := func(o string) string {
			if builtin[cond.Column] {
				return "OPERATOR(pg_catalog." + o + ")"
			}
			return o
		}
		switch cond.Op {
		case OpEq, OpNe, OpLt, OpLe, OpGt, OpGe:
			if cond.Value == nil {
				return nil, fmt.Errorf("%w: %s %s with a nil value (use OpIsNull)", ErrInvalidSpec, cond.Column, cond.Op)
			}
			c.args = append(c.args, cond.Value)
			where = append(where, col+" "+op(string(cond.Op))+" $"+strconv.Itoa(len(c.args)))
		case OpIn:
			if cond.Value == nil {
				return nil, fmt.Errorf("%w: %s IN needs a slice value", ErrInvalidSpec, cond.Column)
			}
			c.args = append(c.args, cond.Value)
			where = append(where, col+" "+op("=")+" ANY($"+strconv.Itoa(len(c.args))+")")
		case OpIsNull, OpIsNotNull:
			if cond.Value != nil {
				return nil, fmt.Errorf("%w: %s %s takes no value", ErrInvalidSpec, cond.Column, cond.Op)
			}
			where = append(where, col+" "+string(cond.Op))
		default:
			return nil, fmt.Errorf("%w: unknown operator %q", ErrInvalidSpec, cond.Op)
		}
	}
	if spec.TrustedFilterSQL != "" {
		if err := checkTrustedSQL(spec.TrustedFilterSQL); err != nil {
			return nil, err
		}
		where = append(where, "("+spec.TrustedFilterSQL+")")
	}
	if len(where) > 0 {
		b.WriteString(" WHERE ")
		b.WriteString(strings.Join(where, " AND "))
	}
	for i, o := range spec.OrderBy {
		if err := checkIdent("order column", o.Column); err != nil {
			return nil, err
		}
		c.columns = append(c.columns, o.Column)
		if i == 0 {
			b.WriteString(" ORDER BY ")
		} else {
			b.WriteString(", ")
		}
		b.WriteString(pgx.Identifier{o.Column}.Sanitize())
		if o.Desc {
			b.WriteString(" DESC")
		}
	}
	c.args = append(c.args, spec.Limit)
	b.WriteString(" LIMIT $" + strconv.Itoa(len(c.args)) + " FOR UPDATE SKIP LOCKED")
	c.sql = b.String()
	return c, nil
}

// checkCatalog checks the table and columns exist and returns which
// columns are of a built-in type.
func (c *TxClaimer) checkCatalog(ctx context.Context, db DBTX) (map[string]bool, error) {
	tn := pgident.TableName{Schema: c.spec.Schema, Name: c.spec.Table}
	t, err := pgident.Lookup(ctx, db, tn)
	if errors.Is(err, pgident.ErrUnknownTable) {
		return nil, fmt.Errorf("%w: %v", ErrUnknownTable, err)
	}
	if err != nil {
		return nil, translate("look up table", err)
	}
	builtin := make(map[string]bool, len(c.columns))
	for _, col := range c.columns {
		tc, ok := t.Column(col)
		if !ok {
			return nil, fmt.Errorf("%w: %s.%s", ErrUnknownColumn, tn, pgident.Quote(col))
		}
		builtin[col] = tc.Builtin
	}
	return builtin, nil
}

// SQL returns the claim statement, for logging or EXPLAIN. Its parameters
// are the values of the conditions in order, then the limit.
func (c *TxClaimer) SQL() string { return c.sql }

// WithValues returns a copy of c whose condition values are replaced, in the
// order of Spec.Where, skipping IS NULL / IS NOT NULL conditions. It does no
// I/O: the table and columns were checked by [NewTxClaimer].
func (c *TxClaimer) WithValues(values ...any) (*TxClaimer, error) {
	if len(values) != len(c.args)-1 {
		return nil, fmt.Errorf("%w: %d values given, the spec has %d", ErrInvalidSpec, len(values), len(c.args)-1)
	}
	for i, v := range values {
		if v == nil {
			return nil, fmt.Errorf("%w: value %d is nil", ErrInvalidSpec, i)
		}
	}
	cp := *c
	cp.args = append(append([]any(nil), values...), c.args[len(c.args)-1])
	return &cp, nil
}

// WithLimit returns a copy of c that claims at most n rows (1..[MaxBatch]).
func (c *TxClaimer) WithLimit(n int) (*TxClaimer, error) {
	if err := checkLimit(n); err != nil {
		return nil, err
	}
	cp := *c
	cp.spec.Limit = n
	cp.args = append(append([]any(nil), c.args[:len(c.args)-1]...), n)
	return &cp, nil
}

// ClaimTx runs c's claim inside tx and scans each claimed row with scan (for
// example pgx.RowTo[int64] for a one-column key). The rows stay locked by tx
// until it ends; other claimers skip them without waiting. Do the work, and
// the writes that record it, in tx.
//
// tx must be a real transaction: in autocommit mode the locks would end with
// the statement. A database error aborts tx (the caller must roll back);
// errors are translated ([ErrUnknownTable], [ErrUnknownColumn],
// [ErrConnection]). If ctx is cancelled the statement is cancelled and pgx
// closes the connection, which releases every lock of tx.
func ClaimTx[T any](ctx context.Context, tx pgx.Tx, c *TxClaimer, scan pgx.RowToFunc[T]) ([]T, error) {
	if nilcheck.IsNil(tx) {
		return nil, ErrNilDB
	}
	if c == nil || scan == nil {
		return nil, fmt.Errorf("%w: nil claimer or scan function", ErrInvalidSpec)
	}
	rows, err := tx.Query(ctx, c.sql, c.args...)
	if err != nil {
		return nil, translate("claim rows", err)
	}
	out, err := pgx.CollectRows(rows, scan)
	if err != nil {
		return nil, translate("claim rows", err)
	}
	return out, nil
}

// checkIdent applies pgfence's identifier rule ([pgident.Check]).
func checkIdent(what, name string) error {
	var ie *pgident.Error
	if err := pgident.Check(what, name); errors.As(err, &ie) {
		return fmt.Errorf("%w: %s name %q: %s", ErrInvalidIdentifier, ie.What, ie.Value, ie.Reason)
	}
	return nil
}

// trustedFilterBanned are refused anywhere in a trusted filter, inside
// string literals too: checking them everywhere keeps the check independent
// of how PostgreSQL would lex the fragment.
var trustedFilterBanned = []struct{ text, what string }{
	{";", "a statement separator"},
	{"--", "a comment"},
	{"/*", "a comment"},
	{"*/", "a comment end"},
	{"$", "a dollar quote or placeholder"},
	{`\`, "a backslash (an escape in E'...' strings, and in every string when standard_conforming_strings is off)"},
	{"\x00", "a NUL byte"},
}

// checkTrustedSQL refuses fragments that could end the statement, hide text
// in a comment, open a dollar-quoted string or placeholder, or escape the
// parentheses the fragment is wrapped in. With backslashes refused, every
// string literal form ends at the first undoubled ' and every quoted
// identifier at the first undoubled " (each quote is ordinary inside the
// other), so parentheses are counted outside those only.
func checkTrustedSQL(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("%w: trusted filter is not valid UTF-8", ErrInvalidSpec)
	}
	for _, bad := range trustedFilterBanned {
		if i := strings.Index(s, bad.text); i >= 0 {
			return fmt.Errorf("%w: trusted filter contains %s (%q at byte %d)", ErrInvalidSpec, bad.what, bad.text, i)
		}
	}
	depth := 0
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '\'', '"':
			end := closingQuote(s, i)
			if end < 0 {
				what := "string literal"
				if c == '"' {
					what = "quoted identifier"
				}
				return fmt.Errorf("%w: trusted filter has an unterminated %s (from byte %d)", ErrInvalidSpec, what, i)
			}
			i = end
		case '(':
			depth++
		case ')':
			depth--
			if depth < 0 {
				return fmt.Errorf("%w: trusted filter closes a parenthesis it did not open (byte %d)", ErrInvalidSpec, i)
			}
		}
	}
	if depth != 0 {
		return fmt.Errorf("%w: trusted filter leaves %d parentheses open", ErrInvalidSpec, depth)
	}
	return nil
}

// closingQuote returns the index of the quote that ends the literal or
// identifier opened by the quote at s[open], skipping doubled quotes, or -1.
func closingQuote(s string, open int) int {
	q := s[open]
	for i := open + 1; i < len(s); i++ {
		if s[i] != q {
			continue
		}
		if i+1 < len(s) && s[i+1] == q {
			i++ // a doubled quote stands for one
			continue
		}
		return i
	}
	return -1
}

package fencegen

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/pgident"
)

// ErrInvalidOptions reports options that are incomplete or contradictory
// (no key, a column listed twice, a bad version or Go name, a lock name with
// quotes or backslashes). Invalid table and column names are reported as
// [pgfence.ErrInvalid] naming the input instead.
var ErrInvalidOptions = errors.New("fencegen: invalid options")

// ErrFileExists is returned by [Files.Plan] and [WritePlan.Apply] when a
// file that fencegen did not generate is where it would write (a query file
// without the generated header, a migration of the same name), or when such
// a file appears between Plan and Apply. Nothing is overwritten.
var ErrFileExists = errors.New("fencegen: file exists")

// ErrConflict is returned by [Files.Plan] and [WritePlan.Apply] when files
// generated earlier disagree with the options in a way a new file cannot
// settle: a fence-column migration for the same table adding another column,
// a query file of the same name generated for another table, a migration
// version not newer than the newest migration in the directory, a migration
// that looks generated but lacks the generated header, or a file that
// changed between Plan and Apply.
var ErrConflict = errors.New("fencegen: conflicts with existing files")

// Options describe the table to fence.
type Options struct {
	// Table is "name" or "schema.name", spelled as in the catalog.
	Table string
	// Key lists the columns identifying one row (the primary key or a unique index).
	Key []string
	// Set lists the columns the fenced updates change.
	Set []string
	// FenceColumn defaults to "fence".
	FenceColumn string
	// HasFenceColumn says the table already has the fence column: no
	// fence-column migration is generated. It is not needed on a re-run: a
	// fence-column migration generated earlier is recognised by [Files.Plan].
	HasFenceColumn bool
	// Guard, when not nil, adds a migration that attaches the pgfence guard
	// (pgfence's own migrations must be applied first). Its FenceColumn is
	// ignored: Options.FenceColumn is used.
	Guard *fencedwrite.GuardOptions
	// Name is the Go name used in the query names (FencedUpdate<Name>, ...).
	// Defaults to the table name in CamelCase ("store_items" -> "StoreItems").
	// A Name other than the default also names the query file, so several
	// query sets for one table do not collide (see [Generate]).
	Name string
	// Version is the goose version prefix of the migration file names,
	// digits only (a positive int64, as goose requires). Defaults to the
	// current UTC time as YYYYMMDDhhmmss, like goose create. It is the
	// version of the first migration written; the guard migration gets the
	// next one when the fence-column migration is written in the same run.
	Version string
	// OwnEqualKeys lists the key columns compared with their type's own
	// "=", resolved with the application's search_path. Every other key
	// column is compared with OPERATOR(pg_catalog.=), which an operator
	// planted in a schema on the path cannot replace (a domain over a
	// built-in type is compared as its base type). List a key whose type is
	// not built in and brings its own "=" (citext, an extension's type, an
	// enum): pg_catalog's would compare it through a cast, or not at all.
	// [OwnEqualKeys] reads the list from the catalog (pgfence gen fenced
	// --check does).
	OwnEqualKeys []string
	// Partitioned says the table is partitioned: the statements then name
	// it without ONLY, so that they reach the rows in its partitions. An
	// ordinary table is named ONLY, so that they never reach the rows of
	// its inheritance children (tables of their own, whose rows its key
	// does not cover). [Validate] refuses a Partitioned that does not match
	// the table; [Partitioned] reads it from the catalog.
	Partitioned bool
}

// FileKind tells the generated files apart.
type FileKind int

const (
	// ColumnMigration is the goose migration adding the fence column:
	// "<version>_pgfence_fence_<table>.sql".
	ColumnMigration FileKind = iota + 1
	// GuardMigration is the goose migration attaching the guard:
	// "<version>_pgfence_guard_<table>.sql".
	GuardMigration
	// QueryFile is the sqlc query file: "fenced_<table>.sql", or
	// "fenced_<table>.<name>.sql" for a non-default Options.Name.
	QueryFile
)

// String names the kind of file, as the CLI prints it.
func (k FileKind) String() string {
	switch k {
	case ColumnMigration:
		return "fence-column migration"
	case GuardMigration:
		return "guard migration"
	case QueryFile:
		return "query file"
	}
	return fmt.Sprintf("FileKind(%d)", int(k))
}

// File is one generated file.
type File struct {
	Kind FileKind
	// Name is the file's base name; the directory comes from [Dirs].
	Name string
	Data []byte
}

// Files is the generator's output, from [Generate]. Write it with
// [Files.Write], or look first with [Files.Plan].
type Files struct {
	// Migrations holds the goose migrations, in the order goose applies
	// them: the fence-column migration (unless Options.HasFenceColumn), then
	// the guard migration (with Options.Guard). It is empty when there is
	// nothing to migrate. Each is a separate file so that a guard added later
	// is a migration of its own and the guard can be rolled out after the
	// writers that send tokens.
	Migrations []File
	// Queries is the sqlc query file of fenced statements for the table. It
	// is wholly generated: a re-run with other options rewrites it.
	Queries File

	p *plan
}

type plan struct {
	opts    Options
	table   pgident.TableName
	fence   string
	name    string
	params  map[string]string // column -> sqlc parameter name
	ownEq   map[string]bool   // key column -> compared with its type's own "="
	version string
}

func check(opts Options) (*plan, error) {
	p := &plan{opts: opts, fence: opts.FenceColumn, version: opts.Version}
	var err error
	if p.table, err = parseTable(opts.Table); err != nil {
		return nil, err
	}
	if p.fence == "" {
		p.fence = defaultFenceColumn
	}
	if err := checkIdent("fence column", p.fence); err != nil {
		return nil, err
	}
	if len(opts.Key) == 0 {
		return nil, fmt.Errorf("%w: no key columns", ErrInvalidOptions)
	}
	if len(opts.Set) == 0 {
		return nil, fmt.Errorf("%w: no set columns", ErrInvalidOptions)
	}
	seen := map[string]bool{p.fence: true}
	p.params = map[string]string{}
	usedParams := map[string]bool{"token": true}
	for _, group := range []struct {
		what string
		cols []string
	}{{"key column", opts.Key}, {"set column", opts.Set}} {
		for _, c := range group.cols {
			if err := checkIdent(group.what, c); err != nil {
				return nil, err
			}
			if seen[c] {
				return nil, fmt.Errorf("%w: column %q listed twice (or is the fence column)", ErrInvalidOptions, c)
			}
			seen[c] = true
			pn := strings.ToLower(c)
			if usedParams[pn] {
				pn += "_value"
			}
			if usedParams[pn] {
				return nil, fmt.Errorf("%w: columns %q clash as sqlc parameter names", ErrInvalidOptions, c)
			}
			usedParams[pn] = true
			p.params[c] = pn
		}
	}
	p.ownEq = map[string]bool{}
	for _, c := range opts.OwnEqualKeys {
		if !slices.Contains(opts.Key, c) {
			return nil, fmt.Errorf("%w: own-equality column %q is not a key column", ErrInvalidOptions, c)
		}
		p.ownEq[c] = true
	}
	p.name = opts.Name
	if p.name == "" {
		p.name = camel(p.table.Name)
	}
	if !goName(p.name) {
		return nil, fmt.Errorf("%w: Go name %q must start with an upper-case letter and hold only letters and digits", ErrInvalidOptions, p.name)
	}
	if p.version == "" {
		p.version = time.Now().UTC().Format("20060102150405")
	}
	if v, err := strconv.ParseInt(p.version, 10, 64); err != nil || v <= 0 || v == math.MaxInt64 ||
		strings.Trim(p.version, "0123456789") != "" {
		return nil, fmt.Errorf("%w: version %q must be digits only, a positive number below 2^63-1 (goose versions are int64)",
			ErrInvalidOptions, p.version)
	}
	if g := opts.Guard; g != nil {
		if (g.LockName == "") == (g.LockNameColumn == "") {
			return nil, fmt.Errorf("%w: guard: set exactly one of LockName and LockNameColumn", ErrInvalidOptions)
		}
		if g.LockName != "" {
			if err := checkLockName(g.LockName); err != nil {
				return nil, err
			}
		} else if err := checkIdent("lock name column", g.LockNameColumn); err != nil {
			return nil, err
		}
		if g.Mode != fencedwrite.Strict && g.Mode != fencedwrite.Reentrant {
			return nil, fmt.Errorf("%w: guard: unknown mode %v", ErrInvalidOptions, g.Mode)
		}
	}
	return p, nil
}

// checkLockName admits lock names that are safe inside a standard SQL string
// literal under any setting (no quotes or backslashes) and in a terminal
// (gen fenced --dry-run prints the files raw): no control characters, C0
// or C1 (U+009B is a CSI), no DEL, no format characters such as the
// bidirectional controls (U+202E reorders what is shown), no line or
// paragraph separators.
func checkLockName(s string) error {
	if s == "" || len(s) > 512 || !utf8.ValidString(s) {
		return fmt.Errorf("%w: guard lock name must be 1..512 bytes of UTF-8", ErrInvalidOptions)
	}
	for _, r := range s {
		switch {
		case r == '\'' || r == '\\':
			return fmt.Errorf("%w: guard lock name %q holds %q", ErrInvalidOptions, s, r)
		case unicode.IsControl(r) || unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp):
			return fmt.Errorf("%w: guard lock name %q holds %q, a control or format character (such as a terminal escape or a bidirectional control)",
				ErrInvalidOptions, s, r)
		}
	}
	return nil
}

func camel(s string) string {
	var b strings.Builder
	up := true
	for _, r := range s {
		if r == '_' {
			up = true
			continue
		}
		if up && r >= 'a' && r <= 'z' {
			r -= 'a' - 'A'
		}
		up = false
		b.WriteRune(r)
	}
	out := b.String()
	if out != "" && out[0] >= '0' && out[0] <= '9' {
		out = "T" + out
	}
	return out
}

func goName(s string) bool {
	if s == "" || s[0] < 'A' || s[0] > 'Z' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// Validate checks opts against a live database schema: the table exists (and
// is partitioned exactly when Options.Partitioned says so), the
// key and set columns exist, the key is a primary key or unique index that
// identifies one row (as [fencedwrite.Prepare] requires), and
// the fence column is absent (or, with HasFenceColumn, present as bigint);
// with a guard, that the lock name column exists. It only reads the catalog.
// Errors are *pgfence.Errors: [pgfence.ErrNotFound] for a table or column
// the database does not have (or a fence column that is not bigint),
// [pgfence.ErrInvalid] for key columns that are not a unique key or a
// Partitioned that does not match the table (the Reason names the
// argument), or [ErrInvalidOptions].
func Validate(ctx context.Context, db pgfence.DBTX, opts Options) error {
	p, err := check(opts)
	if err != nil {
		return err
	}
	return p.validate(ctx, db, false)
}

// validate checks the plan against the catalog. migrated says a
// fence-column migration generated earlier exists: the column may then be
// absent (not applied yet) or present (applied) whatever HasFenceColumn says.
func (p *plan) validate(ctx context.Context, db pgfence.DBTX, migrated bool) error {
	opts := p.opts
	ti, err := lookup(ctx, db, opts.Table)
	if err != nil {
		return err
	}
	cols := append(append([]string{}, opts.Key...), opts.Set...)
	if g := opts.Guard; g != nil && g.LockNameColumn != "" {
		cols = append(cols, g.LockNameColumn)
	}
	for _, c := range cols {
		if _, ok := ti.Column(c); !ok {
			return &pgfence.Error{Op: op, Kind: pgfence.ErrNotFound, Name: ti.Schema + "." + ti.Name,
				Reason: fmt.Sprintf("column: no column %q in %s", c, ti.Qualified())}
		}
	}
	if !pgident.IsUniqueKey(ti.UniqueKeys, opts.Key) {
		reason := fmt.Sprintf("key: (%s) is not a primary key or unique index of %s", strings.Join(opts.Key, ", "), ti.Qualified())
		if p := ti.UnusableKeyProblem(opts.Key); p != "" {
			reason = fmt.Sprintf("key: (%s) is a unique index of %s that cannot identify one row: %s", strings.Join(opts.Key, ", "), ti.Qualified(), p)
		}
		return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: ti.Schema + "." + ti.Name, Reason: reason}
	}
	if ti.Partitioned != opts.Partitioned {
		reason := "table: " + ti.Qualified() + " is partitioned, and the statements generated without Options.Partitioned name it ONLY: they would reach no row"
		if !ti.Partitioned {
			reason = "table: " + ti.Qualified() + " is not partitioned, and the statements generated with Options.Partitioned do not name it ONLY: they would also reach its inheritance children's rows"
		}
		return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: ti.Schema + "." + ti.Name, Reason: reason}
	}
	_, has := ti.Column(p.fence)
	switch {
	case opts.HasFenceColumn, migrated && has:
		return checkFenceColumn(ti, p.fence)
	case migrated:
		return nil
	case has:
		return fmt.Errorf("%w: %s already has column %q; set Options.HasFenceColumn (pgfence gen fenced --has-fence-column) to generate without adding it",
			ErrInvalidOptions, ti.Qualified(), p.fence)
	}
	return nil
}

// Generate returns the migrations and the sqlc query file for opts. It does
// no I/O; call [Validate] first to check the names against a live schema,
// then [Files.Write] (or [Files.Plan] and [WritePlan.Apply]).
//
// File names: the migrations are "<version>_pgfence_fence_<table>.sql" (adds
// the fence column) and "<version>_pgfence_guard_<table>.sql" (attaches the
// guard; its version is the next one when both are generated, and
// [Files.Plan] gives it the version itself when the fence-column migration
// exists already). The query file is "fenced_<table>.sql" for the default Go
// name and "fenced_<table>.<name>.sql" for another Options.Name, with <name>
// the Go name in snake_case (Name "InvoicePdf":
// "fenced_invoices.invoice_pdf.sql"). <table> is the table name in lower
// case, prefixed with "<schema>_" when the table is schema-qualified.
func Generate(opts Options) (*Files, error) {
	p, err := check(opts)
	if err != nil {
		return nil, err
	}
	base := p.fileBase()
	qname := "fenced_" + base + ".sql"
	if p.name != camel(p.table.Name) {
		qname = "fenced_" + base + "." + snake(p.name) + ".sql"
	}
	queries := p.queries()
	if !isGenerated([]byte(queries)) {
		// The header is what Plan recognises a generated query file by; the
		// blank line keeps sqlc from taking it as a method's doc comment.
		queries = generatedPrefix + ": fenced writes to " + p.table.String() + ".\n\n" + queries
	}
	f := &Files{Queries: File{Kind: QueryFile, Name: qname, Data: []byte(queries)}, p: p}
	version := p.version
	if !opts.HasFenceColumn {
		f.Migrations = append(f.Migrations, File{Kind: ColumnMigration,
			Name: version + columnSuffix + base + ".sql", Data: []byte(p.columnMigration())})
		version = nextVersion(version)
	}
	if opts.Guard != nil {
		f.Migrations = append(f.Migrations, File{Kind: GuardMigration,
			Name: version + guardSuffix + base + ".sql", Data: []byte(p.guardMigration(""))})
	}
	return f, nil
}

// generatedPrefix starts the first line of the migrations fencegen writes;
// the query file starts with it or with "-- Code generated by pgfence
// (fencegen)". A file starting with neither is the user's own and is never
// overwritten.
const generatedPrefix = "-- Generated by pgfence (fencegen)"

var generatedPrefixes = [][]byte{[]byte(generatedPrefix), []byte("-- Code generated by pgfence (fencegen)")}

const (
	columnSuffix = "_pgfence_fence_"
	guardSuffix  = "_pgfence_guard_"
)

func isGenerated(data []byte) bool {
	for _, p := range generatedPrefixes {
		if bytes.HasPrefix(data, p) {
			return true
		}
	}
	return false
}

// fileBase is the table part of the file names.
func (p *plan) fileBase() string {
	base := strings.ToLower(p.table.Name)
	if p.table.Schema != "" {
		base = strings.ToLower(p.table.Schema) + "_" + base
	}
	return base
}

// nextVersion adds one to a decimal version, keeping its width.
func nextVersion(v string) string {
	b := []byte(v)
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] < '9' {
			b[i]++
			return string(b)
		}
		b[i] = '0'
	}
	return "1" + string(b)
}

// snake turns a Go name into snake_case: "InvoicePdf" -> "invoice_pdf",
// "HTTPServer" -> "http_server", "V2Items" -> "v2_items".
func snake(s string) string {
	var b strings.Builder
	isUpper := func(c byte) bool { return c >= 'A' && c <= 'Z' }
	isLower := func(c byte) bool { return c >= 'a' && c <= 'z' }
	isDigit := func(c byte) bool { return c >= '0' && c <= '9' }
	for i := 0; i < len(s); i++ {
		c := s[i]
		if i > 0 && isUpper(c) && (isLower(s[i-1]) || isDigit(s[i-1]) ||
			isUpper(s[i-1]) && i+1 < len(s) && isLower(s[i+1])) {
			b.WriteByte('_')
		}
		if isUpper(c) {
			c += 'a' - 'A'
		}
		b.WriteByte(c)
	}
	return b.String()
}

func q(s string) string { return pgx.Identifier{s}.Sanitize() }

// addColumnSQL is the statement of the fence-column migration that Plan
// recognises an earlier one by (without the ";").
func (p *plan) addColumnSQL() string {
	return "ALTER TABLE " + p.table.String() + " ADD COLUMN " + q(p.fence) + " bigint NOT NULL DEFAULT 0"
}

func (p *plan) columnMigration() string {
	tbl := p.table.String()
	var b strings.Builder
	fmt.Fprintf(&b, "%s: fence column for %s.\n", generatedPrefix, tbl)
	b.WriteString("-- The fence column holds the highest fencing token each row accepted; rows start at 0.\n")
	b.WriteString("-- Rollout: apply this, ship writers that send tokens, then apply the guard migration (if any) last.\n\n")
	b.WriteString("-- +goose Up\n")
	b.WriteString(p.addColumnSQL() + ";\n")
	fmt.Fprintf(&b, "COMMENT ON COLUMN %s.%s IS 'Highest fencing token (pgfence.locks) this row accepted; writes with a lower token are refused.';\n",
		tbl, q(p.fence))
	b.WriteString("\n-- +goose Down\n")
	fmt.Fprintf(&b, "ALTER TABLE %s DROP COLUMN %s;\n", tbl, q(p.fence))
	return b.String()
}

// guardMigration attaches the guard. previous is the guard statement this
// migration replaces (from an earlier generated migration), restored by the
// Down section; "" means there was none, and Down removes the guard.
func (p *plan) guardMigration(previous string) string {
	tbl := p.table.String()
	var b strings.Builder
	fmt.Fprintf(&b, "%s: guard for %s.\n", generatedPrefix, tbl)
	fmt.Fprintf(&b, "-- From here on the database refuses changes to %s that do not carry a current fencing token.\n", tbl)
	b.WriteString("-- Apply it after every writer of the table sends tokens. Attaching again replaces an earlier guard.\n\n")
	b.WriteString("-- +goose Up\n")
	b.WriteString(guardSQL(p.table, p.fence, p.opts.Guard) + ";\n")
	b.WriteString("\n-- +goose Down\n")
	if previous != "" {
		b.WriteString("-- Restores the guard this migration replaced.\n")
		b.WriteString(previous + ";\n")
	} else {
		b.WriteString(unguardSQL(p.table) + ";\n")
	}
	return b.String()
}

// guardSQL is the statement attaching the guard (without the ";"). Plan
// compares it with the guard statement of the newest earlier migration to
// decide whether a new guard migration is needed, so any change here (a new
// lock source, a new argument) leads to a new guard migration on a re-run.
func guardSQL(table pgident.TableName, fence string, g *fencedwrite.GuardOptions) string {
	lock := "lock_name => '" + g.LockName + "'"
	if g.LockNameColumn != "" {
		lock = "lock_name_column => '" + g.LockNameColumn + "'"
	}
	return fmt.Sprintf("SELECT pgfence.guard('%s'::pg_catalog.regclass, %s, fence_column => '%s', mode => '%s')",
		table, lock, fence, g.Mode)
}

func unguardSQL(table pgident.TableName) string {
	return fmt.Sprintf("SELECT pgfence.unguard('%s'::pg_catalog.regclass)", table)
}

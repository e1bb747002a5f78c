package fencegen

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fencedwrite"
)

// ErrInvalidOptions reports options that are incomplete or contradictory
// (no key, a column listed twice, a bad version or Go name, a lock name with
// quotes or backslashes). Invalid table and column names are reported as
// *fencedwrite.IdentifierError ([fencedwrite.ErrInvalidIdentifier]) instead.
var ErrInvalidOptions = errors.New("fencegen: invalid options")

// ErrFileExists is returned by [Files.Write] rather than overwrite a file.
var ErrFileExists = errors.New("fencegen: file exists")

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
	// HasFenceColumn says the table already has the fence column: the
	// migration then only attaches the guard (if any).
	HasFenceColumn bool
	// Guard, when not nil, makes the migration attach the pgfence guard
	// (pgfence's own migrations must be applied first). Its FenceColumn is
	// ignored: Options.FenceColumn is used.
	Guard *fencedwrite.GuardOptions
	// Name is the Go name used in the query names (FencedUpdate<Name>, ...).
	// Defaults to the table name in CamelCase ("store_items" -> "StoreItems").
	Name string
	// Version is the goose version prefix of the migration file name, digits
	// only. Defaults to the current UTC time as YYYYMMDDhhmmss, like goose create.
	Version string
}

// Files is the generator's output.
type Files struct {
	// MigrationName is "<version>_pgfence_fence_<table>.sql", or empty when
	// there is nothing to migrate (HasFenceColumn without Guard).
	MigrationName string
	// Migration is a goose SQL migration: add the fence column (default 0, a
	// metadata-only change on PostgreSQL 11+) and optionally attach the guard.
	Migration []byte
	// QueriesName is "fenced_<table>.sql".
	QueriesName string
	// Queries is a sqlc query file with the strict and re-entrant fenced
	// updates and the fenced read, each answering why no row changed.
	Queries []byte
}

// Write writes the migration into migrationsDir and the queries into
// queriesDir (files with an empty name are skipped). It refuses to overwrite
// an existing file ([ErrFileExists]).
func (f *Files) Write(migrationsDir, queriesDir string) error {
	for _, w := range []struct {
		dir, name string
		data      []byte
	}{{migrationsDir, f.MigrationName, f.Migration}, {queriesDir, f.QueriesName, f.Queries}} {
		if w.name == "" {
			continue
		}
		path := filepath.Join(w.dir, w.name)
		fh, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if errors.Is(err, os.ErrExist) {
			return fmt.Errorf("%w: %s", ErrFileExists, path)
		}
		if err != nil {
			return fmt.Errorf("fencegen: %w", err)
		}
		_, err = fh.Write(w.data)
		if cerr := fh.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("fencegen: %w", err)
		}
	}
	return nil
}

type plan struct {
	opts    Options
	table   fencedwrite.TableName
	fence   string
	name    string
	params  map[string]string // column -> sqlc parameter name
	version string
}

func check(opts Options) (*plan, error) {
	p := &plan{opts: opts, fence: opts.FenceColumn, version: opts.Version}
	var err error
	if p.table, err = fencedwrite.ParseTableName(opts.Table); err != nil {
		return nil, err
	}
	if p.fence == "" {
		p.fence = fencedwrite.DefaultFenceColumn
	}
	if err := fencedwrite.CheckIdentifier("fence column", p.fence); err != nil {
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
			if err := fencedwrite.CheckIdentifier(group.what, c); err != nil {
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
	if len(p.version) > 20 || strings.Trim(p.version, "0123456789") != "" {
		return nil, fmt.Errorf("%w: version %q must be 1..20 digits", ErrInvalidOptions, p.version)
	}
	if g := opts.Guard; g != nil {
		if (g.LockName == "") == (g.LockNameColumn == "") {
			return nil, fmt.Errorf("%w: guard: set exactly one of LockName and LockNameColumn", ErrInvalidOptions)
		}
		if g.LockName != "" {
			if err := checkLockName(g.LockName); err != nil {
				return nil, err
			}
		} else if err := fencedwrite.CheckIdentifier("lock name column", g.LockNameColumn); err != nil {
			return nil, err
		}
		if g.Mode != fencedwrite.Strict && g.Mode != fencedwrite.Reentrant {
			return nil, fmt.Errorf("%w: guard: unknown mode %v", ErrInvalidOptions, g.Mode)
		}
	}
	return p, nil
}

// checkLockName admits lock names that are safe inside a standard SQL string
// literal under any setting: no quotes, backslashes or control characters.
func checkLockName(s string) error {
	if s == "" || len(s) > 512 || !utf8.ValidString(s) {
		return fmt.Errorf("%w: guard lock name must be 1..512 bytes of UTF-8", ErrInvalidOptions)
	}
	for _, r := range s {
		if r == '\'' || r == '\\' || r < 0x20 || r == 0x7f {
			return fmt.Errorf("%w: guard lock name %q holds %q", ErrInvalidOptions, s, r)
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

// Validate checks opts against a live database schema: the table exists, the
// key and set columns exist, the key is a primary key or unique index, and
// the fence column is absent (or, with HasFenceColumn, present as bigint);
// with a guard, that the lock name column exists. It only reads the catalog.
// Errors are those of [fencedwrite.Inspect] and [fencedwrite.Prepare]
// (fencedwrite.ErrUnknownTable, ErrUnknownColumn, ErrNoFenceColumn,
// ErrKeyNotUnique) or [ErrInvalidOptions].
func Validate(ctx context.Context, db fencedwrite.DBTX, opts Options) error {
	p, err := check(opts)
	if err != nil {
		return err
	}
	ti, err := fencedwrite.Inspect(ctx, db, opts.Table)
	if err != nil {
		return err
	}
	cols := append(append([]string{}, opts.Key...), opts.Set...)
	if g := opts.Guard; g != nil && g.LockNameColumn != "" {
		cols = append(cols, g.LockNameColumn)
	}
	for _, c := range cols {
		if _, ok := ti.Column(c); !ok {
			return &fencedwrite.ColumnError{Sentinel: fencedwrite.ErrUnknownColumn, Table: ti.Qualified(), Column: c}
		}
	}
	if !ti.IsUniqueKey(opts.Key) {
		return fmt.Errorf("%w: %s (%s)", fencedwrite.ErrKeyNotUnique, ti.Qualified(), strings.Join(opts.Key, ", "))
	}
	_, has := ti.Column(p.fence)
	switch {
	case opts.HasFenceColumn:
		return ti.CheckFenceColumn(p.fence)
	case has:
		return fmt.Errorf("%w: %s already has column %q; set HasFenceColumn to generate without adding it",
			ErrInvalidOptions, ti.Qualified(), p.fence)
	}
	return nil
}

// Generate writes the migration and the sqlc query file for opts. It does no
// I/O; call [Validate] first to check the names against a live schema.
func Generate(opts Options) (*Files, error) {
	p, err := check(opts)
	if err != nil {
		return nil, err
	}
	fileBase := strings.ToLower(p.table.Name)
	if p.table.Schema != "" {
		fileBase = strings.ToLower(p.table.Schema) + "_" + fileBase
	}
	f := &Files{QueriesName: "fenced_" + fileBase + ".sql", Queries: []byte(p.queries())}
	if !opts.HasFenceColumn || opts.Guard != nil {
		f.MigrationName = p.version + "_pgfence_fence_" + fileBase + ".sql"
		f.Migration = []byte(p.migration())
	}
	return f, nil
}

func q(s string) string { return pgx.Identifier{s}.Sanitize() }

func (p *plan) migration() string {
	tbl := p.table.String()
	var b strings.Builder
	fmt.Fprintf(&b, "-- Generated by pgfence (fencegen): fencing for %s.\n", tbl)
	b.WriteString("-- The fence column holds the highest fencing token each row accepted; rows start at 0.\n")
	b.WriteString("-- Rollout: apply this, ship writers that send tokens, then attach the guard last.\n\n")
	b.WriteString("-- +goose Up\n")
	if !p.opts.HasFenceColumn {
		fmt.Fprintf(&b, "ALTER TABLE %s ADD COLUMN %s bigint NOT NULL DEFAULT 0;\n", tbl, q(p.fence))
		fmt.Fprintf(&b, "COMMENT ON COLUMN %s.%s IS 'Highest fencing token (pgfence.locks) this row accepted; writes with a lower token are refused.';\n",
			tbl, q(p.fence))
	}
	if g := p.opts.Guard; g != nil {
		lock := "lock_name => '" + g.LockName + "'"
		if g.LockNameColumn != "" {
			lock = "lock_name_column => '" + g.LockNameColumn + "'"
		}
		fmt.Fprintf(&b, "SELECT pgfence.guard('%s'::regclass, %s, fence_column => '%s', mode => '%s');\n",
			tbl, lock, p.fence, g.Mode)
	}
	b.WriteString("\n-- +goose Down\n")
	if p.opts.Guard != nil {
		fmt.Fprintf(&b, "SELECT pgfence.unguard('%s'::regclass);\n", tbl)
	}
	if !p.opts.HasFenceColumn {
		fmt.Fprintf(&b, "ALTER TABLE %s DROP COLUMN %s;\n", tbl, q(p.fence))
	}
	return b.String()
}

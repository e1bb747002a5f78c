package fencegen

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/pgfence/pgfence"
)

// ErrPgfenceModule is returned by [Files.Plan] for a target directory inside
// the pgfence module itself (its own migrations/ and queries/ hold pgfence's
// schema, not an application's): the nearest go.mod above the directory
// declares module github.com/pgfence/pgfence.
var ErrPgfenceModule = errors.New("fencegen: directory belongs to the pgfence module itself")

const pgfenceModule = "github.com/pgfence/pgfence"

// Dirs are the directories the generated files go to. Missing directories
// are created by [WritePlan.Apply].
type Dirs struct {
	// Migrations is the goose migrations directory (what sqlc reads as the schema).
	Migrations string
	// Queries is the sqlc queries directory.
	Queries string
}

// Action is what [WritePlan.Apply] does with one file.
type Action int

const (
	// Create writes a new file.
	Create Action = iota + 1
	// Update rewrites the query file generated earlier with other content.
	// Migrations are never updated: they may have been applied.
	Update
	// UpToDate leaves the file alone: an existing file already does what the
	// generated one would.
	UpToDate
)

// String names the action, as the CLI prints it.
func (a Action) String() string {
	switch a {
	case Create:
		return "create"
	case Update:
		return "update"
	case UpToDate:
		return "up to date"
	}
	return fmt.Sprintf("Action(%d)", int(a))
}

// Step is one file of a [WritePlan].
type Step struct {
	Action Action
	Kind   FileKind
	// Path is the file written (Create, Update) or the existing file that
	// already has the content (UpToDate): the directory from [Dirs] joined
	// with the file name.
	Path string
	// Data is the content written; nil for UpToDate.
	Data []byte
}

// WritePlan is what writing [Files] into [Dirs] would do, from [Files.Plan].
// Apply carries it out.
type WritePlan struct {
	// Steps lists one step per file: the migrations in goose order, then
	// the query file. Changing it does not change what Apply writes.
	Steps []Step

	p        *plan
	migrated bool     // a fence-column migration (or a guard on the fence column) exists
	mkdirs   []string // target directories, created by Apply when missing
	ops      []writeOp
	applied  bool
}

type writeOp struct {
	path    string
	data    []byte
	update  bool
	old     []byte      // update: the content Plan saw, restored on failure
	oldMode fs.FileMode // update: the file's permissions
}

// Changes reports whether Apply would create or update any file.
func (wp *WritePlan) Changes() bool { return len(wp.ops) > 0 }

// Validate is [Validate] for a plan: a fence-column migration found in the
// migrations directory means the fence column may already be in the
// database (the migration was applied) or not yet (it was not), and both
// are accepted, as a re-run needs no HasFenceColumn.
func (wp *WritePlan) Validate(ctx context.Context, db pgfence.DBTX) error {
	return wp.p.validate(ctx, db, wp.migrated)
}

// Write writes the files into the migrations and queries directories:
// [Files.Plan] followed by [WritePlan.Apply]. It writes every file that is
// missing or out of date, or none; running it again with the same options
// writes nothing. Use Plan and Apply to see what is written.
func (f *Files) Write(migrationsDir, queriesDir string) error {
	wp, err := f.Plan(Dirs{Migrations: migrationsDir, Queries: queriesDir})
	if err != nil {
		return err
	}
	return wp.Apply()
}

// Plan compares the generated files with what d already holds and decides
// what to write. It reads the directories and writes nothing.
//
// Migrations generated earlier are recognised by name and by the statement
// they run (with the generated header). An existing migration adding the same
// fence column makes the fence-column migration [UpToDate]. The guard
// migration is UpToDate when the newest earlier guard statement for the table
// is the one it would run; otherwise a new guard migration is created, whose
// Down section restores the guard it replaces. Existing migrations are never
// changed or removed, and the generator never removes a guard (write a
// migration calling pgfence.unguard for that).
//
// The first migration written takes Options.Version. New migrations must be
// newer than every migration in the directory, or Plan fails with
// [ErrConflict].
//
// The query file is wholly generated: an existing one with the generated
// header and other content is rewritten ([Update]); one without the header
// is the user's own and Plan fails with [ErrFileExists].
//
// Plan fails with [ErrPgfenceModule] for directories inside the pgfence
// module itself, and with an error for paths that exist but are not
// directories.
func (f *Files) Plan(d Dirs) (*WritePlan, error) {
	if f == nil || f.p == nil {
		return nil, fmt.Errorf("%w: Files must come from Generate", ErrInvalidOptions)
	}
	p := f.p
	if len(f.Migrations) > 0 && d.Migrations == "" {
		return nil, fmt.Errorf("%w: no migrations directory", ErrInvalidOptions)
	}
	if d.Queries == "" {
		return nil, fmt.Errorf("%w: no queries directory", ErrInvalidOptions)
	}
	wp := &WritePlan{p: p}
	var dirs []string
	if len(f.Migrations) > 0 {
		dirs = append(dirs, d.Migrations)
	}
	dirs = append(dirs, d.Queries)
	for _, dir := range dirs {
		if err := checkTargetDir(dir); err != nil {
			return nil, err
		}
	}

	var migSteps []Step
	var migOps []writeOp
	if len(f.Migrations) > 0 {
		ex, err := scanMigrations(d.Migrations, p)
		if err != nil {
			return nil, err
		}
		columnCreated := false
		for _, m := range f.Migrations {
			if m.Kind == GuardMigration && !columnCreated {
				// The first migration this run writes takes the version given.
				m.Name = p.version + guardSuffix + p.fileBase() + ".sql"
			}
			step := Step{Action: Create, Kind: m.Kind, Path: filepath.Join(d.Migrations, m.Name), Data: m.Data}
			switch m.Kind {
			case ColumnMigration:
				want := p.addColumnSQL()
				if path, ok := ex.addColumn[want]; ok {
					wp.migrated = true
					migSteps = append(migSteps, Step{Action: UpToDate, Kind: m.Kind, Path: path})
					continue
				}
				if len(ex.addColumn) > 0 {
					var other []string
					for _, path := range ex.addColumn {
						other = append(other, path)
					}
					sort.Strings(other)
					return nil, fmt.Errorf("%w: %s already adds another fence column to %s; this would add %s: use the same fence column",
						ErrConflict, strings.Join(other, ", "), p.table, q(p.fence))
				}
				if ex.guardOnFence {
					// A guard on this fence column was attached: the column was there.
					wp.migrated = true
					continue
				}
			case GuardMigration:
				want := guardSQL(p.table, p.fence, p.opts.Guard)
				if ex.guard == want {
					migSteps = append(migSteps, Step{Action: UpToDate, Kind: m.Kind, Path: ex.guardPath})
					continue
				}
				prev := ""
				if ex.guard != unguardSQL(p.table) {
					prev = ex.guard
				}
				step.Data = []byte(p.guardMigration(prev))
			}
			if err := ex.checkVersion(m.Name, d.Migrations); err != nil {
				return nil, err
			}
			if m.Kind == ColumnMigration {
				columnCreated = true
			}
			migSteps = append(migSteps, step)
			migOps = append(migOps, writeOp{path: step.Path, data: step.Data})
		}
		if len(migOps) > 0 {
			wp.mkdirs = append(wp.mkdirs, d.Migrations)
		}
	}

	qs := Step{Action: Create, Kind: QueryFile, Path: filepath.Join(d.Queries, f.Queries.Name), Data: f.Queries.Data}
	qop := writeOp{path: qs.Path, data: qs.Data}
	fi, err := os.Lstat(qs.Path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("fencegen: %w", err)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrFileExists, qs.Path)
	default:
		old, err := os.ReadFile(qs.Path)
		if err != nil {
			return nil, fmt.Errorf("fencegen: %w", err)
		}
		switch {
		case !isGenerated(old):
			return nil, fmt.Errorf("%w: %s was not generated by pgfence (it does not start with %q); move it away or choose another Go name",
				ErrFileExists, qs.Path, generatedPrefix)
		case !bytes.Contains(old, []byte(p.table.String())):
			return nil, fmt.Errorf("%w: %s was generated for another table; choose another Go name for %s",
				ErrConflict, qs.Path, p.table)
		case bytes.Equal(old, qs.Data):
			qs = Step{Action: UpToDate, Kind: QueryFile, Path: qs.Path}
		default:
			qs.Action = Update
			qop.update, qop.old, qop.oldMode = true, old, fi.Mode().Perm()
		}
	}
	if qs.Action != UpToDate {
		wp.mkdirs = append(wp.mkdirs, d.Queries)
		// The query file goes first: if the process dies between renames, a
		// query file without its migration makes sqlc generate fail (the
		// fence column is unknown), where a migration without its queries
		// would pass unnoticed.
		wp.ops = append(wp.ops, qop)
	}
	wp.ops = append(wp.ops, migOps...)
	wp.Steps = append(migSteps, qs)
	return wp, nil
}

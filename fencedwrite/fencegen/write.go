package fencegen

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/pgfence/pgfence/fencedwrite"
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
func (wp *WritePlan) Validate(ctx context.Context, db fencedwrite.DBTX) error {
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
// Migrations are recognised by name and by the statement they run, not by
// their comments or version: files named "<version>_pgfence_fence_<table>.sql"
// and "<version>_pgfence_guard_<table>.sql" that start with the generated
// header. An existing migration adding the same fence column makes the
// fence-column migration [UpToDate] (Options.HasFenceColumn is then not
// needed). The guard migration is UpToDate when the newest earlier guard
// statement for the table is the one it would run; otherwise a new guard
// migration is created (attaching again replaces the guard) and its Down
// section restores the guard it replaces. Existing migrations are never
// changed or removed, and the generator never removes a guard: write a
// migration calling pgfence.unguard for that.
//
// The first migration written takes Options.Version (so a guard added
// later has the version given, not the next one). New migrations must have
// a version newer than every migration in the directory (goose refuses
// out-of-order versions once later ones are applied); otherwise Plan fails
// with [ErrConflict].
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

// existingMigrations is what Plan learns from the migrations directory.
type existingMigrations struct {
	maxVersion   int64
	maxName      string
	addColumn    map[string]string // ADD COLUMN statement for the table -> file
	guard        string            // newest guard/unguard statement for the table
	guardPath    string
	guardOnFence bool // some guard statement for the table names the fence column
}

type genMigration struct {
	name, path string
	version    int64
	up         []string
}

// gooseVersion parses the version of a goose migration file name
// ("<digits>_<name>.sql" or ".go").
func gooseVersion(name string) (int64, bool) {
	i := strings.IndexByte(name, '_')
	if i <= 0 || !(strings.HasSuffix(name, ".sql") || strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go")) {
		return 0, false
	}
	if strings.Trim(name[:i], "0123456789") != "" {
		return 0, false
	}
	v, err := strconv.ParseInt(name[:i], 10, 64)
	return v, err == nil
}

func scanMigrations(dir string, p *plan) (*existingMigrations, error) {
	ex := &existingMigrations{addColumn: map[string]string{}}
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return ex, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fencegen: %w", err)
	}
	base := p.fileBase()
	var gens []genMigration
	for _, e := range entries {
		name := e.Name()
		v, ok := gooseVersion(name)
		if !ok {
			continue
		}
		if v > ex.maxVersion {
			ex.maxVersion, ex.maxName = v, name
		}
		rest := name[strings.IndexByte(name, '_'):]
		if rest != columnSuffix+base+".sql" && rest != guardSuffix+base+".sql" {
			continue
		}
		path := filepath.Join(dir, name)
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("fencegen: %w", err)
		}
		if !isGenerated(data) {
			return nil, fmt.Errorf("%w: %s is named like a generated migration but does not start with %q; fencegen cannot tell what it does",
				ErrConflict, path, generatedPrefix)
		}
		gens = append(gens, genMigration{name: name, path: path, version: v, up: upStatements(data)})
	}
	sort.Slice(gens, func(i, j int) bool {
		if gens[i].version != gens[j].version {
			return gens[i].version < gens[j].version
		}
		return gens[i].name < gens[j].name
	})
	tbl := p.table.String()
	addPrefix := "ALTER TABLE " + tbl + " ADD COLUMN "
	guardPrefix := "SELECT pgfence.guard('" + tbl + "'::regclass"
	unguard := unguardSQL(p.table)
	for _, g := range gens {
		for _, st := range g.up {
			switch {
			case strings.HasPrefix(st, addPrefix):
				if _, ok := ex.addColumn[st]; !ok {
					ex.addColumn[st] = g.path
				}
			case strings.HasPrefix(st, guardPrefix), st == unguard:
				ex.guard, ex.guardPath = st, g.path
				if strings.Contains(st, "fence_column => '"+p.fence+"'") {
					ex.guardOnFence = true
				}
			}
		}
	}
	return ex, nil
}

func (ex *existingMigrations) checkVersion(name, dir string) error {
	v, _ := gooseVersion(name)
	if v <= ex.maxVersion {
		return fmt.Errorf("%w: %s: version %d is not newer than %s, the newest migration in %s; use version %d or later (the default, the current UTC time, usually is)",
			ErrConflict, name, v, ex.maxName, dir, ex.maxVersion+1)
	}
	return nil
}

// upStatements returns the statements of a goose migration's Up section
// (the whole file without goose annotations), without comment lines,
// surrounding white space and the final ";".
func upStatements(data []byte) []string {
	var body []string
	in := !bytes.Contains(data, []byte("-- +goose Up"))
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimRight(line, " \t\r")
		t := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(t, "-- +goose Up"):
			in = true
			continue
		case strings.HasPrefix(t, "-- +goose Down"):
			in = false
			continue
		}
		if in && !strings.HasPrefix(t, "--") {
			body = append(body, line)
		}
	}
	var out []string
	for _, st := range strings.Split(strings.Join(body, "\n")+"\n", ";\n") {
		if st = strings.TrimSpace(st); st != "" {
			out = append(out, st)
		}
	}
	return out
}

// checkTargetDir refuses directories of the pgfence module and paths whose
// existing part is not a directory.
func checkTargetDir(dir string) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("fencegen: %w", err)
	}
	existing := abs
	for {
		fi, err := os.Stat(existing)
		if err == nil {
			if !fi.IsDir() {
				return fmt.Errorf("fencegen: cannot use %s as a directory: %s is not a directory", dir, existing)
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("fencegen: %w", err)
		}
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
	}
	// Resolve symbolic links in the part that exists.
	real := abs
	if r, err := filepath.EvalSymlinks(existing); err == nil {
		rel, err := filepath.Rel(existing, abs)
		if err == nil {
			real = filepath.Join(r, rel)
		}
	}
	for d := real; ; d = filepath.Dir(d) {
		if mod, ok := modulePath(filepath.Join(d, "go.mod")); ok {
			if mod == pgfenceModule {
				return fmt.Errorf("%w: %s is in %s (module %s)", ErrPgfenceModule, dir, d, mod)
			}
			return nil
		}
		if filepath.Dir(d) == d {
			return nil
		}
	}
}

// modulePath reads the module path of a go.mod file.
func modulePath(gomod string) (string, bool) {
	data, err := os.ReadFile(gomod)
	if err != nil {
		return "", false
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "module" {
			return strings.Trim(f[1], "\"`"), true
		}
	}
	return "", true
}

// Apply writes the plan's files: every file or none. Missing directories
// are created. Each file is first written (and synced) to a temporary file
// ".pgfence-gen-*.tmp" in its target directory; then the temporaries are
// moved into place: the query file first (it replaces an earlier generated
// one atomically by rename), then the migrations (hard-linked into place,
// which fails rather than overwrite a file that appeared since Plan). If any
// step fails, Apply removes the temporaries, the files it already moved into
// place, and the directories it created, and restores the query file it
// replaced; the error says so if that clean-up fails too.
//
// The window: the files appear one rename after another, not at once. A
// crash (SIGKILL, power loss) between two renames leaves some of the files
// written (the query file first) and possibly temporaries, which goose and
// sqlc ignore (they are not named *.sql). Running the generator again with
// the same options finishes the job, as it recognises what exists.
//
// Apply refuses to run twice.
func (wp *WritePlan) Apply() (err error) {
	if wp.applied {
		return errors.New("fencegen: plan already applied")
	}
	wp.applied = true
	if len(wp.ops) == 0 {
		return nil
	}
	type tempFile struct{ tmp, backup string }
	temps := make([]tempFile, len(wp.ops))
	var created []string // directories created here, parents first
	var committed []int  // ops moved into place
	defer func() {
		if err == nil {
			return
		}
		var undo []error
		for i := len(committed) - 1; i >= 0; i-- {
			o, t := wp.ops[committed[i]], temps[committed[i]]
			if o.update {
				if e := os.Rename(t.backup, o.path); e != nil {
					undo = append(undo, fmt.Errorf("could not restore %s: %w", o.path, e))
				}
			} else if e := os.Remove(o.path); e != nil {
				undo = append(undo, fmt.Errorf("could not remove %s: %w", o.path, e))
			}
		}
		for _, t := range temps {
			for _, name := range []string{t.tmp, t.backup} {
				if name == "" {
					continue
				}
				if e := os.Remove(name); e != nil && !errors.Is(e, fs.ErrNotExist) {
					undo = append(undo, fmt.Errorf("could not remove %s: %w", name, e))
				}
			}
		}
		for i := len(created) - 1; i >= 0; i-- {
			if e := os.Remove(created[i]); e != nil {
				undo = append(undo, fmt.Errorf("could not remove directory %s: %w", created[i], e))
			}
		}
		if len(undo) > 0 {
			err = fmt.Errorf("%w; clean-up incomplete: %w", err, errors.Join(undo...))
		} else {
			err = fmt.Errorf("%w (nothing written)", err)
		}
	}()

	for _, dir := range wp.mkdirs {
		c, err := mkdirAll(dir)
		created = append(created, c...)
		if err != nil {
			return fmt.Errorf("fencegen: %w", err)
		}
	}
	for i, o := range wp.ops {
		dir := filepath.Dir(o.path)
		if temps[i].tmp, err = writeTemp(dir, o.data, 0o644); err != nil {
			return err
		}
		if o.update {
			if temps[i].backup, err = writeTemp(dir, o.old, o.oldMode); err != nil {
				return err
			}
		}
	}
	for i, o := range wp.ops {
		if o.update {
			cur, err := os.ReadFile(o.path)
			if err != nil {
				return fmt.Errorf("fencegen: %w", err)
			}
			if !bytes.Equal(cur, o.old) {
				return fmt.Errorf("%w: %s changed since the plan was made", ErrConflict, o.path)
			}
			if err := os.Rename(temps[i].tmp, o.path); err != nil {
				return fmt.Errorf("fencegen: %w", err)
			}
			temps[i].tmp = ""
		} else if err := linkNew(temps[i].tmp, o.path); err != nil {
			return err
		}
		committed = append(committed, i)
	}
	for _, t := range temps {
		for _, name := range []string{t.tmp, t.backup} {
			if name != "" {
				_ = os.Remove(name) // a leftover temporary is harmless
			}
		}
	}
	seen := map[string]bool{}
	for _, o := range wp.ops {
		if dir := filepath.Dir(o.path); !seen[dir] {
			seen[dir] = true
			syncDir(dir)
		}
	}
	return nil
}

// mkdirAll is os.MkdirAll that reports the directories it created.
func mkdirAll(dir string) ([]string, error) {
	var missing []string
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		_, err := os.Stat(d)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		missing = append(missing, d)
		if filepath.Dir(d) == d {
			break
		}
	}
	var created []string
	for i := len(missing) - 1; i >= 0; i-- {
		err := os.Mkdir(missing[i], 0o755)
		if err == nil {
			created = append(created, missing[i])
		} else if !errors.Is(err, fs.ErrExist) {
			return created, err
		}
	}
	return created, nil
}

// writeTemp writes data to a new temporary file in dir and syncs it.
func writeTemp(dir string, data []byte, perm fs.FileMode) (string, error) {
	for range 100 {
		name := filepath.Join(dir, ".pgfence-gen-"+strconv.FormatUint(rand.Uint64(), 36)+".tmp")
		fh, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("fencegen: %w", err)
		}
		_, err = fh.Write(data)
		if err == nil {
			err = fh.Sync()
		}
		if cerr := fh.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(name)
			return "", fmt.Errorf("fencegen: %w", err)
		}
		return name, nil
	}
	return "", fmt.Errorf("fencegen: no free temporary file name in %s", dir)
}

// linkNew puts tmp in place at path unless path exists. A hard link does it
// atomically; on file systems without hard links, a check and a rename.
func linkNew(tmp, path string) error {
	err := os.Link(tmp, path)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w: %s appeared since the plan was made", ErrFileExists, path)
	}
	if err == nil {
		return nil
	}
	if _, serr := os.Lstat(path); !errors.Is(serr, fs.ErrNotExist) {
		return fmt.Errorf("%w: %s appeared since the plan was made", ErrFileExists, path)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("fencegen: %w", err)
	}
	return nil
}

// syncDir makes the renames in dir durable where the file system allows.
func syncDir(dir string) {
	if fh, err := os.Open(dir); err == nil {
		_ = fh.Sync()
		_ = fh.Close()
	}
}

package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/cmd/pgfence/internal/fencegen"
	"github.com/pgfence/pgfence/fencedwrite"
)

func (a *app) genCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "gen",
		Short: "Generate fenced-write code for your own tables",
	}
	var (
		opts                        fencegen.Options
		guardLock, guardLockCol     string
		guardReentrant, checkSchema bool
		migDir, queryDir            string
		sqlcConfig, sqlcBlock       string
		dryRun                      bool
	)
	fenced := &cobra.Command{
		Use:   "fenced --table T --key COLS --set COLS",
		Short: "Write goose migrations adding a fence column (and the guard) and a sqlc query file of fenced writes",
		Long: `Write the files that fence a table of yours:

  <migrations-dir>/<version>_pgfence_fence_<table>.sql  goose migration: add
      fence bigint NOT NULL DEFAULT 0 (not with --has-fence-column)
  <migrations-dir>/<version>_pgfence_guard_<table>.sql  goose migration:
      attach pgfence.guard (with --guard-lock or --guard-lock-column); a
      file of its own, so it can be applied after the writers send tokens
      (it takes the next version when the column migration is written too)
  <queries-dir>/fenced_<table>.sql  sqlc queries of fenced writes and the
      fenced read (fenced_<table>.<name>.sql with --name, so several query
      sets for one table do not collide)

Directories: --migrations-dir and --queries-dir, else the schema and queries
paths of the postgresql block of sqlc.yaml (sqlc.yml, sqlc.json) in the
current directory or --sqlc-config (--sqlc-block picks one of several
blocks). With neither, the command refuses (exit 2) rather than guess.
Missing directories are created.
The pgfence module's own migrations/ and queries/ are refused.

Re-running is safe: files that already do what this run would generate are
"up to date" and nothing is written; an existing fence-column migration means
the column is there (no --has-fence-column needed); a new guard (other lock,
mode) is a new guard migration; existing migrations are never changed. The
query file is regenerated ("updated") if its content differs; a file of that
name that pgfence did not generate is never overwritten. Either every file is
written or none (on failure the files of this run are removed again).

Then run your own 'goose up' and 'sqlc generate'. Names are checked (and
quoted in the output); with --check the table and columns are also looked up
in the database given by --database-url / DATABASE_URL. The queries compare
key columns with pg_catalog's "=", which an operator planted on the
search_path cannot replace; with --check, a key whose type is not built in
(citext, a domain, an enum) keeps its type's own "=". --dry-run prints the
files and writes nothing.`,
		Example: `  pgfence gen fenced --table invoices --key id --set pdf_url,status   # dirs from ./sqlc.yaml
  pgfence gen fenced --table public.catalogue --key store_id,sku --set price \
      --guard-lock-column store_lock --migrations-dir db/migrations --queries-dir db/queries --check`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if guardLock != "" && guardLockCol != "" {
				return usageErr("give at most one of --guard-lock and --guard-lock-column")
			}
			// Flags that would be ignored are refused: the user meant them.
			if guardReentrant && guardLock == "" && guardLockCol == "" {
				return usageErr("--guard-reentrant needs --guard-lock or --guard-lock-column (it sets the mode of the guard they attach)")
			}
			if cmd.Flags().Changed("fence-column") && opts.FenceColumn == "" {
				return usageErr("--fence-column is empty (leave it out for the default, fence)")
			}
			if sqlcBlock != "" && sqlcConfig == "" && migDir != "" && queryDir != "" {
				return usageErr("--sqlc-block selects a block of the sqlc configuration, which is not read when --migrations-dir and --queries-dir are both given (add --sqlc-config, or leave --sqlc-block out)")
			}
			if guardLock != "" || guardLockCol != "" {
				g := &fencedwrite.GuardOptions{LockName: guardLock, LockNameColumn: guardLockCol}
				if guardReentrant {
					g.Mode = fencedwrite.Reentrant
				}
				opts.Guard = g
			}
			files, err := fencegen.Generate(opts)
			if err != nil {
				return genErr(err)
			}
			// With --check, the key columns' types decide which "=" the
			// queries compare them with (fencegen.Options.OwnEqualKeys), and
			// the table's kind whether they name it ONLY.
			var pool *pgxpool.Pool
			if checkSchema {
				if pool, err = a.connect(cmd.Context()); err != nil {
					return err
				}
				defer pool.Close()
				if opts.OwnEqualKeys, err = fencegen.OwnEqualKeys(cmd.Context(), pool, opts); err != nil {
					return genErr(err)
				}
				// A partitioned table is named without ONLY (its rows are
				// in its partitions); an ordinary one with ONLY.
				if opts.Partitioned, err = fencegen.Partitioned(cmd.Context(), pool, opts); err != nil {
					return genErr(err)
				}
				if files, err = fencegen.Generate(opts); err != nil {
					return genErr(err)
				}
			}
			dirs, err := a.genDirs(migDir, queryDir, sqlcConfig, sqlcBlock)
			if err != nil {
				return err
			}
			plan, err := files.Plan(dirs)
			if err != nil {
				return genErr(err)
			}
			if pool != nil {
				if err := plan.Validate(cmd.Context(), pool); err != nil {
					return genErr(err)
				}
			}
			out := a.env.Stdout
			if dryRun {
				// The files printed are the dry run's only result: a
				// failed write (a full disk, a closed pipe) is an error.
				var werr error
				printf := func(format string, args ...any) {
					if werr == nil {
						_, werr = fmt.Fprintf(out, format, args...)
					}
				}
				for _, s := range plan.Steps {
					switch s.Action {
					case fencegen.Create, fencegen.Update:
						verb := map[fencegen.Action]string{fencegen.Create: "write", fencegen.Update: "update"}[s.Action]
						printf("would %s %s (%d bytes):\n%s\n", verb, s.Path, len(s.Data), s.Data)
					default:
						printf("up to date %s\n", s.Path)
					}
				}
				printf("dry run: nothing written\n")
				if werr != nil {
					return fmt.Errorf("cannot write the dry run to stdout: %w", werr)
				}
				return nil
			}
			if err := plan.Apply(); err != nil {
				return genErr(err)
			}
			if err := printGenResult(out, plan, opts.Table); err != nil {
				// The files are in place (written, or already up to date);
				// the caller (a script) must still learn that its report of
				// them is missing.
				return fmt.Errorf("the files are in place (written or already up to date), but cannot write the result to stdout: %w", err)
			}
			return nil
		},
	}
	f := fenced.Flags()
	f.StringVar(&opts.Table, "table", "", "table, optionally schema-qualified")
	f.StringSliceVar(&opts.Key, "key", nil, "key columns (primary key or a unique index), comma-separated")
	f.StringSliceVar(&opts.Set, "set", nil, "columns the fenced updates change, comma-separated")
	f.StringVar(&opts.FenceColumn, "fence-column", "fence", "name of the fence column")
	f.BoolVar(&opts.HasFenceColumn, "has-fence-column", false, "the table already has the fence column (not needed when an earlier run generated its migration)")
	f.StringVar(&opts.Name, "name", "", "Go name used in the query names (default: the table in CamelCase); also names the query file")
	f.StringVar(&opts.Version, "version", "", "goose version prefix of the migrations (default: current UTC time); must be newer than every migration in the directory")
	f.StringVar(&guardLock, "guard-lock", "", "attach the guard, governed by this lock name")
	f.StringVar(&guardLockCol, "guard-lock-column", "", "attach the guard, governed by the lock named in this column")
	f.BoolVar(&guardReentrant, "guard-reentrant", false, "guard in re-entrant mode (needed with fenced reads)")
	f.StringVar(&migDir, "migrations-dir", "", "directory for the goose migrations (default: sqlc's schema directory)")
	f.StringVar(&queryDir, "queries-dir", "", "directory for the sqlc query file (default: sqlc's queries directory)")
	f.StringVar(&sqlcConfig, "sqlc-config", "", "sqlc configuration to take the directories from (default: sqlc.yaml, sqlc.yml or sqlc.json in the current directory)")
	f.StringVar(&sqlcBlock, "sqlc-block", "", "the sql block of the sqlc configuration, by name or gen.go.package (when it has several postgresql blocks)")
	f.BoolVar(&dryRun, "dry-run", false, "print what would be written, write nothing")
	f.BoolVar(&checkSchema, "check", false, "check the table and columns against the database")
	cmd.AddCommand(fenced)
	return cmd
}

// genDirs decides the target directories: the flags, else the sqlc
// configuration's schema and queries paths. No guess: with neither, it is a
// usage error.
func (a *app) genDirs(migDir, queryDir, sqlcConfig, sqlcBlock string) (fencegen.Dirs, error) {
	dirs := fencegen.Dirs{Migrations: migDir, Queries: queryDir}
	if migDir != "" && queryDir != "" && sqlcConfig == "" {
		return dirs, nil
	}
	path := sqlcConfig
	if path == "" {
		var err error
		if path, err = fencegen.FindSQLCConfig("."); err != nil {
			return dirs, withCode(ExitUsage, err)
		}
	}
	if path == "" {
		var missing []string
		if migDir == "" {
			missing = append(missing, "--migrations-dir")
		}
		if queryDir == "" {
			missing = append(missing, "--queries-dir")
		}
		where := "the current directory"
		if wd, err := os.Getwd(); err == nil {
			where = wd
		}
		return dirs, usageErr("where do the files go? give %s (there is no sqlc.yaml, sqlc.yml or sqlc.json in %s to take the directories from; or give --sqlc-config)",
			strings.Join(missing, " and "), where)
	}
	cfg, err := fencegen.ReadSQLCConfig(path)
	if err != nil {
		return dirs, withCode(ExitUsage, err)
	}
	fromCfg, notes, err := cfg.Dirs(sqlcBlock)
	if err != nil {
		return dirs, usageErr("%v; choose with --sqlc-block or give --migrations-dir and --queries-dir", err)
	}
	if dirs.Migrations == "" {
		dirs.Migrations = fromCfg.Migrations
	}
	if dirs.Queries == "" {
		dirs.Queries = fromCfg.Queries
	}
	for _, n := range notes {
		fmt.Fprintf(a.env.Stderr, "pgfence: note: %s\n", n)
	}
	return dirs, nil
}

// printGenResult prints one line per file, then the next steps. It returns
// the first error writing to out.
func printGenResult(out io.Writer, plan *fencegen.WritePlan, table string) error {
	var werr error
	printf := func(format string, args ...any) {
		if werr == nil {
			_, werr = fmt.Fprintf(out, format, args...)
		}
	}
	var migrations, guard, queries bool
	for _, s := range plan.Steps {
		switch s.Action {
		case fencegen.Create:
			printf("wrote %s\n", s.Path)
		case fencegen.Update:
			printf("updated %s\n", s.Path)
		default:
			printf("up to date %s\n", s.Path)
			continue
		}
		switch s.Kind {
		case fencegen.ColumnMigration:
			migrations = true
		case fencegen.GuardMigration:
			migrations, guard = true, true
		case fencegen.QueryFile:
			queries = true
		}
	}
	switch {
	case migrations:
		printf("next: apply the migrations with goose, then run sqlc generate\n")
		if guard {
			printf("      (apply the guard migration once every writer of %s sends fencing tokens: from then on unfenced changes are refused)\n", table)
		}
	case queries:
		printf("next: run sqlc generate\n")
	default:
		printf("the files are up to date: nothing written\n")
	}
	return werr
}

// genErr maps generator errors to exit codes: bad names and options are usage
// errors, unknown tables and columns are "not found".
func genErr(err error) error {
	switch {
	case errors.Is(err, pgfence.ErrNotFound):
		return withCode(ExitNotFound, err)
	case errors.Is(err, pgfence.ErrInvalid), errors.Is(err, fencegen.ErrInvalidOptions),
		errors.Is(err, fencegen.ErrSQLCConfig):
		return withCode(ExitUsage, err)
	case errors.Is(err, fencegen.ErrPgfenceModule):
		return withCode(ExitUsage, fmt.Errorf("%w: give your application's directories with --migrations-dir and --queries-dir", err))
	}
	return err
}

package cli

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/fencedwrite/fencegen"
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
	)
	fenced := &cobra.Command{
		Use:   "fenced --table T --key COLS --set COLS",
		Short: "Write a goose migration adding a fence column (and optionally the guard) and a sqlc query file of fenced updates",
		Long: `Write two files for a table of yours:

  <migrations-dir>/<version>_pgfence_fence_<table>.sql  goose migration: add
      fence bigint NOT NULL DEFAULT 0 (and, with --guard-lock or
      --guard-lock-column, attach pgfence.guard last)
  <queries-dir>/fenced_<table>.sql  sqlc queries: FencedUpdate<T> (fence < token),
      FencedUpdate<T>Reentrant (fence <= token) and FencedRead<T>, each
      returning whether the row changed and its fence, so 0 rows can be
      explained with fencedwrite.Check.

Then run your own 'goose up' and 'sqlc generate'. Names are checked (and
quoted in the output); with --check the table and columns are also looked up
in the database given by --database-url / DATABASE_URL. Existing files are never
overwritten.`,
		Example: `  pgfence gen fenced --table invoices --key id --set pdf_url,status
  pgfence gen fenced --table public.catalogue --key store_id,sku --set price \
      --guard-lock-column store_lock --migrations-dir db/migrations --queries-dir db/queries --check`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if guardLock != "" && guardLockCol != "" {
				return usageErr("give at most one of --guard-lock and --guard-lock-column")
			}
			if guardLock != "" || guardLockCol != "" {
				g := &fencedwrite.GuardOptions{LockName: guardLock, LockNameColumn: guardLockCol}
				if guardReentrant {
					g.Mode = fencedwrite.Reentrant
				}
				opts.Guard = g
			}
			if checkSchema {
				ctx := cmd.Context()
				pool, err := a.connect(ctx)
				if err != nil {
					return err
				}
				defer pool.Close()
				if err := fencegen.Validate(ctx, pool, opts); err != nil {
					return genErr(err)
				}
			}
			files, err := fencegen.Generate(opts)
			if err != nil {
				return genErr(err)
			}
			if err := files.Write(migDir, queryDir); err != nil {
				return genErr(err)
			}
			if files.MigrationName != "" {
				fmt.Fprintf(a.env.Stdout, "wrote %s/%s\n", migDir, files.MigrationName)
			}
			fmt.Fprintf(a.env.Stdout, "wrote %s/%s\nnext: apply the migration with goose, then run sqlc generate\n", queryDir, files.QueriesName)
			return nil
		},
	}
	f := fenced.Flags()
	f.StringVar(&opts.Table, "table", "", "table, optionally schema-qualified")
	f.StringSliceVar(&opts.Key, "key", nil, "key columns (primary key or a unique index), comma-separated")
	f.StringSliceVar(&opts.Set, "set", nil, "columns the fenced updates change, comma-separated")
	f.StringVar(&opts.FenceColumn, "fence-column", "fence", "name of the fence column")
	f.BoolVar(&opts.HasFenceColumn, "has-fence-column", false, "the table already has the fence column (only attach the guard)")
	f.StringVar(&opts.Name, "name", "", "Go name used in the query names (default: the table in CamelCase)")
	f.StringVar(&opts.Version, "version", "", "goose version prefix of the migration (default: current UTC time)")
	f.StringVar(&guardLock, "guard-lock", "", "attach the guard, governed by this lock name")
	f.StringVar(&guardLockCol, "guard-lock-column", "", "attach the guard, governed by the lock named in this column")
	f.BoolVar(&guardReentrant, "guard-reentrant", false, "guard in re-entrant mode (needed with fenced reads)")
	f.StringVar(&migDir, "migrations-dir", "migrations", "directory for the goose migration")
	f.StringVar(&queryDir, "queries-dir", "queries", "directory for the sqlc query file")
	f.BoolVar(&checkSchema, "check", false, "check the table and columns against the database")
	cmd.AddCommand(fenced)
	return cmd
}

// genErr maps generator errors to exit codes: bad names and options are usage
// errors, unknown tables and columns are "not found".
func genErr(err error) error {
	switch {
	case errors.Is(err, fencedwrite.ErrUnknownTable), errors.Is(err, fencedwrite.ErrUnknownColumn),
		errors.Is(err, fencedwrite.ErrNoFenceColumn):
		return withCode(ExitNotFound, err)
	case errors.Is(err, fencedwrite.ErrInvalidIdentifier), errors.Is(err, fencegen.ErrInvalidOptions),
		errors.Is(err, fencedwrite.ErrInvalidSpec), errors.Is(err, fencedwrite.ErrKeyNotUnique):
		return withCode(ExitUsage, err)
	}
	return err
}

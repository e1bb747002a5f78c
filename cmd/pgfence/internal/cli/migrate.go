package cli

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/migrations"
)

func (a *app) migrateCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply, roll back or inspect pgfence's embedded migrations (version table pgfence.goose_db_version)",
	}
	var jsonOut bool
	var to int64
	var all bool

	up := &cobra.Command{
		Use:   "up",
		Short: "Apply every pending migration (safe to run from several processes at once)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withProvider(cmd.Context(), func(ctx context.Context, p *goose.Provider) error {
				n := 0
				for {
					start := time.Now()
					res, err := p.UpByOne(ctx)
					if errors.Is(err, goose.ErrNoNextVersion) {
						break
					}
					if err != nil {
						return fmt.Errorf("migrate up: %w", err)
					}
					n++
					fmt.Fprintf(a.env.Stdout, "applied %s (%s)\n", res.Source.Path, time.Since(start).Round(time.Millisecond))
				}
				v, err := p.GetDBVersion(ctx)
				if err != nil {
					return err
				}
				if n == 0 {
					fmt.Fprintf(a.env.Stdout, "nothing to apply; version %d\n", v)
				} else {
					fmt.Fprintf(a.env.Stdout, "applied %d migration(s); version %d\n", n, v)
				}
				return nil
			})
		},
	}

	down := &cobra.Command{
		Use:   "down",
		Short: "Roll back the latest migration (--to N rolls back to version N, --all to 0)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Checked before connecting: --to with --all would roll back
			// everything.
			switch {
			case all && cmd.Flags().Changed("to"):
				return usageErr("give at most one of --to N and --all")
			case to < 0:
				return usageErr("--to must be >= 0")
			}
			return a.withProvider(cmd.Context(), func(ctx context.Context, p *goose.Provider) error {
				var results []*goose.MigrationResult
				var err error
				switch {
				case all:
					results, err = p.DownTo(ctx, 0)
				case cmd.Flags().Changed("to"):
					results, err = p.DownTo(ctx, to)
				default:
					var r *goose.MigrationResult
					r, err = p.Down(ctx)
					if r != nil {
						results = append(results, r)
					}
				}
				if errors.Is(err, goose.ErrNoNextVersion) {
					fmt.Fprintln(a.env.Stdout, "nothing to roll back")
					return nil
				}
				if err != nil {
					return fmt.Errorf("migrate down: %w", err)
				}
				for _, r := range results {
					fmt.Fprintf(a.env.Stdout, "rolled back %s (%s)\n", r.Source.Path, r.Duration.Round(time.Millisecond))
				}
				v, err := p.GetDBVersion(ctx)
				if err != nil {
					return err
				}
				fmt.Fprintf(a.env.Stdout, "version %d\n", v)
				return nil
			})
		},
	}
	down.Flags().Int64Var(&to, "to", 0, "roll back to this version")
	down.Flags().BoolVar(&all, "all", false, "roll back every migration (schema pgfence and its version table stay)")

	status := &cobra.Command{
		Use:   "status",
		Short: "List the migrations and whether each is applied",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withReadProvider(cmd.Context(), func(ctx context.Context, p *goose.Provider, migrated bool) error {
				var st []*goose.MigrationStatus
				if migrated {
					var err error
					if st, err = p.Status(ctx); err != nil {
						return err
					}
				} else {
					for _, src := range p.ListSources() {
						st = append(st, &goose.MigrationStatus{Source: src, State: goose.StatePending})
					}
				}
				type row struct {
					Version   int64      `json:"version"`
					File      string     `json:"file"`
					Applied   bool       `json:"applied"`
					AppliedAt *time.Time `json:"applied_at,omitempty"`
				}
				rows := make([]row, 0, len(st))
				for _, s := range st {
					r := row{Version: s.Source.Version, File: s.Source.Path, Applied: s.State == goose.StateApplied}
					if r.Applied {
						t := s.AppliedAt
						r.AppliedAt = &t
					}
					rows = append(rows, r)
				}
				if jsonOut {
					return writeJSON(a.env.Stdout, rows)
				}
				tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "VERSION\tFILE\tSTATE\tAPPLIED AT")
				for _, r := range rows {
					state, at := "pending", "-"
					if r.Applied {
						state, at = "applied", r.AppliedAt.UTC().Format(time.RFC3339)
					}
					fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", r.Version, r.File, state, at)
				}
				return tw.Flush()
			})
		},
	}
	status.Flags().BoolVar(&jsonOut, "json", false, "print JSON")

	version := &cobra.Command{
		Use:   "version",
		Short: "Print the applied schema version and the latest known one",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withReadProvider(cmd.Context(), func(ctx context.Context, p *goose.Provider, migrated bool) error {
				v := int64(0)
				if migrated {
					var err error
					if v, err = p.GetDBVersion(ctx); err != nil {
						return err
					}
				}
				srcs := p.ListSources()
				latest := int64(0)
				if len(srcs) > 0 {
					latest = srcs[len(srcs)-1].Version
				}
				var err error
				if jsonOut {
					err = writeJSON(a.env.Stdout, map[string]int64{"version": v, "latest": latest})
				} else {
					_, err = fmt.Fprintf(a.env.Stdout, "version %d (latest %d)\n", v, latest)
				}
				if err != nil {
					return fmt.Errorf("cannot write to stdout: %w", err)
				}
				return nil
			})
		},
	}
	version.Flags().BoolVar(&jsonOut, "json", false, "print JSON")

	cmd.AddCommand(up, down, status, version)
	return cmd
}

func (a *app) withProvider(ctx context.Context, fn func(context.Context, *goose.Provider) error) error {
	pool, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer func(db *sql.DB) { _ = db.Close() }(db)
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		return err
	}
	return fn(ctx, p)
}

// withReadProvider is withProvider for migrate status and version, which
// only read: on a database without pgfence's version table it creates
// nothing (migrations.NewProvider would create schema pgfence and the
// table, owned by whoever looked, so that the migrating role could then not
// migrate) and calls fn with a provider that only lists the embedded
// migrations and migrated false: nothing is applied, the version is 0.
func (a *app) withReadProvider(ctx context.Context, fn func(context.Context, *goose.Provider, bool) error) error {
	pool, err := a.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT pg_catalog.to_regclass($1) IS NOT NULL", migrations.VersionTable).Scan(&exists); err != nil {
		return err
	}
	db := stdlib.OpenDBFromPool(pool)
	defer func(db *sql.DB) { _ = db.Close() }(db)
	if exists {
		// A migrated database: NewProvider creates nothing (it looks for
		// the version table again, under the migration lock).
		p, err := migrations.NewProvider(ctx, db)
		if err != nil {
			return err
		}
		return fn(ctx, p, true)
	}
	// goose.NewProvider reads the embedded files only; the provider is
	// used for ListSources, never for a method that touches the database.
	p, err := goose.NewProvider(goose.DialectPostgres, db, migrations.FS(),
		goose.WithTableName(migrations.VersionTable), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	fmt.Fprintf(a.env.Stderr, "pgfence: not migrated: the database has no %s; run: pgfence migrate up\n", migrations.VersionTable)
	return fn(ctx, p, false)
}

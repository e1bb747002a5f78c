package cli

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
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
	var all, yes bool

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
		Short: "Roll back the latest migration (--to N rolls back to version N, --all to 0; to 0 needs --yes)",
		Long: `Roll back the latest applied migration, or every migration above version N
(--to N, N a version of migrate status, at most the applied one), or every
migration (--all, the same as --to 0).

Rolling back to version 0 (--all, --to 0, or the latest migration when only
the baseline is applied) drops every table of pgfence: every lease and its
tokens (pgfence.locks), every job and outbox intent, and detaches the guard
from your tables, whose unfenced writes are then accepted. It needs --yes.`,
		Example: `  pgfence migrate down                # roll back the latest migration
  pgfence migrate down --to 22
  pgfence migrate down --all --yes    # everything: leases, jobs, guards`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			toSet := cmd.Flags().Changed("to")
			// Checked before connecting: --to with --all would roll back
			// everything.
			switch {
			case all && toSet:
				return usageErr("give at most one of --to N and --all")
			case to < 0:
				return usageErr("--to must be >= 0")
			case (all || (toSet && to == 0)) && !yes:
				return refuseDownToZero(cmd)
			}
			if toSet && to > 0 {
				known, err := migrationVersions()
				if err != nil {
					return err
				}
				if newest := known[len(known)-1]; to > newest {
					return usageErr("--to %d: above the newest migration, version %d: nothing to roll back to (see pgfence migrate version)", to, newest)
				}
				if !slices.Contains(known, to) {
					return usageErr("--to %d: no migration has version %d (the versions are %s; see pgfence migrate status)", to, to, joinVersions(known))
				}
			}
			return a.withProvider(cmd.Context(), func(ctx context.Context, p *goose.Provider) error {
				current, err := p.GetDBVersion(ctx)
				if err != nil {
					return err
				}
				switch {
				case toSet && to > current:
					return usageErr("--to %d: above the applied version %d, nothing to roll back to (see pgfence migrate version)", to, current)
				case !all && !toSet && current > 0 && !yes:
					// The latest migration only: refused when it is the
					// baseline, whose rollback drops everything.
					if prev, err := previousVersion(ctx, p, current); err != nil {
						return err
					} else if prev == 0 {
						return refuseDownToZero(cmd)
					}
				}
				var results []*goose.MigrationResult
				switch {
				case all:
					results, err = p.DownTo(ctx, 0)
				case toSet:
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
	down.Flags().Int64Var(&to, "to", 0, "roll back to this version (a version of migrate status, at most the applied one; 0 needs --yes)")
	down.Flags().BoolVar(&all, "all", false, "roll back every migration: drops every lease, job and outbox intent and detaches the guards (needs --yes; schema pgfence and its version table stay)")
	down.Flags().BoolVar(&yes, "yes", false, "confirm a rollback to version 0 (--all, --to 0, or the baseline)")

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

// refuseDownToZero is the error of a rollback to version 0 without --yes.
func refuseDownToZero(cmd *cobra.Command) error {
	what := "migrate down --all rolls back to version 0"
	switch {
	case cmd.Flags().Changed("to"):
		what = "migrate down --to 0 rolls back to version 0"
	case !cmd.Flags().Changed("all"):
		what = "migrate down would roll back the baseline, the only migration applied, to version 0"
	}
	return usageErr("%s: it drops every lease and its tokens (pgfence.locks), every job and outbox intent, "+
		"and detaches the guard from your tables, which then accept unfenced writes; add --yes to do it", what)
}

// migrationVersions returns the versions of the embedded migrations, in
// order (the versions goose reads from their file names).
func migrationVersions() ([]int64, error) {
	names, err := fs.Glob(migrations.FS(), "*.sql")
	if err != nil {
		return nil, err
	}
	var vs []int64
	for _, n := range names {
		v, err := goose.NumericComponent(n)
		if err != nil {
			return nil, fmt.Errorf("migration %s: %w", n, err)
		}
		vs = append(vs, v)
	}
	if len(vs) == 0 {
		return nil, errors.New("no embedded migrations")
	}
	slices.Sort(vs)
	return vs, nil
}

// joinVersions prints versions as "1, 2, 5, 6".
func joinVersions(vs []int64) string {
	s := make([]string, len(vs))
	for i, v := range vs {
		s[i] = strconv.FormatInt(v, 10)
	}
	return strings.Join(s, ", ")
}

// previousVersion returns the applied version below current: where a plain
// migrate down leaves the database (0 when current is the baseline).
func previousVersion(ctx context.Context, p *goose.Provider, current int64) (int64, error) {
	st, err := p.Status(ctx)
	if err != nil {
		return 0, err
	}
	prev := int64(0)
	for _, s := range st {
		if s.State == goose.StateApplied && s.Source.Version < current && s.Source.Version > prev {
			prev = s.Source.Version
		}
	}
	return prev, nil
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

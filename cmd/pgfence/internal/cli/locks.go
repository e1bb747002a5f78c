package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// lockView is one lock as printed by `pgfence locks` (JSON field names are
// part of the CLI's interface).
type lockView struct {
	Name        string          `json:"name"`
	State       string          `json:"state"`
	Holder      *string         `json:"holder"`
	Token       int64           `json:"token"`
	AcquiredAt  *time.Time      `json:"acquired_at"`
	RenewedAt   *time.Time      `json:"renewed_at"`
	ExpiresAt   *time.Time      `json:"expires_at"`
	ExpiresInMS *int64          `json:"expires_in_ms"`
	Metadata    json.RawMessage `json:"metadata,omitempty"`
	DBNow       time.Time       `json:"db_now"`
}

func viewOf(name string, token int64, holder *string, acq, ren, exp *time.Time, meta []byte, state string, inMS int64, now time.Time) lockView {
	v := lockView{Name: name, State: state, Holder: holder, Token: token, AcquiredAt: acq, RenewedAt: ren, ExpiresAt: exp, DBNow: now}
	if state != "free" {
		ms := inMS
		v.ExpiresInMS = &ms
	}
	if len(meta) > 0 {
		v.Metadata = json.RawMessage(meta)
	}
	return v
}

func (a *app) locksCommand() *cobra.Command {
	var (
		held, expired, free, jsonOut bool
		pattern                      string
		limit                        int32
	)
	cmd := &cobra.Command{
		Use:   "locks",
		Short: "List lease locks: state on the database clock (held / expired / free), holder, token, expiry",
		Long: `List the rows of pgfence.locks. State and "expires in" are computed on the
database's clock. With no state flag every state is listed; state flags combine.`,
		Example: `  pgfence locks
  pgfence locks --held --name 'invoice:%'
  pgfence locks --expired --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit <= 0 {
				return usageErr("--limit must be > 0")
			}
			states := []string{}
			if held {
				states = append(states, "held")
			}
			if expired {
				states = append(states, "expired")
			}
			if free {
				states = append(states, "free")
			}
			if len(states) == 0 {
				states = []string{"held", "expired", "free"}
			}
			ctx := cmd.Context()
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			rows, more, err := listLocks(ctx, pool, pattern, states, limit)
			if err != nil {
				return err
			}
			if more > 0 {
				fmt.Fprintf(a.env.Stderr, "pgfence: %d more row(s) not shown (--limit %d)\n", more, limit)
			}
			views := make([]lockView, 0, len(rows))
			for _, r := range rows {
				views = append(views, viewOf(r.Name, r.Token, r.Holder, r.AcquiredAt, r.RenewedAt, r.ExpiresAt, r.Metadata, r.State, r.ExpiresInMs, r.DbNow))
			}
			if jsonOut {
				return writeJSON(a.env.Stdout, views)
			}
			return printLocks(a.env.Stdout, views)
		},
	}
	f := cmd.Flags()
	f.BoolVar(&held, "held", false, "only locks held now")
	f.BoolVar(&expired, "expired", false, "only locks whose holder's lease ran out without a release")
	f.BoolVar(&free, "free", false, "only released (or never granted) locks")
	f.StringVar(&pattern, "name", "%", "SQL LIKE pattern on the lock name, e.g. 'invoice:%'")
	f.Int32Var(&limit, "limit", 1000, "maximum rows (stderr says how many more match)")
	f.BoolVar(&jsonOut, "json", false, "print JSON")

	var showJSON bool
	show := &cobra.Command{
		Use:   "show NAME",
		Short: "Show one lock in detail (exit 3 if there is no such lock)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkNamed("lock name", args[0]); err != nil {
				return err
			}
			ctx := cmd.Context()
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			r, err := dbsqlc.New().GetLock(ctx, pool, args[0])
			if errors.Is(err, pgx.ErrNoRows) {
				return withCode(ExitNotFound, fmt.Errorf("no lock named %q", args[0]))
			}
			if err != nil {
				return err
			}
			v := viewOf(r.Name, r.Token, r.Holder, r.AcquiredAt, r.RenewedAt, r.ExpiresAt, r.Metadata, r.State, r.ExpiresInMs, r.DbNow)
			if showJSON {
				return writeJSON(a.env.Stdout, v)
			}
			tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "name:\t%s\n", termSafe(v.Name))
			fmt.Fprintf(tw, "state:\t%s\n", termSafe(v.State))
			fmt.Fprintf(tw, "holder:\t%s\n", termSafeOr(v.Holder, "-"))
			fmt.Fprintf(tw, "token:\t%d\n", v.Token)
			fmt.Fprintf(tw, "acquired at:\t%s\n", timeOr(v.AcquiredAt))
			fmt.Fprintf(tw, "renewed at:\t%s\n", timeOr(v.RenewedAt))
			fmt.Fprintf(tw, "expires at:\t%s\n", timeOr(v.ExpiresAt))
			fmt.Fprintf(tw, "expires in:\t%s\n", expiresIn(v))
			if len(v.Metadata) > 0 {
				fmt.Fprintf(tw, "metadata:\t%s\n", termSafe(string(v.Metadata)))
			}
			fmt.Fprintf(tw, "database now:\t%s\n", v.DBNow.UTC().Format(time.RFC3339Nano))
			return tw.Flush()
		},
	}
	show.Flags().BoolVar(&showJSON, "json", false, "print JSON")
	cmd.AddCommand(show)
	return cmd
}

// listLocks returns at most limit locks matching pattern and states, and how
// many more match: the listing and the count read one snapshot (a READ
// ONLY, REPEATABLE READ transaction), on which the states agree too (now()
// is the transaction's start).
func listLocks(ctx context.Context, pool *pgxpool.Pool, pattern string, states []string, limit int32) ([]dbsqlc.ListLocksRow, int64, error) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, 0, err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, err := dbsqlc.New().ListLocks(ctx, tx, dbsqlc.ListLocksParams{NamePattern: pattern, States: states, MaxRows: limit})
	if err != nil {
		return nil, 0, err
	}
	var more int64
	if len(rows) >= int(limit) {
		// The filter of ListLocks (queries/locks_inspect.sql).
		var total int64
		if err := tx.QueryRow(ctx, `SELECT pg_catalog.count(*) FROM pgfence.lock_status
			WHERE (name OPERATOR(pg_catalog.~~) $1::pg_catalog.text) AND (state OPERATOR(pg_catalog.=) ANY ($2::pg_catalog.text[]))`,
			pattern, states).Scan(&total); err != nil {
			return nil, 0, err
		}
		more = total - int64(len(rows))
	}
	return rows, more, tx.Commit(ctx)
}

func printLocks(w io.Writer, views []lockView) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tSTATE\tHOLDER\tTOKEN\tACQUIRED\tEXPIRES IN")
	for _, v := range views {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", termSafe(v.Name), termSafe(v.State), termSafeOr(v.Holder, "-"),
			v.Token, timeOr(v.AcquiredAt), expiresIn(v))
	}
	return tw.Flush()
}

func expiresIn(v lockView) string {
	if v.ExpiresInMS == nil {
		return "-"
	}
	d := time.Duration(*v.ExpiresInMS) * time.Millisecond
	if d < 0 {
		return fmt.Sprintf("expired %s ago", (-d).Round(100*time.Millisecond))
	}
	return d.Round(100 * time.Millisecond).String()
}

func timeOr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

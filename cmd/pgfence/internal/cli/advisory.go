package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/pglock/advisory"
)

func (a *app) advisoryCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "advisory",
		Short: "Inspect PostgreSQL advisory locks (pg_locks joined to pg_stat_activity)",
	}
	var jsonOut bool
	var keyName string
	list := &cobra.Command{
		Use:   "list",
		Short: "List advisory locks held or awaited in this database, with their sessions",
		Example: `  pgfence advisory list
  pgfence advisory list --name nightly-report   # only the key pgfence derives from this name
  pgfence advisory list --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var want advisory.Key
			named := cmd.Flags().Changed("name")
			if named && keyName == "" {
				// An unset shell variable: listing every lock would answer
				// another question than the one asked.
				return usageErr("--name is empty (leave --name out to list every advisory lock)")
			}
			if named {
				k, err := advisory.Name(keyName)
				if err != nil {
					return withCode(ExitUsage, err)
				}
				want = k
			}
			ctx := cmd.Context()
			pool, err := a.connect(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			locks, err := advisory.List(ctx, pool)
			if err != nil {
				return err
			}
			type row struct {
				Key             string     `json:"key"`
				Mode            string     `json:"mode"`
				Granted         bool       `json:"granted"`
				PID             int32      `json:"pid"`
				User            string     `json:"user"`
				ApplicationName string     `json:"application_name"`
				ClientAddr      string     `json:"client_addr"`
				State           string     `json:"state"`
				BackendStart    time.Time  `json:"backend_start"`
				QueryStart      *time.Time `json:"query_start"`
			}
			rows := []row{}
			for _, l := range locks {
				if named && l.Key != want {
					continue
				}
				rows = append(rows, row{l.Key.String(), l.Mode.String(), l.Granted, l.PID, l.User, l.ApplicationName,
					l.ClientAddr, l.State, l.BackendStart, l.QueryStart})
			}
			if jsonOut {
				return writeJSON(a.env.Stdout, rows)
			}
			tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "KEY\tMODE\tGRANTED\tPID\tUSER\tAPPLICATION\tCLIENT\tSTATE\tBACKEND START")
			for _, r := range rows {
				client := r.ClientAddr
				if client == "" {
					client = "local"
				}
				// Role and application names are chosen by whoever connects.
				fmt.Fprintf(tw, "%s\t%s\t%v\t%d\t%s\t%s\t%s\t%s\t%s\n", termSafe(r.Key), termSafe(r.Mode), r.Granted, r.PID,
					termSafe(r.User), termSafe(r.ApplicationName), termSafe(client), termSafe(r.State), r.BackendStart.UTC().Format(time.RFC3339))
			}
			return tw.Flush()
		},
	}
	list.Flags().BoolVar(&jsonOut, "json", false, "print JSON")
	list.Flags().StringVar(&keyName, "name", "", "show only the key pgfence derives from this lock name")
	cmd.AddCommand(list)
	return cmd
}

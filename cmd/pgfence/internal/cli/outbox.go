package cli

import (
	"errors"
	"fmt"
	"text/tabwriter"

	topicrule "github.com/pgfence/pgfence/internal/topic"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/outbox"
)

// outboxView is one topic as printed by `pgfence outbox` (JSON field names
// are part of the CLI's interface).
type outboxView struct {
	Topic                    string  `json:"topic"`
	Pending                  int64   `json:"pending"`
	RetryWaiting             int64   `json:"retry_waiting"`
	InFlight                 int64   `json:"in_flight"`
	ExpiredClaims            int64   `json:"expired_claims"`
	Delivered                int64   `json:"delivered"`
	Dead                     int64   `json:"dead"`
	OldestUndeliveredSeconds float64 `json:"oldest_undelivered_seconds"`
}

func (a *app) outboxCommand() *cobra.Command {
	var (
		topic   string
		jsonOut bool
	)
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Show the outbox per topic: pending, in flight, dead, oldest undelivered intent",
		Long: `Count the intents of pgfence.outbox per topic, on the database's clock
(the pgfence.outbox_status view):

  pending    due for delivery, not claimed by a dispatcher
  retrying   a failed attempt waits for its retry (or a later start)
  in flight  claimed by a dispatcher, claim not expired
  expired    claimed by a dispatcher that died or stalled; the next claim
             takes the intent over
  delivered  the dispatcher's handler succeeded
  dead       every attempt failed, or the receiver refused it for good:
             needs a human
  OLDEST     age of the oldest intent neither delivered nor dead

With --topic, only that topic; a topic with no intent (a misspelt name, or
every intent deleted) exits with code 3. Counting reads every intent.`,
		Example: `  pgfence outbox
  pgfence outbox --topic payments --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if cmd.Flags().Changed("topic") {
				if err := topicrule.Check(topic); err != nil {
					return withCode(ExitUsage, fmt.Errorf("invalid topic: %w", err))
				}
			}
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			var exists bool
			if err := pool.QueryRow(ctx, "SELECT pg_catalog.to_regclass('pgfence.outbox_status') IS NOT NULL").Scan(&exists); err != nil {
				return err
			}
			if !exists {
				return withCode(ExitNotMigrated, errors.New("database has no pgfence outbox; run: pgfence migrate up"))
			}
			all, err := outbox.Status(ctx, pool)
			if err != nil {
				return err
			}
			views := []outboxView{}
			for _, s := range all {
				if cmd.Flags().Changed("topic") && s.Topic != topic {
					continue
				}
				views = append(views, outboxView{Topic: s.Topic, Pending: s.Pending, RetryWaiting: s.RetryWaiting,
					InFlight: s.InFlight, ExpiredClaims: s.ExpiredClaims, Delivered: s.Delivered, Dead: s.Dead,
					OldestUndeliveredSeconds: s.OldestUndeliveredSeconds})
			}
			if cmd.Flags().Changed("topic") && len(views) == 0 {
				return withCode(ExitNotFound, fmt.Errorf("topic %s has no intents (misspelt, or its intents were deleted)", termSafe(topic)))
			}
			if jsonOut {
				return writeJSON(a.env.Stdout, views)
			}
			tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "TOPIC\tPENDING\tRETRYING\tIN FLIGHT\tEXPIRED\tDELIVERED\tDEAD\tOLDEST")
			for _, v := range views {
				oldest := "-"
				if v.Pending+v.RetryWaiting+v.InFlight+v.ExpiredClaims > 0 {
					oldest = fmt.Sprintf("%.1fs", v.OldestUndeliveredSeconds)
				}
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", termSafe(v.Topic), v.Pending, v.RetryWaiting, v.InFlight,
					v.ExpiredClaims, v.Delivered, v.Dead, oldest)
			}
			return tw.Flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&topic, "topic", "", "only this topic")
	f.BoolVar(&jsonOut, "json", false, "print JSON (an array, one object per topic)")
	return cmd
}

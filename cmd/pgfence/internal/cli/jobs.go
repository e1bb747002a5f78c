package cli

import (
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"unicode"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/skiplocked"
)

// jobsView is one queue as printed by `pgfence jobs` (JSON field names are
// part of the CLI's interface).
type jobsView struct {
	Queue      string `json:"queue"`
	Available  int64  `json:"available"`
	Scheduled  int64  `json:"scheduled"`
	Running    int64  `json:"running"`
	Expired    int64  `json:"expired"`
	Completed  int64  `json:"completed"`
	Dead       int64  `json:"dead"`
	Unfinished int64  `json:"unfinished"`
	Drained    bool   `json:"drained"`
}

func jobsViewOf(d skiplocked.Depth) jobsView {
	return jobsView{Queue: d.Queue, Available: d.Available, Scheduled: d.Scheduled, Running: d.Running, Expired: d.Expired,
		Completed: d.Completed, Dead: d.Dead, Unfinished: d.Unfinished(), Drained: d.Drained()}
}

func (a *app) jobsCommand() *cobra.Command {
	var (
		queue   string
		jsonOut bool
	)
	cmd := &cobra.Command{
		Use:   "jobs",
		Short: "Show the depth of pgfence.jobs queues: available, scheduled, running, expired, completed, dead",
		Long: `Count the jobs of pgfence.jobs per queue and state, on the database's clock:

  available  due and waiting for a worker
  scheduled  available but not due yet (a future run_at, or a failed attempt
             waiting for its retry)
  running    claimed, claim not expired
  expired    claimed, but the claim expired: the worker died or stalled; the
             next claim takes the job over
  completed  done
  dead       failed its last attempt, or given up
  DRAINED    yes when the queue has jobs and every one is completed or dead:
             a batch import is over (check DEAD for the ones that failed)

With --queue, only that queue; a queue with no job at all (a misspelt name,
or every job deleted) exits with code 3, so a script never takes a wrong name
for a finished import. Counting reads every row of the queues counted,
finished ones included.`,
		Example: `  pgfence jobs
  pgfence jobs --queue catalogue/2024-06-01
  pgfence jobs --queue catalogue/2024-06-01 --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if cmd.Flags().Changed("queue") {
				// Before connecting: exit 2 with or without a database
				// (skiplocked checks again).
				if err := checkQueueName(queue); err != nil {
					return err
				}
			}
			var depths []skiplocked.Depth
			pool, err := a.connectMigrated(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			if cmd.Flags().Changed("queue") {
				depths, err = skiplocked.QueueDepths(ctx, pool, queue)
				if errors.Is(err, pgfence.ErrInvalid) {
					return withCode(ExitUsage, err)
				}
				if err != nil {
					return err
				}
				if depths[0].Total() == 0 {
					return withCode(ExitNotFound, fmt.Errorf("queue %s has no jobs (misspelt, or its jobs were deleted)", termSafe(queue)))
				}
			} else if depths, err = skiplocked.QueueDepths(ctx, pool); err != nil {
				return err
			}
			views := make([]jobsView, len(depths))
			for i, d := range depths {
				views[i] = jobsViewOf(d)
			}
			if jsonOut {
				return writeJSON(a.env.Stdout, views)
			}
			tw := tabwriter.NewWriter(a.env.Stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "QUEUE\tAVAILABLE\tSCHEDULED\tRUNNING\tEXPIRED\tCOMPLETED\tDEAD\tDRAINED")
			for _, v := range views {
				drained := "no"
				if v.Drained {
					drained = "yes"
				}
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\n", termSafe(v.Queue), v.Available, v.Scheduled, v.Running,
					v.Expired, v.Completed, v.Dead, drained)
			}
			return tw.Flush()
		},
	}
	f := cmd.Flags()
	f.StringVar(&queue, "queue", "", "only this queue")
	f.BoolVar(&jsonOut, "json", false, "print JSON (an array, one object per queue)")
	return cmd
}

// maxQueueBytes is skiplocked's limit on a queue name.
const maxQueueBytes = 128

// checkQueueName refuses a queue name skiplocked would refuse (its rule:
// 1 to 128 bytes of valid UTF-8 without control characters).
func checkQueueName(q string) error {
	switch {
	case q == "":
		return usageErr("--queue: empty")
	case len(q) > maxQueueBytes:
		return usageErr("--queue: %d bytes, at most %d", len(q), maxQueueBytes)
	case !utf8.ValidString(q):
		return usageErr("--queue: not valid UTF-8")
	case strings.IndexFunc(q, unicode.IsControl) >= 0:
		return usageErr("--queue: %q contains control characters", q)
	}
	return nil
}

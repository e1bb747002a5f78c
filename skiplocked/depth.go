package skiplocked

import (
	"context"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// Depth counts the jobs of one queue per state, on the database clock, at
// the moment of one statement.
type Depth struct {
	// Queue is the queue counted.
	Queue string
	// Available jobs are due (run_at has passed) and waiting for a worker.
	Available int64
	// Scheduled jobs are available but not due yet: enqueued with a future
	// RunAt, or failed and waiting for their retry backoff.
	Scheduled int64
	// Running jobs are held by a claim that has not expired.
	Running int64
	// Expired jobs are running with a claim that expired: their worker died
	// or stalled, and the next claim takes them over.
	Expired int64
	// Completed jobs are done (until deleted with [DeleteFinished]).
	Completed int64
	// Dead jobs failed their last attempt or were given up (until deleted).
	Dead int64
}

// Unfinished is the number of jobs that still need a worker: available,
// scheduled, running or expired.
func (d Depth) Unfinished() int64 { return d.Available + d.Scheduled + d.Running + d.Expired }

// Total is the number of jobs of the queue in every state.
func (d Depth) Total() int64 { return d.Unfinished() + d.Completed + d.Dead }

// Drained reports whether the queue has jobs and none of them is
// unfinished: every job is completed or dead. This is the condition
// [Worker.Drain] waits for.
func (d Depth) Drained() bool { return d.Total() > 0 && d.Unfinished() == 0 }

// QueueDepths counts jobs per state in one statement. With no queue named
// it returns every queue that has any job, ordered by name, reading the
// whole of pgfence.jobs. With queues named it returns one [Depth] per name,
// in the order given, reading only the rows of those queues; a queue with no
// job at all (never used, misspelt, or pruned) gets a Depth whose Total is
// 0. It reads finished jobs too: prune those with [DeleteFinished].
func QueueDepths(ctx context.Context, db pgfence.DBTX, queues ...string) ([]Depth, error) {
	if nilcheck.IsNil(db) {
		return nil, nilDB(opQueueDepths)
	}
	if len(queues) == 0 {
		rows, err := queries.QueueDepths(ctx, db)
		if err != nil {
			return nil, dbError(opQueueDepths, "", "", err)
		}
		ds := make([]Depth, len(rows))
		for i, r := range rows {
			ds[i] = Depth{Queue: r.Queue, Available: r.Available, Scheduled: r.Scheduled, Running: r.Running,
				Expired: r.Expired, Completed: r.Completed, Dead: r.Dead}
		}
		return ds, nil
	}
	for _, q := range queues {
		if err := checkQueue(opQueueDepths, q); err != nil {
			return nil, err
		}
	}
	rows, err := queries.QueueDepthsOf(ctx, db, queues)
	if err != nil {
		return nil, dbError(opQueueDepths, "", "", err)
	}
	found := make(map[string]Depth, len(rows))
	for _, r := range rows {
		found[r.Queue] = Depth{Queue: r.Queue, Available: r.Available, Scheduled: r.Scheduled, Running: r.Running,
			Expired: r.Expired, Completed: r.Completed, Dead: r.Dead}
	}
	ds := make([]Depth, len(queues))
	for i, q := range queues {
		ds[i] = found[q]
		ds[i].Queue = q
	}
	return ds, nil
}

// queueUnfinished reports whether queue has an available or running job,
// reading only the partial indexes of unfinished jobs. An unknown answer is
// reported as unfinished.
func queueUnfinished(ctx context.Context, db pgfence.DBTX, queue string) (bool, error) {
	v, err := queries.QueueHasUnfinished(ctx, db, queue)
	if err != nil {
		return true, dbError(opDrain, queue, "check whether the queue is drained", err)
	}
	return !v.Valid || v.Bool, nil
}

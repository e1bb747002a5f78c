package skiplocked

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/joblimit"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/pgtext"
)

// Limits checked before anything is sent to the database; the godoc of the
// fields and arguments that take them states them.
const (
	maxQueueBytes   = 128                    // longest queue name, in bytes
	maxHolderBytes  = 512                    // longest holder identity, in bytes
	maxBatch        = 10000                  // most rows one claim takes, most refs per call
	maxEnqueueBatch = 100000                 // most jobs one Enqueue call inserts
	minClaimTTL     = 100 * time.Millisecond // shortest leased claim
	maxClaimTTL     = 24 * time.Hour         // longest leased claim
	maxRetryDelay   = 365 * 24 * time.Hour   // longest retry delay of Fail
	// maxErrorLen is the longest last_error kept, in bytes; longer messages
	// are cut at a UTF-8 boundary.
	maxErrorLen = 8192
	// maxPayloadBytes is the payload limit of a job when
	// EnqueueParams.MaxPayloadBytes is 0, and the table's own (CHECK
	// jobs_payload_size): 1 MiB.
	maxPayloadBytes = 1 << 20
	// notifyChannel is the LISTEN/NOTIFY channel on which inserts into
	// pgfence.jobs announce their queue (the payload is the queue name).
	notifyChannel = "pgfence_jobs"
)

// State is the state of a job in pgfence.jobs.
type State string

// The states of a job.
const (
	// StateAvailable: waiting to be claimed once run_at has passed.
	StateAvailable State = "available"
	// StateRunning: held by a leased claim until ClaimExpiresAt.
	StateRunning State = "running"
	// StateCompleted: done.
	StateCompleted State = "completed"
	// StateDead: failed max_attempts times (or given up); LastError kept.
	StateDead State = "dead"
)

var queries = dbsqlc.New()

// Job is one row of pgfence.jobs.
type Job struct {
	// ID is the job id, assigned by the database.
	ID int64
	// Queue is the queue the job belongs to.
	Queue string
	// Payload is the job's arguments as JSON (as stored by jsonb).
	Payload json.RawMessage
	// Priority orders claims: lower first.
	Priority int16
	// RunAt is the earliest database time the job may be claimed.
	RunAt time.Time
	// Attempts counts leased claims so far (in-transaction claims count
	// only failures).
	Attempts int
	// MaxAttempts is the number of attempts before the job goes dead.
	MaxAttempts int
	// State is available, running, completed or dead.
	State State
	// Holder is the holder identity of the latest leased claim ("" if never
	// claimed).
	Holder string
	// ClaimToken is the token of the latest leased claim (0 if never
	// claimed). Pass [Job.Ref] to Complete, Fail, Renew and Release.
	ClaimToken int64
	// ClaimExpiresAt is the database time the current claim ends; zero unless
	// State is running.
	ClaimExpiresAt time.Time
	// LastError is the message of the latest failure or expired claim.
	LastError string
	// CreatedAt is the database time of the insert.
	CreatedAt time.Time
	// UpdatedAt is the database time of the latest change by pgfence.
	UpdatedAt time.Time
	// FinishedAt is zero unless State is completed or dead.
	FinishedAt time.Time
	// ClaimKey is the secret key of the claim, set only on the jobs [Claim]
	// returns (the database keeps only its SHA-256). Renewing, completing,
	// failing and releasing the claim need it, with ClaimToken: pass
	// [Job.Ref]. Keep it to the process that holds the claim.
	ClaimKey [16]byte
}

// ClaimRef names one leased claim: a job, the claim token it was claimed
// with and the claim's secret key. Every change made under a claim is
// conditional on all three: the token is public (any role that reads
// pgfence.jobs sees it), the key is known only to the claimer.
type ClaimRef struct {
	// JobID is the claimed job.
	JobID int64
	// Token is the claim token the job was claimed with.
	Token int64
	// Key is the claim's key ([Job.ClaimKey]).
	Key [16]byte
}

// Ref returns the claim reference of a job returned by [Claim].
func (j Job) Ref() ClaimRef { return ClaimRef{JobID: j.ID, Token: j.ClaimToken, Key: j.ClaimKey} }

func jobFromRow(r dbsqlc.PgfenceJob) Job {
	j := Job{
		ID: r.ID, Queue: r.Queue, Payload: json.RawMessage(r.Payload), Priority: r.Priority, RunAt: r.RunAt,
		Attempts: int(r.Attempts), MaxAttempts: int(r.MaxAttempts), State: State(r.State),
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
	}
	if r.Holder != nil {
		j.Holder = *r.Holder
	}
	if r.ClaimToken.Valid {
		j.ClaimToken = r.ClaimToken.Int64
	}
	if r.ClaimExpiresAt != nil {
		j.ClaimExpiresAt = *r.ClaimExpiresAt
	}
	if r.LastError != nil {
		j.LastError = *r.LastError
	}
	if r.FinishedAt != nil {
		j.FinishedAt = *r.FinishedAt
	}
	return j
}

// EnqueueParams describe one job to insert.
type EnqueueParams struct {
	// Queue is the queue name, 1..128 bytes, no control characters.
	Queue string
	// Payload is the job's arguments as JSON. Defaults to {} when empty;
	// invalid JSON, and JSON that jsonb does not store (invalid UTF-8, the
	// escape \u0000, a surrogate escape without its pair), is refused with
	// [pgfence.ErrInvalid].
	Payload json.RawMessage
	// Priority orders claims: lower first. Defaults to 0.
	Priority int16
	// RunAt is the earliest time the job may be claimed. Defaults to now()
	// on the database clock when zero. Its year (UTC) must be 1..9999
	// ([pgfence.ErrInvalid] otherwise): a "never" such as
	// time.Unix(math.MaxInt64, 0) is refused, not stored.
	RunAt time.Time
	// MaxAttempts is the number of attempts before the job goes dead,
	// 1..1,000,000. Defaults to 25 when 0.
	MaxAttempts int
	// MaxPayloadBytes bounds len(Payload): a larger payload is refused with
	// [pgfence.ErrInvalid] before any SQL runs. At most 1 MiB (1,048,576),
	// which is also the table's own limit (CHECK jobs_payload_size, on the
	// stored text form, refused with the same error); a value above it, or
	// negative, is refused too. Defaults to 1 MiB when 0.
	// Jobs carry references to large data (a file name, an object key), not
	// the data.
	MaxPayloadBytes int
}

// normalize checks job i of n and fills its defaults.
func (p EnqueueParams) normalize(i, n int) (EnqueueParams, error) {
	// arg names a field of the job, with its index when there are several.
	arg := func(field string) string {
		if n > 1 {
			return fmt.Sprintf("ps[%d].%s", i, field)
		}
		return field
	}
	if err := checkQueue(opEnqueue, p.Queue); err != nil {
		if n > 1 {
			err.(*pgfence.Error).Reason = fmt.Sprintf("ps[%d].%s", i, err.(*pgfence.Error).Reason)
		}
		return p, err
	}
	limit := p.MaxPayloadBytes
	switch {
	case limit == 0:
		limit = maxPayloadBytes
	case limit < 0 || limit > maxPayloadBytes:
		return p, withName(invalid(opEnqueue, arg("MaxPayloadBytes"), "%d is outside 1..%d (the table's limit)", limit, maxPayloadBytes), p.Queue)
	}
	if len(p.Payload) > limit {
		return p, withName(invalid(opEnqueue, arg("Payload"), "%d bytes, the limit is %d (EnqueueParams.MaxPayloadBytes)",
			len(p.Payload), limit), p.Queue)
	}
	if len(p.Payload) == 0 {
		p.Payload = json.RawMessage("{}")
	} else if !json.Valid(p.Payload) {
		return p, withName(invalid(opEnqueue, arg("Payload"), "not valid JSON"), p.Queue)
	} else if prob := pgtext.JSONProblem(p.Payload); prob != "" {
		return p, withName(invalid(opEnqueue, arg("Payload"), "%s", prob), p.Queue)
	}
	if p.MaxAttempts == 0 {
		p.MaxAttempts = joblimit.DefaultMaxAttempts
	}
	if p.MaxAttempts < 1 || p.MaxAttempts > joblimit.MaxMaxAttempts {
		return p, withName(invalid(opEnqueue, arg("MaxAttempts"), "%d not in 1..%d", p.MaxAttempts, joblimit.MaxMaxAttempts), p.Queue)
	}
	if prob := joblimit.RunAtProblem(p.RunAt); prob != "" {
		return p, withName(invalid(opEnqueue, arg("RunAt"), "%s", prob), p.Queue)
	}
	return p, nil
}

// withName sets the queue of e.
func withName(e *pgfence.Error, name string) *pgfence.Error {
	e.Name = name
	return e
}

// Enqueue inserts jobs in one statement and returns their ids in the order
// given: up to 100,000 per call. Every job is validated first; one bad job
// fails the call and nothing is inserted. With no jobs it does nothing.
//
// Inserting notifies listening [Worker]s of the queues when the transaction
// commits. Run it on a transaction to enqueue atomically with other writes.
func Enqueue(ctx context.Context, db pgfence.DBTX, ps ...EnqueueParams) ([]int64, error) {
	if nilcheck.IsNil(db) {
		return nil, nilDB(opEnqueue)
	}
	if len(ps) == 0 {
		return nil, nil
	}
	if len(ps) > maxEnqueueBatch {
		return nil, invalid(opEnqueue, "ps", "%d jobs in one call, at most %d", len(ps), maxEnqueueBatch)
	}
	arg := dbsqlc.EnqueueJobsParams{
		Queues: make([]string, len(ps)), Payloads: make([][]byte, len(ps)), Priorities: make([]int16, len(ps)),
		RunAts: make([]time.Time, len(ps)), RunNows: make([]bool, len(ps)), MaxAttempts: make([]int32, len(ps)),
	}
	for i, p := range ps {
		p, err := p.normalize(i, len(ps))
		if err != nil {
			return nil, err
		}
		arg.Queues[i], arg.Payloads[i], arg.Priorities[i] = p.Queue, p.Payload, p.Priority
		arg.MaxAttempts[i] = int32(p.MaxAttempts)
		if p.RunAt.IsZero() {
			arg.RunNows[i], arg.RunAts[i] = true, time.Unix(0, 0)
		} else {
			arg.RunAts[i] = p.RunAt
		}
	}
	rows, err := queries.EnqueueJobs(ctx, db, arg)
	if err != nil {
		name := ""
		if len(ps) == 1 {
			name = ps[0].Queue
		}
		if pgerr.PayloadNumberOutOfRange(err) {
			e := invalid(opEnqueue, "Payload", "%s", pgerr.PayloadNumberReason)
			e.Name, e.Err = name, err
			return nil, e
		}
		return nil, dbError(opEnqueue, name, "", err)
	}
	if len(rows) != len(ps) {
		return nil, &pgfence.Error{Op: opEnqueue, Reason: fmt.Sprintf("pgfence.job_enqueue returned %d rows for %d jobs", len(rows), len(ps))}
	}
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	return ids, nil
}

// GetJob returns one job, or an error matching [pgfence.ErrNotFound]; an id
// not above 0 is refused with [pgfence.ErrInvalid] before any SQL runs.
func GetJob(ctx context.Context, db pgfence.DBTX, id int64) (Job, error) {
	if nilcheck.IsNil(db) {
		return Job{}, nilDB(opGetJob)
	}
	if id <= 0 {
		return Job{}, invalid(opGetJob, "id", "%d: must be > 0", id)
	}
	row, err := queries.GetJob(ctx, db, id)
	if errors.Is(err, pgx.ErrNoRows) {
		return Job{}, notFound(opGetJob, id, "job")
	}
	if err != nil {
		return Job{}, dbError(opGetJob, "", "", err)
	}
	return jobFromRow(row), nil
}

// DeleteFinished deletes up to limit completed or dead jobs that finished
// before the given time (its year, UTC, in 1..9999) and returns how many it
// deleted. The dead job of an outbox intent stays until the intent is
// deleted from pgfence.outbox (see package outbox). Call it in a loop to
// prune a large backlog in small transactions.
func DeleteFinished(ctx context.Context, db pgfence.DBTX, before time.Time, limit int) (int64, error) {
	if nilcheck.IsNil(db) {
		return 0, nilDB(opDeleteFinished)
	}
	if err := checkLimit(opDeleteFinished, "limit", limit); err != nil {
		return 0, err
	}
	if p := joblimit.RunAtProblem(before); p != "" {
		return 0, invalid(opDeleteFinished, "before", "%s", p)
	}
	n, err := queries.DeleteFinishedJobs(ctx, db, before, int32(limit))
	if err != nil {
		return 0, dbError(opDeleteFinished, "", "", err)
	}
	return n, nil
}

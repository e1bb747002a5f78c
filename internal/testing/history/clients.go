package history

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
	"github.com/pgfence/pgfence/skiplocked"
)

// Client records the operations of one client of the recorder. After an
// operation with an unknown outcome it takes a new client id (the old one
// stays open in the history), as a real client that lost track of a request
// would. A Client is not safe for concurrent use: give each goroutine one.
type Client struct {
	r  *Recorder
	id int
	// KeepAlive says the leases this client acquires are renewed in the
	// background (Config.KeepAlive): those renewals are not recorded, so
	// the models treat the lease's expiry as unknown.
	KeepAlive bool

	// unknownRelease holds the Leases whose latest Release had an unknown
	// outcome.
	unknownRelease map[*pglock.Lease]bool
}

// NewClient returns a client with a new id.
func (r *Recorder) NewClient() *Client { return &Client{r: r, id: r.Client()} }

// ID is the client's current id.
func (c *Client) ID() int { return c.id }

func (c *Client) begin(in Input) *Pending { return c.r.Begin(c.id, in) }

// end records out for p; an unknown outcome moves c to a new id.
func (c *Client) end(p *Pending, out Output) {
	p.End(out)
	if out.Outcome == Unknown {
		c.id = c.r.Client()
	}
}

// at converts a local monotonic time to the recorder's clock.
func (c *Client) at(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return c.r.offset + int64(t.Sub(c.r.start))
}

// invalid reports errors refused before any SQL ran: nothing is recorded.
func invalid(err error) bool {
	return errors.Is(err, pgfence.ErrInvalid)
}

// Acquire records l.Acquire (wait) or l.TryAcquire of name.
func (c *Client) Acquire(ctx context.Context, l *pglock.Locker, name string, ttl time.Duration, wait bool) (*pglock.Lease, error) {
	p := c.begin(Input{Kind: Acquire, Key: name, Holder: l.Holder(), TTL: ttl, KeepAlive: c.KeepAlive})
	var (
		lease *pglock.Lease
		err   error
	)
	if wait {
		lease, err = l.Acquire(ctx, name, ttl)
	} else {
		lease, err = l.TryAcquire(ctx, name, ttl)
	}
	c.endAcquire(p, lease, err)
	return lease, err
}

func (c *Client) endAcquire(p *Pending, lease *pglock.Lease, err error) {
	var locked *pgfence.Error
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK, Token: lease.Token(), Expires: Micros(lease.ExpiresAt()), Deadline: c.at(lease.Deadline())})
	case invalid(err):
	case errors.As(err, &locked) && locked.Kind == pgfence.ErrLocked && locked.Err == nil:
		// Refused: the holder and its expiry when the answer named them.
		c.end(p, Output{Outcome: Busy, Holder: locked.Holder, Expires: Micros(locked.ExpiresAt)})
	default:
		// Cut, timed out while waiting (a handoff may have been granted
		// and given back), a grant too slow to use (granted and given
		// back): it may have taken effect (see BoundCutAcquires).
		c.end(p, Output{Outcome: Unknown})
	}
}

// Renew records lease.Renew.
func (c *Client) Renew(ctx context.Context, lease *pglock.Lease) error {
	p := c.begin(Input{Kind: Renew, Key: lease.Name(), Holder: lease.Holder(), Token: lease.Token(), TTL: lease.TTL()})
	err := lease.Renew(ctx)
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK, Expires: Micros(lease.ExpiresAt()), Deadline: c.at(lease.Deadline())})
	case errors.Is(err, pgfence.ErrReleased), errors.Is(err, pgfence.ErrLost) && !errors.Is(err, context.DeadlineExceeded):
		// Refused by the database, or the lease had ended (no SQL).
		c.end(p, Output{Outcome: Lost})
	default:
		// A connection error, or the local deadline passed while the
		// renewal was in flight: the database may have extended it.
		c.end(p, Output{Outcome: Unknown})
	}
	return err
}

// Release records lease.Release. A second release of a released lease runs
// no SQL and is not recorded.
func (c *Client) Release(ctx context.Context, lease *pglock.Lease) error {
	if errors.Is(lease.Err(), pgfence.ErrReleased) {
		return lease.Release(ctx)
	}
	retry := c.unknownRelease[lease]
	p := c.begin(Input{Kind: Release, Key: lease.Name(), Holder: lease.Holder(), Token: lease.Token(), Retry: retry})
	err := lease.Release(ctx)
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK})
		delete(c.unknownRelease, lease)
	case errors.Is(err, pgfence.ErrLost):
		c.end(p, Output{Outcome: Lost})
		delete(c.unknownRelease, lease)
	default:
		c.end(p, Output{Outcome: Unknown})
		if c.unknownRelease == nil {
			c.unknownRelease = map[*pglock.Lease]bool{}
		}
		c.unknownRelease[lease] = true
	}
	return err
}

// ReleaseToken records l.ReleaseToken of (name, token): the release a
// caller that lost its Lease (an acquire with an unknown outcome, a restarted
// process with the same lease key) sends after reading the grant with
// Inspect. The holder recorded is l's: in these histories a holder stands for
// one lease key.
func (c *Client) ReleaseToken(ctx context.Context, l *pglock.Locker, name string, token int64) error {
	p := c.begin(Input{Kind: Release, Key: name, Holder: l.Holder(), Token: token})
	err := l.ReleaseToken(ctx, name, token)
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK})
	case invalid(err):
	case errors.Is(err, pgfence.ErrLost):
		c.end(p, Output{Outcome: Lost})
	default:
		c.end(p, Output{Outcome: Unknown})
	}
	return err
}

// RenewToken records l.RenewToken of (name, token): the renewal of a caller
// that kept only the lease's name and token (and l, with its key).
func (c *Client) RenewToken(ctx context.Context, l *pglock.Locker, name string, token int64, ttl time.Duration) error {
	p := c.begin(Input{Kind: Renew, Key: name, Holder: l.Holder(), Token: token, TTL: ttl})
	expires, err := l.RenewToken(ctx, name, token, ttl)
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK, Expires: Micros(expires)})
	case invalid(err):
	case errors.Is(err, pgfence.ErrLost):
		c.end(p, Output{Outcome: Lost})
	default:
		c.end(p, Output{Outcome: Unknown})
	}
	return err
}

// Inspect records pglock.Inspect of name. A failed read changes nothing and
// is not recorded.
func (c *Client) Inspect(ctx context.Context, db pgfence.DBTX, name string) (pglock.LockInfo, error) {
	p := c.begin(Input{Kind: Inspect, Key: name})
	info, err := pglock.Inspect(ctx, db, name)
	if err != nil {
		return info, err
	}
	c.end(p, Output{Outcome: OK, Token: info.Token, Holder: info.Holder, Expires: Micros(info.ExpiresAt), DBNow: Micros(info.DBNow)})
	return info, nil
}

// RowKey is the history key of the fenced_values row key.
func RowKey(key string) string { return "fenced_values/" + key }

// Write records fencedwrite.UpsertValue of key under lock's token.
func (c *Client) Write(ctx context.Context, db pgfence.DBTX, lock string, token int64, mode fencedwrite.Mode, key, value string) error {
	m := "strict"
	if mode == fencedwrite.Reentrant {
		m = "reentrant"
	}
	doc, _ := json.Marshal(value)
	p := c.begin(Input{Kind: Write, Key: RowKey(key), Lock: lock, Token: token, Mode: m, Value: value})
	_, err := fencedwrite.UpsertValue(ctx, db, token, mode, key, doc)
	c.endRow(p, err)
	return err
}

// Read records fencedwrite.ReadValue of key under lock's token.
func (c *Client) Read(ctx context.Context, db pgfence.DBTX, lock string, token int64, key string) (string, error) {
	p := c.begin(Input{Kind: Read, Key: RowKey(key), Lock: lock, Token: token})
	v, err := fencedwrite.ReadValue(ctx, db, token, key)
	if err != nil {
		c.endRow(p, err)
		return "", err
	}
	var s string
	if uerr := json.Unmarshal(v.Value, &s); uerr != nil {
		s = "undecodable:" + string(v.Value)
	}
	c.end(p, Output{Outcome: OK, Value: s, Fence: v.Fence})
	return s, nil
}

// Fenced records a fenced write of any form (Table.Update, a generated
// query, a write inside a transaction): write runs it and returns its error,
// classified as fencedwrite's are (a refusal, or unknown when the error is
// not one). Key names the row; value is what the write stores, as the
// reads of the row will report it.
func (c *Client) Fenced(lock string, token int64, mode fencedwrite.Mode, key, value string, write func() error) error {
	m := "strict"
	if mode == fencedwrite.Reentrant {
		m = "reentrant"
	}
	p := c.begin(Input{Kind: Write, Key: key, Lock: lock, Token: token, Mode: m, Value: value})
	err := write()
	c.endRow(p, err)
	return err
}

// FencedRead records a fenced read of any form: read runs it and returns
// the value as the writes of the row record it.
func (c *Client) FencedRead(lock string, token int64, key string, read func() (string, error)) (string, error) {
	p := c.begin(Input{Kind: Read, Key: key, Lock: lock, Token: token})
	v, err := read()
	if err != nil {
		c.endRow(p, err)
		return "", err
	}
	c.end(p, Output{Outcome: OK, Value: v})
	return v, nil
}

// Seed records that row key holds value before any token wrote it (fence
// 0), as a test's setup inserted it.
func (r *Recorder) Seed(key, value string) {
	r.Add(Op{Client: r.Client(), Input: Input{Kind: Write, Key: key, Mode: "reentrant", Value: value}, Output: Output{Outcome: OK}, Call: 0, Return: 1})
}

func (c *Client) endRow(p *Pending, err error) {
	var (
		pe           *pgfence.Error
		fence, token int64
	)
	isErr := errors.As(err, &pe)
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK})
	case invalid(err):
	case isErr && pe.Kind == pgfence.ErrStaleToken && scanStale(pe.Reason, &fence, &token):
		c.end(p, Output{Outcome: Stale, Fence: fence})
	case errors.Is(err, pgfence.ErrAlreadyApplied):
		c.end(p, Output{Outcome: Applied})
	case errors.Is(err, pgfence.ErrNotFound):
		c.end(p, Output{Outcome: NotFound})
	case isErr && pe.Kind == nil && pe.Err == nil, // refused, the row changed concurrently
		errors.Is(err, pgfence.ErrGuard), errors.Is(err, pgfence.ErrStaleToken): // the guard's refusals
		c.end(p, Output{Outcome: Refused})
	default:
		c.end(p, Output{Outcome: Unknown})
	}
}

// Enqueue records outbox.Enqueue of an intent under lease.
func (c *Client) Enqueue(ctx context.Context, db pgfence.DBTX, lease *pglock.Lease, key string) error {
	return c.Enqueued(lease.Name(), lease.Token(), key, func() error {
		_, err := outbox.Enqueue(ctx, db, lease, outbox.Intent{Topic: "history", Key: key, Payload: json.RawMessage(`{}`)})
		return err
	})
}

// Enqueued records an outbox intent recorded by enqueue, which runs
// outbox.Enqueue and the commit of its transaction (the intent is checked
// again at commit) and returns the error of either.
func (c *Client) Enqueued(lock string, token int64, key string, enqueue func() error) error {
	p := c.begin(Input{Kind: Enqueue, Key: lock, Token: token, Value: key})
	err := outbox.TranslateError(enqueue())
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK})
	case errors.Is(err, pgfence.ErrInvalid) && pgerr.Code(err) == pgerr.TokenNotIssued:
		// A token the lock never issued (SQLSTATE PF002): ErrInvalid, but
		// refused by the database, which the model checks.
		c.end(p, Output{Outcome: NotIssued})
	case invalid(err):
	case errors.Is(err, pgfence.ErrStaleToken):
		c.end(p, Output{Outcome: Stale})
	case errors.Is(err, pgfence.ErrLost):
		c.end(p, Output{Outcome: Lost})
	default:
		c.end(p, Output{Outcome: Unknown})
	}
	return err
}

// JobKey is the history key of a job.
func JobKey(id int64) string { return "job/" + strconv.FormatInt(id, 10) }

// Claim records skiplocked.Claim as one claim operation per job it returned.
// A claim whose outcome is unknown is recorded on every job of known (the
// jobs of its queue): it may have taken any of them.
func (c *Client) Claim(ctx context.Context, db pgfence.DBTX, cp skiplocked.ClaimParams, known []int64) ([]skiplocked.Job, error) {
	call, callWall := c.r.Now(), time.Now().UnixMicro()
	jobs, err := skiplocked.Claim(ctx, db, cp)
	ret, retWall := c.r.Now(), time.Now().UnixMicro()
	if ret <= call {
		ret = call + 1
	}
	var ops []Op
	in := Input{Kind: Claim, Holder: cp.Holder, TTL: cp.TTL}
	switch {
	case err == nil:
		for _, j := range jobs {
			in.Key = JobKey(j.ID)
			ops = append(ops, Op{Client: c.id, Input: in, Call: call, Return: ret, CallWall: callWall, ReturnWall: retWall,
				Output: Output{Outcome: OK, Token: j.ClaimToken, Expires: Micros(j.ClaimExpiresAt)}})
		}
	case invalid(err):
	default:
		for _, id := range known {
			in.Key = JobKey(id)
			ops = append(ops, Op{Client: c.id, Input: in, Call: call, Return: math.MaxInt64, CallWall: callWall, ReturnWall: math.MaxInt64, Output: Output{Outcome: Unknown}})
		}
		defer func() { c.id = c.r.Client() }()
	}
	c.r.Add(ops...)
	return jobs, err
}

// Complete records skiplocked.Complete of a claim.
func (c *Client) Complete(ctx context.Context, db pgfence.DBTX, ref skiplocked.ClaimRef) error {
	p := c.begin(Input{Kind: Complete, Key: JobKey(ref.JobID), Token: ref.Token})
	err := skiplocked.Complete(ctx, db, ref)
	c.endJob(p, err)
	return err
}

// Fail records skiplocked.Fail of a claim (back to available after retry).
func (c *Client) Fail(ctx context.Context, db pgfence.DBTX, ref skiplocked.ClaimRef, retry time.Duration) error {
	p := c.begin(Input{Kind: Fail, Key: JobKey(ref.JobID), Token: ref.Token})
	_, err := skiplocked.Fail(ctx, db, ref, skiplocked.FailParams{Error: "history workload", RetryIn: retry})
	c.endJob(p, err)
	return err
}

func (c *Client) endJob(p *Pending, err error) {
	switch {
	case err == nil:
		c.end(p, Output{Outcome: OK})
	case errors.Is(err, pgfence.ErrLost):
		c.end(p, Output{Outcome: Lost})
	default:
		c.end(p, Output{Outcome: Unknown})
	}
}

// scanStale reads the row's fence and the token from the Reason of a stale
// fenced write, "row fence F > token T".
func scanStale(reason string, fence, token *int64) bool {
	n, _ := fmt.Sscanf(reason, "row fence %d > token %d", fence, token)
	return n == 2
}

// Package history records what each client of a test saw (every lease,
// fenced-write, claim and outbox operation with its call and return time, its
// input and its output, including the database's clock where the statement
// returned it) and checks the history: porcupine models of a lease, a fenced
// row and a job claim decide whether some order of the operations consistent
// with real time explains every output, and separate real-time checks cover
// what a sequential model cannot say (a lease is granted again only after
// its expiry on the database clock and after its holder's local deadline;
// every accepted token came from a grant that started first).
//
// An operation whose outcome is unknown (its connection was cut, its
// context ended mid-statement) has an open return: it may have taken effect
// at any time after its call, or never, and the models fork on it. The
// client that issued it goes on under a new client id, as etcd's robustness
// suite does. The package is for tests only.
package history

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// Kind is the kind of an operation.
type Kind string

// The operations recorded.
const (
	Acquire  Kind = "acquire"  // a grant of a lease (TryAcquire, Acquire, a handoff to a waiter)
	Renew    Kind = "renew"    // a renewal of a held lease
	Release  Kind = "release"  // a release of a held lease
	Inspect  Kind = "inspect"  // a read of a lock row (token, holder, expiry, database now)
	Enqueue  Kind = "enqueue"  // an outbox intent under a lease's token
	Write    Kind = "write"    // a fenced write of a row
	Read     Kind = "read"     // a fenced read of a row (raises its fence)
	Claim    Kind = "claim"    // a leased claim of a job
	Complete Kind = "complete" // completion of a claimed job
	Fail     Kind = "fail"     // a failed attempt of a claimed job (back to available)
	// Bump is an epoch bump after a failover (the HA tests' on_role_change
	// callback): the new primary raises the lock's token from Token (what
	// it had) by EpochSize, and every earlier lease is superseded.
	Bump Kind = "bump"
)

// EpochSize is what an epoch bump adds to a token.
const EpochSize = int64(1) << 32

// Outcome is what an operation returned.
type Outcome string

// The outcomes. Not every kind has every outcome.
const (
	OK        Outcome = "ok"        // granted, renewed, released, accepted, completed
	Busy      Outcome = "busy"      // acquire: someone else holds the lease
	Lost      Outcome = "lost"      // renew, release, complete, fail, enqueue: the lease or claim was not ours any more
	Stale     Outcome = "stale"     // write, read, enqueue: refused, a newer token wrote the row
	Applied   Outcome = "applied"   // write: refused, this token already wrote the row (strict)
	NotFound  Outcome = "notfound"  // write, read: no such row
	NotIssued Outcome = "notissued" // enqueue: the lock never issued the token
	Refused   Outcome = "refused"   // write: not applied, reason unknown (the row changed concurrently)
	Unknown   Outcome = "unknown"   // cut: may or may not have taken effect
)

// Input is what a client asked for. Key names the object: a lock name for
// lease operations, the row for fenced ones, the job id for claims.
type Input struct {
	Kind   Kind
	Key    string
	Lock   string        // write, read: the lock whose token guards the row
	Holder string        // lease operations: the holder name
	Token  int64         // renew, release, enqueue, write, read, complete, fail: the token used
	TTL    time.Duration // acquire, renew, claim
	Mode   string        // write: "strict" or "reentrant"
	Value  string        // write: the value written
	// KeepAlive (acquire): the lease is renewed in the background without
	// records; its expiry is unknown to the models.
	KeepAlive bool
	// Lossy (release): a server crash may undo the release (pglock commits
	// a plain release without waiting for the WAL flush: the lease is then
	// held until its expiry). Set by Recorder.Crashed for the releases near a crash.
	Lossy bool
	// Retry (release): an earlier Release of the same Lease had an unknown
	// outcome; pglock then answers done for a lease that attempt released
	// (Lease.Release).
	Retry bool `json:",omitempty"`
	// ReturnWall (acquire) is the op's own, copied in by the checker for
	// the lease model.
	ReturnWall int64 `json:"-"`
	// Budget (acquire, ghost) is the number of tokens of the lock that no
	// returned grant has, set by the checker.
	Budget int64 `json:"-"`
	// granted (acquire, ghost) holds the tokens of the lock that a returned
	// grant has, set by the checker: no unseen grant can have one of them.
	granted *tokenSet
	// handTo (release) are the waits the release may have handed the lease
	// to, set by the checker: see handTargets.
	handTo []handTarget
}

// handTarget is a wait a release may hand the lease to: its holder, and
// the earliest the handed lease can expire (the release's call + the wait's
// TTL, µs on the database clock).
type handTarget struct {
	Holder string
	Floor  int64
}

// tokenSet is a set of tokens of one lock.
type tokenSet struct{ m map[int64]bool }

// has reports whether t is in the set (false for a nil set).
func (s *tokenSet) has(t int64) bool { return s != nil && s.m[t] }

// Output is what the client saw. Times are microseconds since the Unix
// epoch on the database clock; 0 means not returned.
type Output struct {
	Outcome Outcome
	Token   int64  // acquire, claim: the token granted; inspect: the row's token
	Expires int64  // acquire, renew, claim: the new expiry; busy, inspect: the holder's expiry
	DBNow   int64  // the database's now() of the statement, when it returned one
	Holder  string // busy, inspect: the current holder ("" if none)
	Value   string // read: the value
	Fence   int64  // write, read refused: the row's fence
	// Deadline is the holder's local deadline after an acquire or renew
	// (nanoseconds on the recorder's clock, 0 if not known): the checks
	// require that nobody else is granted the lease before it.
	Deadline int64
}

// Op is one recorded operation.
type Op struct {
	Client int
	Input  Input
	Output Output
	Call   int64 // nanoseconds since the recorder started, monotonic
	Return int64 // math.MaxInt64 when the outcome is unknown
	// CallWall and ReturnWall are the same instants on the wall clock, in
	// µs since the Unix epoch (the database's clock on this machine: every
	// now() of a statement the operation sent lies between them);
	// ReturnWall is math.MaxInt64 when the outcome is unknown, 0 when not
	// recorded.
	CallWall, ReturnWall int64
	// ErrAt and ErrAtWall are when the client got the error of an
	// operation with an unknown outcome (0 if it never returned).
	ErrAt, ErrAtWall int64
}

// Recorder collects operations from concurrent clients. The zero value is
// not usable; call New.
type Recorder struct {
	mu      sync.Mutex
	start   time.Time
	offset  int64 // ns from the clock's origin to start (a journal's parent recorder)
	ops     []Op
	clients int
	journal *journal // nil unless the recorder writes to a journal file
	crashes []int64  // Crashed: when the server crashed, on the recorder's clock
	bounded bool     // BoundCutAcquires
}

// BoundCutAcquires tells the checks that no request of this history is
// delayed in the network (backends are killed, processes paused, servers
// crashed; no proxy holds packets back): a cut acquire can then only take
// effect until the TTL plus one second after its error (its queue row may be
// handed a lease until its alive_until, its last attempt's now() plus the
// TTL; a statement the caller gave up on is cancelled, or its backend was
// terminated), and its return is bounded there instead of open. A request
// that a partition delivers later could take effect any time: do not use it
// with network faults.
func (r *Recorder) BoundCutAcquires() {
	r.mu.Lock()
	r.bounded = true
	r.mu.Unlock()
}

// LossWindow is how long before a server crash a plain release that
// returned ok may still be undone by it. A plain release does not wait for
// the WAL flush; the WAL writer flushes it within three wal_writer_delay
// (600 ms by default), and any later synchronous commit (a grant) flushes it
// at once. The window leaves room for a loaded machine.
const LossWindow = 5 * time.Second

// Crashed tells the checks that the server crashed now: a release called
// before now that returned within LossWindow of it may be undone by the
// crash, so its lease may still be held until its expiry. Grants are durable
// and are not relaxed. Call it when the crash is sent (the server dies
// after).
func (r *Recorder) Crashed() {
	now := r.Now()
	r.mu.Lock()
	r.crashes = append(r.crashes, now)
	r.mu.Unlock()
}

// New returns an empty recorder whose clock starts now.
func New() *Recorder { return &Recorder{start: time.Now()} }

// Client returns a new client id. A client whose operation ended with an
// unknown outcome must take a new id before its next operation.
func (r *Recorder) Client() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clients++
	return r.clients - 1
}

// Now is the recorder's clock: nanoseconds since New (for a journal,
// since its parent's New), monotonic within the process.
func (r *Recorder) Now() int64 { return r.offset + int64(time.Since(r.start)) }

// Pending is an operation that has been called and not returned yet.
type Pending struct {
	r      *Recorder
	client int
	in     Input
	call   int64
	seq    int64 // journal sequence number
	wall   int64 // CallWall
}

// Begin records the call of an operation by client.
func (r *Recorder) Begin(client int, in Input) *Pending {
	p := &Pending{r: r, client: client, in: in, call: r.Now(), wall: time.Now().UnixMicro()}
	if r.journal != nil {
		p.seq = r.journal.begin(p)
	}
	return p
}

// End records the return of p with out. An Unknown outcome gets an open
// return (and the time the client got its error, for BoundCutAcquires).
func (p *Pending) End(out Output) {
	ret, wall := p.r.Now(), time.Now().UnixMicro()
	var errAt, errAtWall int64
	if out.Outcome == Unknown {
		errAt, errAtWall = ret, wall
		ret, wall = math.MaxInt64, math.MaxInt64
	}
	if ret <= p.call {
		ret = p.call + 1
	}
	op := Op{Client: p.client, Input: p.in, Output: out, Call: p.call, Return: ret, CallWall: p.wall, ReturnWall: wall, ErrAt: errAt, ErrAtWall: errAtWall}
	if p.r.journal != nil {
		p.r.journal.end(p.seq, op)
	}
	p.r.mu.Lock()
	p.r.ops = append(p.r.ops, op)
	p.r.mu.Unlock()
}

// Call is when p was called, on the recorder's clock.
func (p *Pending) Call() int64 { return p.call }

// Ops returns a copy of the operations recorded so far, in return order.
func (r *Recorder) Ops() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	ops := append([]Op(nil), r.ops...)
	for i := range ops {
		o := &ops[i]
		if o.Input.Kind == Release && r.lostInCrash(*o) {
			o.Input.Lossy = true
		}
		if r.bounded && o.Input.Kind == Acquire && o.Output.Outcome == Unknown && o.ErrAt != 0 {
			within := o.Input.TTL + time.Second
			o.Return, o.ReturnWall = o.ErrAt+int64(within), o.ErrAtWall+within.Microseconds()
		}
	}
	return ops
}

// lostInCrash reports whether release o may have been undone by one of the
// crashes: called before it, returned no earlier than LossWindow before, and
// not flushed by a later synchronous commit before it. A grant or renewal
// commits with synchronous_commit on: it returns only once the WAL is flushed
// up to its commit record. One that was called after o returned has its
// commit record after o's, so if it returned ok before the crash was sent,
// o's commit was on disk too and the crash cannot undo it.
func (r *Recorder) lostInCrash(o Op) bool {
	for _, c := range r.crashes {
		if o.Call < c+int64(time.Second) && o.Return >= c-int64(LossWindow) && !r.flushedBefore(o, c) {
			return true
		}
	}
	return false
}

// flushedBefore reports whether some grant or renewal in the history that
// returned ok before crash c was called after o returned (see lostInCrash).
func (r *Recorder) flushedBefore(o Op, c int64) bool {
	if o.Return == math.MaxInt64 {
		return false // never returned: nothing orders a later commit after it
	}
	for _, w := range r.ops {
		if (w.Input.Kind == Acquire || w.Input.Kind == Renew) && w.Output.Outcome == OK &&
			w.Call > o.Return && w.Return < c {
			return true
		}
	}
	return false
}

// Add appends operations recorded elsewhere (another recorder's clock must
// be this one's; tests use it to build histories by hand).
func (r *Recorder) Add(ops ...Op) {
	if r.journal != nil {
		for _, o := range ops {
			r.journal.whole(o)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, ops...)
}

// At converts a wall-clock time (a database timestamp on this machine) to
// the recorder's clock.
func (r *Recorder) At(t time.Time) int64 { return t.UnixNano() - (r.start.UnixNano() - r.offset) }

// Micros converts a database time to the microseconds Output uses (0 for
// the zero time).
func Micros(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMicro()
}

func (o Op) String() string {
	ret := "?"
	if o.Return != math.MaxInt64 {
		ret = fmt.Sprint(o.Return)
	}
	return fmt.Sprintf("client %d [%d, %s] %s", o.Client, o.Call, ret, describe(o.Input, o.Output))
}

func describe(in Input, out Output) string {
	s := fmt.Sprintf("%s(%s", in.Kind, in.Key)
	if in.Holder != "" {
		s += " holder=" + in.Holder
	}
	if in.Token != 0 {
		s += fmt.Sprintf(" token=%d", in.Token)
	}
	if in.Mode != "" {
		s += " " + in.Mode
	}
	if in.Value != "" {
		s += " value=" + in.Value
	}
	s += ") -> " + string(out.Outcome)
	if out.Token != 0 {
		s += fmt.Sprintf(" token=%d", out.Token)
	}
	if out.Holder != "" {
		s += " holder=" + out.Holder
	}
	if out.Expires != 0 {
		s += fmt.Sprintf(" expires=%d", out.Expires)
	}
	if out.DBNow != 0 {
		s += fmt.Sprintf(" now=%d", out.DBNow)
	}
	if out.Value != "" {
		s += " value=" + out.Value
	}
	if out.Fence != 0 {
		s += fmt.Sprintf(" fence=%d", out.Fence)
	}
	return s
}

func toPorcupine(ops []Op) []porcupine.Operation {
	out := make([]porcupine.Operation, len(ops))
	for i, o := range ops {
		out[i] = porcupine.Operation{ClientId: o.Client, Input: o.Input, Call: o.Call, Output: o.Output, Return: o.Return}
	}
	return out
}

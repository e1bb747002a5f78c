package pgerr

import "errors"

// The kinds of pgfence error. Package pgfence exports each under the same
// name (pgfence.ErrInvalid is ErrInvalid) and documents it; they are
// declared here so that the table of SQLSTATEs below can name them.
var (
	ErrInvalid        = errors.New("invalid argument")
	ErrLocked         = errors.New("held by another holder")
	ErrLost           = errors.New("not held any more")
	ErrReleased       = errors.New("released")
	ErrClosed         = errors.New("closed")
	ErrStaleToken     = errors.New("stale token: a newer grant came first")
	ErrAlreadyApplied = errors.New("already applied by this token")
	ErrNotFound       = errors.New("not found")
	ErrTokenExhausted = errors.New("tokens exhausted")
	ErrSlowGrant      = errors.New("grant arrived after its lease ended")
	ErrGuard          = errors.New("refused by the fence guard")
	ErrNoSchema       = errors.New(SchemaHint)
)

// Kinds lists every kind above, in the order package pgfence documents them.
var Kinds = []error{ErrInvalid, ErrLocked, ErrLost, ErrReleased, ErrClosed, ErrStaleToken,
	ErrAlreadyApplied, ErrNotFound, ErrTokenExhausted, ErrSlowGrant, ErrGuard, ErrNoSchema}

// SQLSTATEs of pgfence's own refusals (class PF). PFCodes says what each
// means and which kind of error every package returns for it.
const (
	FenceNotRaised   = "PF001" // the guard: the change did not raise the fence
	TokenNotIssued   = "PF002" // a token the lock never issued, or no such lock
	StaleToken       = "PF003" // a newer grant exists, or wrote the row
	AlreadyApplied   = "PF004" // strict mode: this grant already wrote the row
	NotFound         = "PF005" // no row with that key
	ConcurrentChange = "PF006" // the row changed concurrently; nothing written
	InvalidToken     = "PF007" // a token NULL or not above 0
	TokenSuperseded  = "PF008" // the guard: a newer grant of the row's lock exists
	BadArgument      = "PF011" // a function of the door refused an argument
	LeaseNotHeld     = "PF012" // the lease is not held with this key
	WaitKeyTaken     = "PF013" // lock_wait: the wkey is queued under another key
	EpochGateClosed  = "PFHA1" // a promoted server's epoch bump has not run yet
)

// PFCode is one SQLSTATE of class PF: what it means, who raises it, and
// what every pgfence package makes of it.
type PFCode struct {
	Code string
	// Kind is the kind of the *pgfence.Error returned for it; nil for a
	// refusal with no kind of its own (Retryable says what to do).
	Kind error
	// Retryable: sending the same call again may succeed (the refusal was
	// a passing state, not the call's fault).
	Retryable bool
	// Retired: no function of the current schema raises it (an older
	// schema did); kept so the code is never reused.
	Retired  bool
	Meaning  string
	RaisedBy string
}

// PFCodes is the one table of pgfence's SQLSTATEs: the schema raises no
// other PF code (a test checks the migrated schema against it), docs/sql.md
// lists the same rows (a test checks that too), and every package
// translates a PF code through [Classify].
var PFCodes = []PFCode{
	{Code: FenceNotRaised, Kind: ErrGuard, Meaning: "the guard: the change does not raise the row's fence, or carries no token", RaisedBy: "the guard's triggers"},
	{Code: TokenNotIssued, Kind: ErrInvalid, Meaning: "the token was never issued by the lock (forged or mistyped), or no such lock", RaisedBy: "outbox_enqueue, the guard"},
	{Code: StaleToken, Kind: ErrStaleToken, Meaning: "stale token: a newer grant exists, or wrote the row", RaisedBy: "outbox_enqueue, fence_refused"},
	{Code: AlreadyApplied, Kind: ErrAlreadyApplied, Meaning: "already applied: this grant wrote the row (strict mode)", RaisedBy: "fence_refused"},
	{Code: NotFound, Kind: ErrNotFound, Meaning: "no row with that key", RaisedBy: "fence_refused"},
	{Code: ConcurrentChange, Retryable: true, Meaning: "the row changed concurrently; the write was not applied: send it again", RaisedBy: "fence_refused"},
	{Code: InvalidToken, Kind: ErrInvalid, Meaning: "invalid token (NULL or not above 0)", RaisedBy: "use_token, fence_refused, outbox_enqueue"},
	{Code: TokenSuperseded, Kind: ErrStaleToken, Meaning: "the guard: the token is not the latest grant of the row's lock", RaisedBy: "the guard's triggers"},
	{Code: "PF009", Retired: true, Meaning: "retired before the first release (a forged lease change)"},
	{Code: "PF010", Retired: true, Meaning: "retired before the first release (a forged lease change)"},
	{Code: BadArgument, Kind: ErrInvalid, Meaning: "bad argument; the message names it and the rule", RaisedBy: "the lease, job, fenced value and outbox functions, fence_refused"},
	{Code: LeaseNotHeld, Kind: ErrLost, Meaning: "the lease is not held with this key (released, expired, another key)", RaisedBy: "outbox_enqueue"},
	{Code: WaitKeyTaken, Kind: ErrInvalid, Meaning: "the wait's `wkey` is queued under another key: wait with a new random `wkey`", RaisedBy: "lock_wait"},
	{Code: EpochGateClosed, Retryable: true, Meaning: "a promoted server's epoch bump has not run yet: no grant or claim", RaisedBy: "grants and claims, once ha_enable ran"},
}

// LookupPF returns the row of PFCodes for code.
func LookupPF(code string) (PFCode, bool) {
	for _, c := range PFCodes {
		if c.Code == code {
			return c, true
		}
	}
	return PFCode{}, false
}

// Classify returns the row of PFCodes for the SQLSTATE of err's
// *pgconn.PgError; ok is false when err has none or its code is not
// pgfence's.
func Classify(err error) (c PFCode, ok bool) {
	code := Code(err)
	if len(code) != 5 || code[:2] != "PF" {
		return PFCode{}, false
	}
	return LookupPF(code)
}

// ErrConcurrentChange is the cause (Err) of a fenced write refused because
// its row changed concurrently when no server error carries it: retryable.
var ErrConcurrentChange = errors.New("the row changed concurrently")

package history

import (
	"fmt"
	"math"
	"time"

	"github.com/anishathalye/porcupine"
)

// unknownExpiry marks an expiry the history does not know (a grant or
// renewal whose outcome is unknown): the models then accept any later
// grant time and any expiry a reader reports for the lease.
const unknownExpiry = math.MaxInt64

// leaseState is one lock row as the model sees it.
type leaseState struct {
	Token   int64  // the latest grant's token; 0 = never granted
	Holder  string // "" = released (or never granted)
	Expires int64  // µs on the database clock; unknownExpiry = not known
	Unseen  int64  // unseen grants so far (see ghost)
	Ghost   bool   // the current grant is an unseen one (see giveBack)
	// Floor (held until an unknown expiry) is the earliest the expiry can
	// be: a lease a release handed over expires no earlier than the
	// release's call + the waiter's TTL.
	Floor int64
}

// exact reports whether s's expiry is known.
func (s leaseState) exact() bool { return s.Expires != unknownExpiry }

func (s leaseState) held(holder string, token int64) bool {
	return s.Holder != "" && s.Holder == holder && s.Token == token
}

// grantTime is the database time of a grant: the SQL sets the expiry to
// now() + ttl exactly (microseconds).
func grantTime(out Output, ttl int64) int64 { return out.Expires - ttl }

// ghost is the kind of the companions the checker adds to every acquire:
// the grants a call's own statements may have taken without returning them.
// pglock takes a lease and gives it back inside one call when the answer
// came too late to use or when the wait ended as a release handed it over;
// a cut call's statement may have granted. Such a grant was never used (a
// write with its token fails the "granted" check), but it takes a token. A
// companion lets up to maxGhosts of them happen during its call, while the
// lease was free and no later than the call's return, held by the call's
// holder until an unknown expiry or given back. A call whose outcome is
// unknown forks the same way itself. A lease a release handed to a wait
// that never read it (paused past its expiry, its notification lost, its
// call cut) is the release's fork: see handed.
const ghost Kind = "ghost"

// giveBack is the kind of a second companion of every acquire: an unseen
// grant of the call's holder may be given back later in the same call, after
// a reader saw it held (the release of a grant whose answer came too late
// runs after the grant returned to pglock). It releases the current grant if
// it is an unseen one of the call's holder.
const giveBack Kind = "giveback"

// maxGhosts bounds the unseen grants one call may have had at once.
const maxGhosts = 3

// ghosts are the states after up to maxGhosts unseen grants to holder by a
// call that returned at returnWall (µs on the database clock of this
// machine; unknownExpiry if it never returned).
//
// Every unseen grant takes a token that no returned grant has: granted holds
// the tokens returned grants have (a grant of one of them would leave its
// returned grant no legal place, tokens only rise), and budget, the number
// of other tokens up to the highest token any output named, bounds them over
// the whole history (an unseen grant above it conflicts with nothing
// observed).
func ghosts(s leaseState, holder string, returnWall, budget int64, granted *tokenSet) []any {
	out := []any{s}
	cur := s
	for range maxGhosts {
		if cur.Unseen >= budget || granted.has(cur.Token+1) {
			return out
		}
		if cur.Holder != "" && (cur.Expires != unknownExpiry && cur.Expires > returnWall || cur.Expires == unknownExpiry && cur.Floor > returnWall) {
			return out // held past the call's return: no grant inside it
		}
		// Held by the call's holder until an unknown expiry, or given back.
		next := leaseState{Token: cur.Token + 1, Holder: holder, Expires: unknownExpiry, Unseen: cur.Unseen + 1, Ghost: true}
		out = append(out, next, leaseState{Token: cur.Token + 1, Unseen: cur.Unseen + 1})
		cur = next
	}
	return out
}

// handed adds to out the states after release in of s handed the lease
// over, unseen, to one of the waits in.handTo: the next token, held by its
// holder until an unknown expiry no earlier than the release's call + the
// wait's TTL (the release's now() is after its call). The waiter may return that
// grant (then it is an acquire's), or never read it (paused past its
// expiry, cut): such a grant takes a token no returned grant has, within
// the budget.
func handed(s leaseState, in Input, out []any) []any {
	if len(in.handTo) == 0 || s.Unseen >= in.Budget || in.granted.has(s.Token+1) {
		return out
	}
	for _, t := range in.handTo {
		out = append(out, leaseState{Token: s.Token + 1, Holder: t.Holder, Expires: unknownExpiry,
			Unseen: s.Unseen + 1, Ghost: true, Floor: t.Floor})
	}
	return out
}

// leaseStep: a grant is legal only with the next token (exactly one more
// than the last grant) and only when the lease is released or its expiry
// has passed at the grant's own database time (not assumed to rise with
// the linearization: a statement that waited on the row lock carries an
// earlier start). Renew, release and an outbox enqueue are legal only for
// the current grant; an enqueue refused because the lease is not held
// (released or expired) names the current grant too (the token is checked
// first); a busy answer or a read must name the current holder and expiry.
func leaseStep(st any, input any, output any) []any {
	s := st.(leaseState)
	in, out := input.(Input), output.(Output)
	switch in.Kind {
	case Acquire:
		next := leaseState{Token: s.Token + 1, Holder: in.Holder, Unseen: s.Unseen}
		switch out.Outcome {
		case OK:
			if out.Token != s.Token+1 {
				return nil
			}
			if s.Holder != "" && s.Expires != unknownExpiry && grantTime(out, in.TTL.Microseconds()) < s.Expires {
				return nil
			}
			if s.Holder != "" && s.Expires == unknownExpiry && grantTime(out, in.TTL.Microseconds()) < s.Floor {
				return nil // before a handed lease's earliest expiry
			}
			next.Expires = out.Expires
			if in.KeepAlive {
				next.Expires = unknownExpiry
			}
			return []any{next}
		case Busy:
			if out.Holder == "" {
				return []any{s} // refused without saying by whom: no information
			}
			if s.Holder == "" || out.Holder != s.Holder || (out.Token != 0 && out.Token != s.Token) {
				return nil
			}
			if out.DBNow != 0 && s.exact() && out.DBNow >= s.Expires {
				return nil // refused after the holder's expiry
			}
			if out.Expires != 0 && s.exact() && out.Expires != s.Expires {
				return nil
			}
			return []any{s}
		case Unknown:
			// Not applied, granted (expiry unknown), or granted and given
			// back inside the call (a grant too slow to use, a handoff to a
			// wait that ended): see ghosts.
			// Not applied, or granted (perhaps more than once) and
			// perhaps given back: see ghost. The grant this call asked
			// for is one of them.
			return ghosts(s, in.Holder, in.ReturnWall, in.Budget, in.granted)
		}
	case ghost:
		return ghosts(s, in.Holder, in.ReturnWall, in.Budget, in.granted)
	case giveBack:
		if s.Ghost && s.Holder == in.Holder {
			return []any{s, leaseState{Token: s.Token, Unseen: s.Unseen}}
		}
		return []any{s}
	case Renew:
		switch out.Outcome {
		case OK:
			if !s.held(in.Holder, in.Token) {
				return nil
			}
			s.Expires = out.Expires
			return []any{s}
		case Lost:
			// The lease may have expired: the model does not know the
			// renewal's database time.
			return []any{s}
		case Unknown:
			if !s.held(in.Holder, in.Token) {
				return []any{s}
			}
			r := s
			r.Expires = unknownExpiry
			return []any{s, r}
		}
	case Release:
		switch out.Outcome {
		case OK:
			if in.Retry && s.Holder == "" && s.Token == in.Token && in.Token > 0 {
				// Released with this token already, nobody granted since:
				// a Release called again after one whose outcome was
				// unknown reports the earlier attempt's release.
				return []any{s}
			}
			if !s.held(in.Holder, in.Token) {
				return nil
			}
			if in.Lossy {
				return handed(s, in, []any{leaseState{Token: s.Token, Unseen: s.Unseen}, s})
			}
			return handed(s, in, []any{leaseState{Token: s.Token, Unseen: s.Unseen}})
		case Lost:
			return []any{s}
		case Unknown:
			if !s.held(in.Holder, in.Token) {
				return []any{s}
			}
			return handed(s, in, []any{s, leaseState{Token: s.Token, Unseen: s.Unseen}})
		}
	case Bump:
		// The new primary may have lost acknowledged grants (asynchronous
		// replication): it bumps from what it had, and the bump is above
		// every token granted before.
		if in.Token > s.Token || in.Token+EpochSize <= s.Token {
			return nil
		}
		return []any{leaseState{Token: in.Token + EpochSize, Unseen: s.Unseen}}
	case Inspect:
		if out.Outcome != OK || out.Token != s.Token || out.Holder != s.Holder {
			return nil
		}
		if s.Holder != "" && s.exact() && out.Expires != s.Expires {
			return nil
		}
		return []any{s}
	case Enqueue:
		switch out.Outcome {
		case OK:
			if in.Token != s.Token {
				return nil
			}
		case Stale:
			if in.Token >= s.Token {
				return nil
			}
		case NotIssued:
			if in.Token <= s.Token {
				return nil
			}
		case Lost:
			// The model does not know the enqueue's database time: the
			// lease may have expired.
			if in.Token != s.Token {
				return nil
			}
		case Unknown:
		default:
			return nil
		}
		return []any{s}
	}
	return nil
}

// rowState is one fenced row.
type rowState struct {
	Fence int64
	Value string
}

// rowStep: a strict write is accepted only with a token above the fence, a
// re-entrant one (and a fenced read) with a token at least the fence; a
// refusal is legal only when the token is lower (or equal, strict: already
// applied); a read returns the last accepted value.
func rowStep(st any, input any, output any) []any {
	s := st.(rowState)
	in, out := input.(Input), output.(Output)
	if in.Kind != Write && in.Kind != Read {
		return nil
	}
	accept := in.Token > s.Fence || (in.Token == s.Fence && (in.Mode == "reentrant" || in.Kind == Read))
	// What an accepted write or read leaves: the written value, or the same
	// value under the read's fence.
	after := rowState{Fence: in.Token, Value: in.Value}
	if in.Kind == Read {
		after.Value = s.Value
	}
	switch out.Outcome {
	case OK:
		if !accept || (in.Kind == Read && out.Value != s.Value) {
			return nil
		}
		return []any{after}
	case Stale:
		if in.Token >= s.Fence || (in.Kind == Write && out.Fence != 0 && out.Fence != s.Fence) {
			return nil
		}
		return []any{s}
	case Applied:
		if in.Kind != Write || in.Mode != "strict" || in.Token != s.Fence {
			return nil
		}
		return []any{s}
	case NotFound:
		if s.Fence != 0 {
			return nil
		}
		return []any{s}
	case Refused:
		if in.Kind != Write {
			return nil
		}
		return []any{s}
	case Unknown:
		if !accept {
			return []any{s}
		}
		return []any{s, after}
	}
	return nil
}

// jobState is one job's claim.
type jobState struct {
	State   string // "available", "running", "completed"; "" = available (initial)
	Token   int64
	Expires int64
}

// jobStep: a claim is legal only for an available job or a running one
// whose claim expired at the claim's database time, with a new token;
// completion and failure only under the current claim (the SQL checks the
// token and the state, not the expiry: a completion under the current
// claim must succeed).
func jobStep(st any, input any, output any) []any {
	s := st.(jobState)
	in, out := input.(Input), output.(Output)
	running := s.State == "running"
	current := running && in.Token == s.Token
	switch in.Kind {
	case Claim:
		next := jobState{State: "running", Token: out.Token, Expires: out.Expires}
		switch out.Outcome {
		case OK:
			if out.Token/EpochSize > max(s.Token, 0)/EpochSize && s.State != "" {
				// A claim in a later epoch: the failover to an
				// asynchronous standby that bumped the claim tokens may
				// have lost the job's latest changes (a completion the
				// old primary acknowledged), so any earlier state may be
				// gone. Without a bump no token crosses an epoch.
				return []any{next}
			}
			if s.State == "completed" || out.Token <= s.Token {
				return nil
			}
			// The claim SQL takes its TTL in whole milliseconds.
			if running && s.Expires != unknownExpiry && grantTime(out, in.TTL.Truncate(time.Millisecond).Microseconds()) < s.Expires {
				return nil
			}
			return []any{next}
		case Unknown:
			// A cut claim may have taken any job of its queue: the client
			// records one for each, with a token nobody knows.
			if s.State == "completed" {
				return []any{s}
			}
			return []any{s, jobState{State: "running", Token: -1, Expires: unknownExpiry}}
		}
	case Complete, Fail:
		after := jobState{State: "completed", Token: s.Token}
		if in.Kind == Fail {
			after = jobState{State: "available", Token: s.Token}
		}
		switch out.Outcome {
		case OK:
			if !current {
				return nil
			}
			return []any{after}
		case Lost:
			if current {
				return nil
			}
			return []any{s}
		case Unknown:
			if !current {
				return []any{s}
			}
			return []any{s, after}
		}
	}
	return nil
}

func describeOp(input, output any) string { return describe(input.(Input), output.(Output)) }

// Models are the three models by name: "lease" (partitioned by lock name),
// "row" (by fenced row) and "job" (by job).
var models = map[string]struct {
	kinds map[Kind]bool
	model porcupine.NondeterministicModel
}{
	"lease": {map[Kind]bool{Acquire: true, ghost: true, giveBack: true, Bump: true, Renew: true, Release: true, Inspect: true, Enqueue: true},
		porcupine.NondeterministicModel{
			Init:              func() []any { return []any{leaseState{}} },
			Step:              leaseStep,
			DescribeOperation: describeOp,
			DescribeState: func(st any) string {
				s := st.(leaseState)
				if s.Holder == "" {
					return fmt.Sprintf("token %d, released (%d unseen grants)", s.Token, s.Unseen)
				}
				exp := fmt.Sprint(s.Expires)
				if s.Expires == unknownExpiry {
					exp = "unknown"
				}
				return fmt.Sprintf("token %d held by %s until %s (%d unseen grants)", s.Token, s.Holder, exp, s.Unseen)
			},
		}},
	"row": {map[Kind]bool{Write: true, Read: true},
		porcupine.NondeterministicModel{
			Init:              func() []any { return []any{rowState{}} },
			Step:              rowStep,
			DescribeOperation: describeOp,
			DescribeState: func(st any) string {
				s := st.(rowState)
				return fmt.Sprintf("fence %d value %q", s.Fence, s.Value)
			},
		}},
	"job": {map[Kind]bool{Claim: true, Complete: true, Fail: true},
		porcupine.NondeterministicModel{
			Init:              func() []any { return []any{jobState{}} },
			Step:              jobStep,
			DescribeOperation: describeOp,
			DescribeState: func(st any) string {
				s := st.(jobState)
				return fmt.Sprintf("%s claim %d until %d", s.State, s.Token, s.Expires)
			},
		}},
}

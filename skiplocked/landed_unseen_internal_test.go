package skiplocked

import (
	"context"
	"io"
	"testing"
	"time"
)

// unsentError is a connection error that pgconn.SafeToRetry calls safe: the
// statement was never written.
type unsentError struct{}

func (unsentError) Error() string     { return "connection failed before the statement was sent" }
func (unsentError) SafeToRetry() bool { return true }

// retryConnUnsure says an earlier attempt may have taken effect only when
// one failed after its statement was written.
func TestRetryConnUnsure(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		errs   []error // the attempts' errors, the last one nil
		unsure bool
	}{
		{"first attempt answered", []error{nil}, false},
		{"reply lost", []error{io.ErrUnexpectedEOF, nil}, true},
		{"never sent", []error{unsentError{}, nil}, false},
		{"never sent, then reply lost", []error{unsentError{}, io.ErrUnexpectedEOF, nil}, true},
	} {
		i := 0
		unsure, err := retryConnUnsure(context.Background(), func() error { i++; return c.errs[i-1] })
		if err != nil || i != len(c.errs) || unsure != c.unsure {
			t.Errorf("%s: %d attempts, unsure %v, err %v; want %d attempts, unsure %v, nil", c.name, i, unsure, err, len(c.errs), c.unsure)
		}
	}
}

// landedUnseen concludes that an earlier attempt of a retried outcome wrote
// it only when that attempt may have taken effect, the claim's local
// deadline has not passed, and the row shows an end the outcome allows: the
// job deleted, or (after a release or a failure, never after a completion)
// claimed again under another token. The rest stays a lost claim.
func TestLandedUnseen(t *testing.T) {
	t.Parallel()
	w := &Worker{}
	now := time.Now()
	ref := ClaimRef{JobID: 7, Token: 3}
	live := &held{ref: ref, deadline: now.Add(time.Second)}
	expired := &held{ref: ref, deadline: now}
	reclaimed := &claimInfo{JobID: 7, Token: 3, CurrentToken: 4, State: StateRunning}
	sameToken := &claimInfo{JobID: 7, Token: 3, CurrentToken: 3, State: StateAvailable, Outcome: outcomeReleased}
	for _, c := range []struct {
		name   string
		op     string
		h      *held
		e      *claimInfo
		unsure bool
		want   bool
	}{
		{"release, claimed again", opRelease, live, reclaimed, true, true},
		{"fail, claimed again", opFail, live, reclaimed, true, true},
		{"release, job purged", opRelease, live, nil, true, true},
		{"fail, job purged", opFail, live, nil, true, true},
		{"complete, job purged", opComplete, live, nil, true, true},
		{"complete, claimed again: a completion never lets the job be claimed", opComplete, live, reclaimed, true, false},
		{"release, no attempt may have taken effect", opRelease, live, reclaimed, false, false},
		{"release, local deadline reached", opRelease, expired, reclaimed, true, false},
		{"complete, job purged, local deadline reached", opComplete, expired, nil, true, false},
		{"complete, same claim ended by a release", opComplete, live, sameToken, true, false},
		{"no deadline known", opRelease, &held{ref: ref}, reclaimed, true, false},
	} {
		if got := w.landedUnseen(c.op, c.h, c.e, c.unsure, now); got != c.want {
			t.Errorf("%s: landedUnseen = %v, want %v", c.name, got, c.want)
		}
	}
}

package skiplocked

import (
	"errors"
	"strings"
	"testing"

	"github.com/pgfence/pgfence"
)

// Every lost claim is a *pgfence.Error of kind ErrLost that names the job,
// and says what became of the claim; a missing job also matches
// ErrNotFound.
func TestLostErrorReasons(t *testing.T) {
	t.Parallel()
	ref := ClaimRef{JobID: 1, Token: 2}
	for _, c := range []struct {
		info   *claimInfo
		reason string
	}{
		{&claimInfo{JobID: 1, Token: 2, CurrentToken: 3, Holder: "B", State: StateRunning}, "job 1: reclaimed by token 3, state running"},
		{&claimInfo{JobID: 1, Token: 2, CurrentToken: 2, State: StateCompleted, Outcome: outcomeCompleted}, "job 1: claim already ended (completed)"},
		{&claimInfo{JobID: 1, Token: 2, CurrentToken: 2, State: StateRunning, wrongKey: true}, "job 1: claim not made with this claim key"},
		{&claimInfo{JobID: 1, Token: 2, CurrentToken: 1, State: StateAvailable}, "job 1: not held under this token (current 1), state available"},
		{&claimInfo{JobID: 1, Token: 2}, "job 1: claim lost; the job could not be read back"},
		{nil, "job 1: no such job"},
	} {
		e := lostError(opComplete, "", ref, c.info)
		if !errors.Is(e, pgfence.ErrLost) || e.Token != 2 || !strings.HasPrefix(e.Reason, c.reason) ||
			!strings.HasPrefix(e.Error(), "skiplocked.Complete: not held any more") {
			t.Errorf("%+v: %v (reason %q), want ErrLost with reason %q", c.info, e, e.Reason, c.reason)
		}
		if c.info != nil && e.Holder != c.info.Holder {
			t.Errorf("%+v: holder %q", c.info, e.Holder)
		}
		if (c.info == nil) != errors.Is(e, pgfence.ErrNotFound) {
			t.Errorf("%+v: errors.Is(ErrNotFound) = %v", c.info, errors.Is(e, pgfence.ErrNotFound))
		}
	}
}

package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/metricdefs"
	"github.com/pgfence/pgfence/internal/permanent"
)

// readClaim reads a job's claim columns for ref, retrying connection errors
// for up to ClaimTTL; nil when it cannot (or the job no longer exists).
func (w *Worker) readClaim(ref ClaimRef) *claimInfo {
	ctx, cancel := context.WithTimeout(w.bg, w.cfg.ClaimTTL)
	defer cancel()
	var st *claimInfo
	err := retryConn(ctx, func() (err error) {
		st, err = claimState(ctx, w.pool, opWorker, ref)
		return err
	})
	if err != nil {
		return nil
	}
	return st
}

func orBare(e *claimInfo, ref ClaimRef) *claimInfo {
	if e != nil {
		return e
	}
	return &claimInfo{JobID: ref.JobID, Token: ref.Token}
}

// complete writes outcomes, batching completions. Several run at once (see
// pipelines). A completion is never held back to fill a batch: each writer
// takes every result waiting when it is free and writes them at once, so a
// handler's completion waits at most for the outcome statements already in
// flight, and batches grow only while the database is busy.
func (w *Worker) complete(ctx context.Context, results <-chan result, wake chan<- struct{}, drain bool) {
	const maxBatch = 1000
	m := metricdefs.OrNop(w.cfg.Metrics)
	for first := range results {
		batch := []result{first}
	drain:
		for len(batch) < maxBatch {
			select {
			case r, ok := <-results:
				if !ok {
					break drain
				}
				batch = append(batch, r)
			default:
				break drain
			}
		}
		var done, release, lost []result
		for _, r := range batch {
			switch r.outcome {
			case outComplete:
				done = append(done, r)
			case outCompleted:
				w.stats.completed.Add(1)
				m.Add(ctx, metricdefs.RowsCompletedTotal, 1, w.queue)
			case outRelease:
				release = append(release, r)
			case outFail:
				w.fail(ctx, r)
			case outLost:
				lost = append(lost, r) // after the batch's writes: OnClaimLost may be slow
			case outUnknown:
				w.stats.unknown.Add(1)
			}
		}
		if len(done) > 0 {
			w.finish(ctx, opComplete, done, completeRefs)
		}
		if len(release) > 0 {
			w.finish(ctx, opRelease, release, releaseRefs)
		}
		for _, r := range lost {
			w.reportLost(ctx, r.h, r.lost, "skiplocked: claim lost; outcome not written")
		}
		w.mu.Lock()
		for _, r := range batch {
			delete(w.inflight, r.h.ref)
		}
		idle := len(w.inflight) == 0
		hook := w.outcomesHook
		w.mu.Unlock()
		if hook != nil {
			hook()
		}
		if drain && idle {
			poke(wake) // the fetcher checks whether the queue is drained
		}
	}
}

// backoff is Config.Backoff for job's attempt, within 0..maxRetryDelay. It
// runs on an outcome writer: a panic in it, or a runtime.Goexit, is logged
// and DefaultBackoff used instead (see callUser), as a panicking or exiting
// OnClaimLost is logged and skipped, so that the failure is still recorded
// and the Worker goes on.
func (w *Worker) backoff(job Job) time.Duration {
	var d time.Duration
	if ok, p := callUser(func() { d = w.cfg.Backoff(job.Attempts) }); !ok {
		w.logUserEnd("Backoff", "; DefaultBackoff used", p, "job", job.ID, "attempt", job.Attempts)
		d = DefaultBackoff(job.Attempts)
	}
	return min(max(d, 0), maxRetryDelay)
}

// reportLost counts, logs and hands to OnClaimLost one lost claim.
func (w *Worker) reportLost(ctx context.Context, h *held, e *claimInfo, msg string) {
	e = orBare(e, h.ref)
	w.stats.lost.Add(1)
	metricdefs.OrNop(w.cfg.Metrics).Add(ctx, metricdefs.ClaimsLostTotal, 1, w.queue)
	w.cfg.Logger.Warn(msg, "job", e.JobID, "token", e.Token, "current_token", e.CurrentToken,
		"state", string(e.State), "holder", e.Holder)
	if w.cfg.OnClaimLost == nil {
		return
	}
	w.lostMu.Lock() // outcomes are written by several goroutines; the hook runs one call at a time
	defer w.lostMu.Unlock()
	hctx := w.hookCtx // ends ShutdownTimeout after Run's context: a hook blocked on it does not hold Run
	if hctx == nil {
		hctx = ctx
	}
	err := lostError(opWorker, w.queue, h.ref, e)
	if ok, p := callUser(func() { w.cfg.OnClaimLost(hctx, h.job, err) }); !ok {
		w.logUserEnd("OnClaimLost", "", p, "job", e.JobID)
	}
}

// callUser calls f, user code (Config.Backoff, Config.OnClaimLost), on a
// goroutine of its own and waits for it to end. ok tells whether f
// returned; when it did not, p is what it panicked with, recovered, or nil
// after a runtime.Goexit (t.FailNow or a require assertion in a test),
// which no recover stops: it ends f's goroutine only. Called directly, f's
// Goexit ended the outcome writer that called it mid-batch (its outcomes
// never written, their claims renewed until Run returned, and with one
// writer no later outcome written either: the handlers blocked handing
// theirs over, and Run never returned). A goroutine per call is cheap
// enough: Backoff runs once per failed attempt, OnClaimLost once per lost
// claim.
func callUser(f func()) (ok bool, p any) {
	type end struct {
		ok bool
		p  any
	}
	ended := make(chan end, 1)
	go func() {
		returned := false
		defer func() { // also runs after a runtime.Goexit
			if returned {
				ended <- end{ok: true}
				return
			}
			ended <- end{p: recover()} // nil after a runtime.Goexit (a panic(nil) recovers as *runtime.PanicNilError)
		}()
		f()
		returned = true
	}()
	e := <-ended
	return e.ok, e.p
}

// logUserEnd logs that callback, run by callUser, did not return: it
// panicked with p, or called runtime.Goexit (p nil). then says what the
// Worker did instead.
func (w *Worker) logUserEnd(callback, then string, p any, args ...any) {
	msg := "skiplocked: " + callback + " called runtime.Goexit"
	if p != nil {
		msg = "skiplocked: " + callback + " panicked"
		args = append(args, "panic", fmt.Sprint(p))
	}
	w.cfg.Logger.Error(msg+then, args...)
}

// connRetries is how many times the worker sends a completion, failure,
// release or renew again after a connection error (the pool may hand
// out a connection whose backend was ended since its last use).
const connRetries = 3

// retryConn runs op, and runs it again up to connRetries times while it fails
// because the connection was lost and ctx allows. Every statement it retries is
// conditional on the claim tokens, so a retry never changes a job the worker
// no longer holds, and idempotent: if a first attempt did commit before its
// connection failed, the retry reports success, not a lost claim, while the
// row still shows the claim ended with that outcome (once the job has been
// claimed again, or purged, see landedUnseen).
func retryConn(ctx context.Context, op func() error) error {
	_, err := retryConnUnsure(ctx, op)
	return err
}

// retryConnUnsure is retryConn that also tells whether an attempt before
// the last one may have taken effect: it failed with the connection after
// its statement was written (pgconn.SafeToRetry says no), so its outcome
// is unknown (sent, no reply).
func retryConnUnsure(ctx context.Context, op func() error) (unsure bool, err error) {
	err = op()
	for i := 1; i <= connRetries && connLost(err) && ctx.Err() == nil; i++ {
		t := time.NewTimer(time.Duration(i) * 10 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return unsure, err
		case <-t.C:
		}
		unsure = unsure || !pgconn.SafeToRetry(err)
		err = op()
	}
	return unsure, err
}

// dbTTL is the TTL the database applies to a claim or renewal of ttl: the
// statements send it in whole milliseconds (ttl.Milliseconds()).
func dbTTL(ttl time.Duration) time.Duration { return ttl.Truncate(time.Millisecond) }

// landedUnseen reports whether a retried outcome statement op (opComplete,
// opRelease or opFail) that found h's claim ended may conclude that an
// earlier attempt of its own ended it, the reply lost with the connection:
// then the claim was not lost, and the outcome counts as written. e is the
// job's claim as the retry read it, nil when the job no longer exists;
// unsure, whether an earlier attempt may have taken effect (see
// retryConnUnsure); now, a local clock reading taken after the retry's
// reply, so after the row was read.
//
// A job running under a claim leaves it only through pgfence.job_complete,
// job_release or job_fail given the claim's token and key, or through
// pgfence.job_claim once claim_expires_at <= now() on the database clock (a
// new token, or dead with the token kept): job_renew keeps the job running
// under the claim and never moves its expiry earlier, job_complete_tx and
// job_fail_tx change only available jobs, and job_purge deletes only
// completed and dead ones (migrations 00001, 00018, 00019, 00020 and 00026,
// the newest version of each). Before h's local deadline the claim has not
// expired on the database (see held.deadline), so a claim found gone then
// was ended with its key, that is by this Worker's outcome statement for
// it: the one retried here. (A handler that ends its own claim with
// job.Ref() and returns holds the key too, and a write outside those
// functions, a table owner's UPDATE or DELETE or
// pgfence.test_expire_claim, is not accounted for.)
//
// The row must also show an end that op leaves possible: the job deleted
// (it finished, possibly later under another claim, and was purged), or
// claimed again under another token, which a release or a failure allows
// (the job is available again) but never a completion (a completed job is
// never claimed again). The claim's own token with another outcome, or
// another key, was not ended by op: a loss. After the deadline the claim
// may have expired and been taken: a loss too, as when no earlier attempt
// may have taken effect.
func (w *Worker) landedUnseen(op string, h *held, e *claimInfo, unsure bool, now time.Time) bool {
	if !unsure {
		return false
	}
	w.mu.Lock() // renewals move the deadline
	deadline := h.deadline
	w.mu.Unlock()
	if !now.Before(deadline) {
		return false
	}
	if e == nil {
		return true
	}
	return e.CurrentToken != h.ref.Token && op != opComplete
}

// noteLandedUnseen logs an outcome counted as written by landedUnseen.
func (w *Worker) noteLandedUnseen(op string, h *held, e *claimInfo) {
	e = orBare(e, h.ref)
	w.cfg.Logger.Info(op+": claim found ended after a lost reply, before its local expiry: the earlier attempt wrote it",
		"job", e.JobID, "token", e.Token, "current_token", e.CurrentToken, "state", string(e.State))
}

func (w *Worker) finish(ctx context.Context, op string, rs []result, f func(context.Context, pgfence.DBTX, []ClaimRef) ([]ClaimRef, []*claimInfo, error)) {
	cctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL)
	defer cancel()
	refs := make([]ClaimRef, len(rs))
	for i, r := range rs {
		refs[i] = r.h.ref
	}
	var lostRefs []ClaimRef
	var infos []*claimInfo
	unsure, err := retryConnUnsure(cctx, func() (err error) {
		lostRefs, infos, err = f(cctx, w.pool, refs)
		return err
	})
	now := time.Now() // after the reply: the rows were read before
	if err != nil {
		w.stats.unknown.Add(int64(len(rs)))
		w.cfg.Logger.Error(op+" failed; claims will expire", "jobs", len(refs), "err", err)
		return
	}
	lost := make(map[ClaimRef]*claimInfo, len(lostRefs))
	for i, r := range lostRefs { // counted and logged per claim below
		lost[r] = infos[i] // nil: the job does not exist
	}
	landed := 0
	for _, r := range rs {
		if e, ok := lost[r.h.ref]; ok {
			if !w.landedUnseen(op, r.h, e, unsure, now) {
				w.reportLost(ctx, r.h, e, op+" refused: claim lost")
				continue
			}
			w.noteLandedUnseen(op, r.h, e)
		}
		landed++
	}
	if op == opComplete {
		w.stats.completed.Add(int64(landed))
		if landed > 0 {
			metricdefs.OrNop(w.cfg.Metrics).Add(ctx, metricdefs.RowsCompletedTotal, float64(landed), w.queue)
		}
	} else {
		w.stats.released.Add(int64(landed))
	}
}

func (w *Worker) fail(ctx context.Context, r result) {
	cctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL)
	defer cancel()
	msg := "error"
	if r.err != nil {
		msg = r.err.Error()
	}
	var job Job
	var lost *claimInfo
	retryIn := w.backoff(r.h.job)
	giveUp := permanent.Is(r.err)
	unsure, err := retryConnUnsure(cctx, func() (err error) {
		job, lost, err = fail(cctx, w.pool, r.h.ref, FailParams{
			Error:   msg,
			RetryIn: retryIn,
			GiveUp:  giveUp,
		})
		return err
	})
	now := time.Now() // after the reply: the row was read before
	m := metricdefs.OrNop(w.cfg.Metrics)
	failed := func(dead bool) {
		m.Add(ctx, metricdefs.RowsFailedTotal, 1, w.queue)
		if dead {
			w.stats.dead.Add(1)
			m.Add(ctx, metricdefs.RowsDeadTotal, 1, w.queue)
		} else {
			w.stats.failed.Add(1)
		}
	}
	deleted := errors.Is(err, pgfence.ErrNotFound)
	switch {
	case lost != nil && lost.CurrentToken == r.h.ref.Token && lost.Outcome == outcomeCompleted:
		// A commit whose reply was lost did land after all (see runTx).
		w.stats.completed.Add(1)
		m.Add(ctx, metricdefs.RowsCompletedTotal, 1, w.queue)
	case (lost != nil || deleted) && w.landedUnseen(opFail, r.h, lost, unsure, now):
		// An earlier attempt wrote the failure, then the job was claimed
		// again or purged: dead or not as job_fail decided it, from the
		// attempts the claim counted.
		w.noteLandedUnseen(opFail, r.h, lost)
		failed(giveUp || r.h.job.Attempts >= r.h.job.MaxAttempts)
	case lost != nil:
		w.reportLost(ctx, r.h, lost, "skiplocked: fail refused: claim lost")
	case err == nil:
		failed(job.State == StateDead)
	case deleted:
		w.reportLost(ctx, r.h, nil, "skiplocked: fail refused: job deleted")
	default:
		w.stats.unknown.Add(1)
		w.cfg.Logger.Warn("skiplocked: fail not written", "job", r.h.ref.JobID, "err", err)
	}
}

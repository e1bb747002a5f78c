package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"time"

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
// runs on an outcome writer: a panic in it is logged and DefaultBackoff used
// instead, as a panicking OnClaimLost is logged, so that the failure is still
// recorded and the process goes on.
func (w *Worker) backoff(job Job) (d time.Duration) {
	defer func() {
		if r := recover(); r != nil {
			w.cfg.Logger.Error("skiplocked: Backoff panicked; DefaultBackoff used", "job", job.ID, "attempt", job.Attempts, "panic", fmt.Sprint(r))
			d = min(max(DefaultBackoff(job.Attempts), 0), maxRetryDelay)
		}
	}()
	return min(max(w.cfg.Backoff(job.Attempts), 0), maxRetryDelay)
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
	defer func() {
		if r := recover(); r != nil {
			w.cfg.Logger.Error("skiplocked: OnClaimLost panicked", "job", e.JobID, "panic", fmt.Sprint(r))
		}
	}()
	hctx := w.hookCtx // ends ShutdownTimeout after Run's context: a hook blocked on it does not hold Run
	if hctx == nil {
		hctx = ctx
	}
	w.cfg.OnClaimLost(hctx, h.job, lostError(opWorker, w.queue, h.ref, e))
}

// connRetries is how many times the worker sends a completion, failure,
// release or renew again after a connection error (the pool may hand
// out a connection whose backend was ended since its last use).
const connRetries = 3

// retryConn runs op, and runs it again up to connRetries times while it fails
// because the connection was lost and ctx allows. Every statement it retries is
// conditional on the claim tokens, so a retry never changes a job the worker
// no longer holds, and idempotent: if a first attempt did commit before its
// connection failed, the retry reports success, not a lost claim.
func retryConn(ctx context.Context, op func() error) error {
	err := op()
	for i := 1; i <= connRetries && connLost(err) && ctx.Err() == nil; i++ {
		t := time.NewTimer(time.Duration(i) * 10 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		err = op()
	}
	return err
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
	err := retryConn(cctx, func() (err error) {
		lostRefs, infos, err = f(cctx, w.pool, refs)
		return err
	})
	lost := map[ClaimRef]*claimInfo{}
	if err == nil {
		for i, r := range lostRefs { // counted and logged per claim below
			lost[r] = orBare(infos[i], r)
		}
	}
	if err != nil {
		w.stats.unknown.Add(int64(len(rs)))
		w.cfg.Logger.Error(op+" failed; claims will expire", "jobs", len(refs), "err", err)
		return
	}
	landed := 0
	for _, r := range rs {
		if e, ok := lost[r.h.ref]; ok {
			w.reportLost(ctx, r.h, e, op+" refused: claim lost")
			continue
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
	err := retryConn(cctx, func() (err error) {
		job, lost, err = fail(cctx, w.pool, r.h.ref, FailParams{
			Error:   msg,
			RetryIn: retryIn,
			GiveUp:  permanent.Is(r.err),
		})
		return err
	})
	m := metricdefs.OrNop(w.cfg.Metrics)
	switch {
	case lost != nil && lost.CurrentToken == r.h.ref.Token && lost.Outcome == outcomeCompleted:
		// A commit whose reply was lost did land after all (see runTx).
		w.stats.completed.Add(1)
		m.Add(ctx, metricdefs.RowsCompletedTotal, 1, w.queue)
	case lost != nil:
		w.reportLost(ctx, r.h, lost, "skiplocked: fail refused: claim lost")
	case err == nil:
		m.Add(ctx, metricdefs.RowsFailedTotal, 1, w.queue)
		if job.State == StateDead {
			w.stats.dead.Add(1)
			m.Add(ctx, metricdefs.RowsDeadTotal, 1, w.queue)
		} else {
			w.stats.failed.Add(1)
		}
	case errors.Is(err, pgfence.ErrNotFound):
		w.reportLost(ctx, r.h, nil, "skiplocked: fail refused: job deleted")
	default:
		w.stats.unknown.Add(1)
		w.cfg.Logger.Warn("skiplocked: fail not written", "job", r.h.ref.JobID, "err", err)
	}
}

package skiplocked

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/pgerr"
)

// handle runs handlers over the jobs handed to it and passes each outcome to
// the writers. A job's slot is freed once its outcome is handed over: the
// fetchers may then claim again while the outcome is being written.
//
// A handler that calls runtime.Goexit (t.FailNow, or a require assertion,
// in a test) ends this goroutine, which no recover stops: its job then
// fails with errHandlerGoexit, its slot is freed, and respawn starts a new
// goroutine in its place (before, the job stayed claimed and renewed, and
// the slot lost, until Run returned).
func (w *Worker) handle(base context.Context, jobs <-chan *held, results chan<- result, slots <-chan struct{}, stopping *atomic.Bool, respawn func()) {
	var (
		cur       *held // the job whose handler runs, while it does
		curCancel context.CancelCauseFunc
	)
	defer func() {
		if cur == nil {
			return // the loop ended
		}
		curCancel(errHandlerGoexit)
		w.mu.Lock()
		cur.returned = true
		cur.expiry.Stop()
		w.mu.Unlock()
		w.cfg.Logger.Error("skiplocked: a handler called runtime.Goexit; its job fails", "job", cur.ref.JobID)
		results <- result{h: cur, outcome: outFail, err: errHandlerGoexit}
		<-slots
		respawn()
	}()
	for h := range jobs {
		w.mu.Lock()
		if stopping.Load() || h.lost != nil {
			lost := h.lost
			w.mu.Unlock()
			if lost != nil {
				results <- result{h: h, outcome: outLost, lost: lost}
			} else {
				results <- result{h: h, outcome: outRelease}
			}
			<-slots
			continue
		}
		jctx, cancel := context.WithCancelCause(base)
		h.cancel, h.started = cancel, true
		h.expiry = time.AfterFunc(time.Until(h.deadline), func() { w.expire(h) })
		w.mu.Unlock()

		var r result
		cur, curCancel = h, cancel
		if w.txHandler != nil {
			r = w.runTx(jctx, h)
		} else {
			r = w.decide(jctx, h, w.call(jctx, h.job))
		}
		cur, curCancel = nil, nil
		cancel(nil)
		w.mu.Lock()
		h.returned = true
		h.expiry.Stop()
		w.mu.Unlock()
		results <- r
		<-slots
	}
}

// expire runs when h's local deadline may have passed while its handler
// runs: if no renewal moved the deadline since, and none was answered at
// all for the claim (a database out of reach, a pool whose connections the
// handlers hold, so that no renewal could be sent), the claim may have
// expired on the database and the job may be claimed again and run
// elsewhere, so the handler's context is cancelled, with a cause matching
// pgfence.ErrLost, as when a renewal finds the claim lost. Until then
// nobody else can have the job (see held.deadline). Before, such a handler
// was never told, and ran on beside the job's next claimer. A renewal that
// was answered without extending the claim found it lost (handled by
// renewLoop) or its row locked: by the handler's own transaction, say, in
// which it completed the job; nobody can claim a locked row, and a
// renewal answered each RenewInterval shows the database in reach, so the
// handler is left alone, as before.
func (w *Worker) expire(h *held) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if h.returned || h.completing || h.lost != nil || h.ended || h.expired {
		return
	}
	if d := time.Until(later(h.deadline, h.answered)); d > 0 {
		h.expiry.Reset(d) // a renewal extended the claim, or was answered, meanwhile
		return
	}
	h.expired = true
	w.cfg.Logger.Warn("skiplocked: no renewal of a claim was answered before its local deadline; its handler is cancelled",
		"job", h.ref.JobID, "token", h.ref.Token)
	h.cancel(&pgfence.Error{Op: opWorker, Kind: pgfence.ErrLost, Name: w.queue, Token: h.ref.Token,
		Reason: fmt.Sprintf("job %d: no renewal of the claim was answered before its local deadline: it may have expired, and the job may be claimed again", h.ref.JobID)})
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// decide turns a handler's return and its context's cause into an outcome.
func (w *Worker) decide(jctx context.Context, h *held, err error) result {
	cause := context.Cause(jctx)
	switch {
	case errors.Is(cause, pgfence.ErrLost):
		w.mu.Lock() // h.lost was set before the cancellation
		lost, expired := h.lost, h.expired
		w.mu.Unlock()
		if lost == nil && expired {
			// Cancelled at the local deadline, the claim not known lost:
			// the outcome writer's conditional statement finds out. A
			// handler that finished anyway is completed; one that gave
			// up has its attempt failed, as any failure: counted, so
			// that a job whose every attempt is cut so ends dead after
			// MaxAttempts (a release would not count it).
			if err == nil {
				return result{h: h, outcome: outComplete}
			}
			return result{h: h, outcome: outFail, err: err}
		}
		return result{h: h, outcome: outLost, err: err, lost: lost}
	case err == nil:
		return result{h: h, outcome: outComplete}
	case cause == errShutdown:
		return result{h: h, outcome: outRelease, err: err}
	default:
		return result{h: h, outcome: outFail, err: err}
	}
}

// call calls the handler, turning a panic into an error.
func (w *Worker) call(ctx context.Context, j Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.handler(ctx, j)
}

// errHandlerGoexit is the failure of a job whose handler called
// runtime.Goexit.
var errHandlerGoexit = errors.New("skiplocked: the handler called runtime.Goexit (t.FailNow or a require assertion in a test?)")

// errHandlerTx is the error of Commit and Rollback on a TxHandler's tx.
var errHandlerTx = errors.New("skiplocked: a TxHandler must not commit or roll back its transaction: " +
	"the Worker commits it together with the job's completion (return an error to roll back)")

// handlerTx is the transaction a TxHandler gets: Commit and Rollback are
// refused (and remembered), everything else is the pgx.Tx.
type handlerTx struct {
	pgx.Tx
	misused atomic.Bool
}

// Commit refuses: the Worker commits.
func (t *handlerTx) Commit(context.Context) error { t.misused.Store(true); return errHandlerTx }

// Rollback refuses: the Worker rolls back when the handler returns an error.
func (t *handlerTx) Rollback(context.Context) error { t.misused.Store(true); return errHandlerTx }

// callTx calls the TxHandler, turning a panic into an error.
func (w *Worker) callTx(ctx context.Context, tx pgx.Tx, j Job) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return w.txHandler(ctx, tx, j)
}

// runTx runs a TxHandler: begin, handler, completion conditional on the
// claim token in the same transaction, commit. A refused completion rolls
// the effect back.
func (w *Worker) runTx(jctx context.Context, h *held) (r result) {
	// READ COMMITTED whatever the session's default: the claim is renewed
	// (its row updated) while the handler runs, and under REPEATABLE READ
	// or SERIALIZABLE the completion below would then fail (40001) on
	// every attempt that outlasts a renewal, until the job is dead.
	tx, err := w.pool.BeginTx(jctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return w.decide(jctx, h, dbError(opWorker, w.queue, "begin the handler's transaction", err))
	}
	rollback := func() {
		rctx, cancel := context.WithTimeout(w.bg, 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx) // on error pgx closes the connection: nothing commits
	}
	// Also after a runtime.Goexit (the handler's, or a tracer's under the
	// statements below): the transaction must not keep its row locks and
	// its connection. After a commit or a rollback it does nothing.
	defer rollback()
	htx := &handlerTx{Tx: tx}
	herr := w.callTx(jctx, htx, h.job)
	if htx.misused.Load() && herr == nil {
		herr = errHandlerTx
	}
	if r := w.decide(jctx, h, herr); r.outcome != outComplete {
		rollback()
		return r
	}
	// The handler returned nil: complete the job in its transaction, with a
	// context the handler's cancellation does not end (a shutdown cancels
	// handlers, but a handler that returned nil is completed).
	cctx, cancel := context.WithTimeout(w.bg, w.cfg.ClaimTTL)
	defer cancel()
	if st := tx.Conn().PgConn().TxStatus(); st != 'T' {
		rollback()
		return result{h: h, outcome: outFail, err: fmt.Errorf("skiplocked: the handler's transaction is not open (status %q): "+
			"a statement failed, or COMMIT/ROLLBACK was sent through tx.Conn()", st)}
	}
	w.mu.Lock()
	h.completing = true
	w.mu.Unlock()
	defer func() {
		// The transaction is over: unless it completed the job (or may
		// have), the claim is still held and renewed until the outcome
		// writer records the failure.
		if r.outcome != outCompleted && r.outcome != outUnknown {
			w.mu.Lock()
			h.completing = false
			w.mu.Unlock()
		}
	}()
	done, err := queries.CompleteJobs(cctx, tx, dbsqlc.CompleteJobsParams{Ids: []int64{h.ref.JobID}, ClaimTokens: []int64{h.ref.Token}, Keys: [][]byte{h.ref.Key[:]}})
	if err != nil {
		rollback()
		return result{h: h, outcome: outFail, err: dbError(opWorker, w.queue, "complete in the handler's transaction", err)}
	}
	if len(done) == 0 {
		// Read through tx: a completion the handler made in tx itself
		// (Complete(ctx, tx, ref)) is seen only there.
		st, err := claimState(cctx, tx, opWorker, h.ref)
		if err != nil {
			rollback()
			if errors.Is(err, pgfence.ErrNotFound) {
				return result{h: h, outcome: outLost, lost: orBare(nil, h.ref)}
			}
			return result{h: h, outcome: outFail, err: err}
		}
		if st != nil && alreadyDone(opComplete, h.ref, st) {
			// Completed under this very claim by another call (the handler
			// called Complete itself): nobody else can run the job, so the
			// handler's effect commits.
			return w.commitTx(cctx, tx, h)
		}
		rollback()
		return result{h: h, outcome: outLost, lost: orBare(st, h.ref)}
	}
	return w.commitTx(cctx, tx, h)
}

// commitTx commits the handler's transaction, in which the job is completed
// under h's claim (by the Worker, or by the handler itself), and tells the
// outcome: a COMMIT the server refused (a deferred constraint, an outbox
// intent refused at COMMIT) rolled back and is a failure, recorded with its
// error; after a broken connection the row tells whether it committed.
func (w *Worker) commitTx(cctx context.Context, tx pgx.Tx, h *held) result {
	cerr := tx.Commit(cctx)
	if cerr == nil {
		return result{h: h, outcome: outCompleted}
	}
	if code := pgerr.Code(cerr); code != "" && !pgerr.SessionGone(code) {
		// The server answered COMMIT with an error: it rolled back.
		return result{h: h, outcome: outFail, err: dbError(opWorker, w.queue, "commit", cerr)}
	}
	// The connection broke during COMMIT: read the row to learn whether it
	// committed. Only this transaction can complete the job under this token.
	st := w.readClaim(h.ref)
	switch {
	case st == nil:
		w.cfg.Logger.Error("skiplocked: commit outcome unknown; if it did not commit, the claim expires and the job runs again",
			"job", h.ref.JobID, "token", h.ref.Token, "err", cerr)
		return result{h: h, outcome: outUnknown, err: cerr}
	case alreadyDone(opComplete, h.ref, st):
		return result{h: h, outcome: outCompleted}
	case st.CurrentToken == h.ref.Token && st.State == StateRunning:
		return result{h: h, outcome: outFail, err: dbError(opWorker, w.queue, "commit", cerr)}
	default:
		return result{h: h, outcome: outLost, lost: st}
	}
}

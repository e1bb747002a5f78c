package skiplocked

import (
	"context"
	"time"
)

// renewLoop extends every claim held, moves the local deadline
// (held.deadline) of each claim extended, and cancels handlers whose claim
// is lost. A claim found ended by its own outcome under the same token (the
// handler completed it, or the completion raced the renewal) is not a
// loss: it is only no longer renewed.
func (w *Worker) renewLoop(ctx context.Context) {
	t := time.NewTicker(w.cfg.RenewInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.mu.Lock()
		refs := make([]ClaimRef, 0, len(w.inflight))
		for _, h := range w.inflight {
			if h.lost == nil && !h.ended && !h.completing {
				refs = append(refs, h.ref)
			}
		}
		w.mu.Unlock()
		for len(refs) > 0 {
			chunk := refs[:min(len(refs), maxBatch)]
			refs = refs[len(chunk):]
			hctx, cancel := context.WithTimeout(ctx, w.cfg.ClaimTTL) // a later renewal is useless
			var expires []time.Time
			var lost []ClaimRef // cancelled below
			var details []*claimInfo
			// Read before the first attempt is sent: each attempt that
			// extended a claim did so from a later instant.
			deadline := time.Now().Add(dbTTL(w.cfg.ClaimTTL))
			err := retryConn(hctx, func() (err error) {
				expires, lost, details, _, err = renew(hctx, w.pool, w.cfg.ClaimTTL, chunk)
				return err
			})
			cancel()
			if err != nil {
				// Possibly extended after all: the local deadlines stay
				// where they were, earlier than the database's.
				w.cfg.Logger.Warn("skiplocked: claim renewal failed", "claims", len(chunk), "err", err)
				continue
			}
			w.mu.Lock()
			for i, r := range chunk {
				h, ok := w.inflight[r]
				if !ok {
					continue
				}
				if deadline.After(h.answered) {
					h.answered = deadline // the database answered for it (see expire)
				}
				if expires[i].IsZero() {
					continue // lost, or its row locked at that moment: not extended
				}
				if deadline.After(h.deadline) {
					h.deadline = deadline
				}
			}
			for i, r := range lost {
				h, ok := w.inflight[r]
				if !ok {
					continue
				}
				d := details[i]
				if d != nil && d.CurrentToken == r.Token && (d.Outcome == outcomeCompleted || d.Outcome == outcomeFailed || d.Outcome == outcomeReleased) {
					h.ended = true
					continue
				}
				h.lost = orBare(d, r)
				if h.cancel != nil && !h.returned {
					h.cancel(lostError(opWorker, w.queue, r, h.lost))
				}
			}
			w.mu.Unlock()
		}
	}
}

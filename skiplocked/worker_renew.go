package skiplocked

import (
	"context"
	"time"
)

// renewLoop extends every claim held, and cancels handlers whose claim is
// lost. A claim found ended by its own outcome under the same token (the
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
			var lost []ClaimRef                                      // cancelled below
			var details []*claimInfo
			err := retryConn(hctx, func() (err error) {
				_, lost, details, _, err = renew(hctx, w.pool, w.cfg.ClaimTTL, chunk)
				return err
			})
			cancel()
			if err != nil {
				w.cfg.Logger.Warn("skiplocked: claim renewal failed", "claims", len(chunk), "err", err)
				continue
			}
			w.mu.Lock()
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

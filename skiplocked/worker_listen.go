package skiplocked

import (
	"context"

	"github.com/pgfence/pgfence/internal/notify"
)

// listen holds one connection LISTENing on notifyChannel until ctx ends and
// wakes the fetcher when a notification names this worker's queue. It
// reconnects after failures, waking the fetcher each time since
// notifications may have been missed.
func (w *Worker) listen(ctx context.Context, wake chan<- struct{}) {
	n := notify.New(w.pool, notify.Config{
		Channels: []string{notifyChannel},
		Logger:   w.cfg.Logger,
		DownMsg:  "skiplocked: listener failed; polling until it reconnects",
		UpMsg:    "skiplocked: listening",
	})
	sub := n.SubscribePayload(notifyChannel, w.queue)
	n.Start()
	defer n.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-sub.C():
			poke(wake)
		}
	}
}

func poke(c chan<- struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

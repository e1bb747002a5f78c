package skiplocked

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// listen holds one connection LISTENing on NotifyChannel and wakes the
// fetcher when a notification names this worker's queue. It reconnects after
// failures, waking the fetcher each time since notifications may have been
// missed.
func (w *Worker) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := w.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		w.cfg.Logger.Warn("skiplocked: listener failed; polling until it reconnects", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(w.cfg.PollInterval):
		}
	}
}

func (w *Worker) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	conn, err := pgx.ConnectConfig(ctx, w.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{NotifyChannel}.Sanitize()); err != nil {
		return err
	}
	poke(wake)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		if n.Payload == w.queue {
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

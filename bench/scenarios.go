package main

import (
	"context"
	"fmt"
)

// runAll starts the servers and runs every selected scenario in order.
func (b *bench) runAll(ctx context.Context) error {
	b.progress("starting PostgreSQL (default durability: fsync on, synchronous_commit on)")
	pg, err := startPG(ctx, b.cfg.dsn, b.log)
	if err != nil {
		return err
	}
	defer pg.close()
	b.pg = pg
	b.mach.PostgreSQL = "PostgreSQL " + pg.version
	b.mach.Durability = fmt.Sprintf("fsync=%s, synchronous_commit=%s", pg.fsync, pg.syncCmt)
	b.progress("PostgreSQL %s ready (%s)", pg.version, b.mach.Durability)

	if b.want("L0") || b.want("B1") {
		if err := b.runCore(ctx); err != nil {
			return err
		}
	}
	if b.want("B2") {
		b.runB2(ctx)
	}
	if b.want("B3") {
		b.runB3(ctx)
	}
	if b.want("B4") {
		if err := b.runB4(ctx); err != nil {
			return err
		}
	}
	if b.want("B5") {
		b.runB5(ctx)
	}
	if b.want("P1") {
		b.runP1(ctx)
	}
	if b.want("P2") {
		b.runP2(ctx)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.addComparisons()
	b.add(b.memRows...)
	b.add(rssRows()...)
	return nil
}

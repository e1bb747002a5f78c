package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
)

// runAll starts the servers and runs every selected scenario. etcd and Redis
// run for the whole bench, so that their variants are interleaved with
// pgfence's (P1/P2/P3 distinct keys with L0 and B1, hot keys with B2).
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
	defer b.startEtcdPeer(ctx)()
	defer b.startRedisPeer(ctx)()

	if b.want("L0") || b.want("B1") || b.etcd != nil || b.redisAddr != "" || b.redisAOFAddr != "" {
		if err := b.runCore(ctx); err != nil {
			return err
		}
	}
	if b.want("B2") || b.etcd != nil || b.redisAddr != "" || b.redisAOFAddr != "" {
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
	if b.want("O1") {
		b.runO1(ctx)
	}
	if b.want("K1") {
		b.runK1(ctx)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.addComparisons()
	b.add(b.memRows...)
	b.add(rssRows()...)
	sortRows(b.rows)
	return nil
}

// scenarioOrder is the order of the table's sections.
var scenarioOrder = []string{"L0", "B1", "B2", "B3", "B4", "B5", "O1", "K1", "P1", "P2", "P3", "R", "M"}

// sortRows orders rows by section, keeping the order within a section.
func sortRows(rows []Row) {
	rank := func(r Row) int {
		id, _, _ := strings.Cut(r.Scenario, " ")
		if i := slices.Index(scenarioOrder, id); i >= 0 {
			return i
		}
		return len(scenarioOrder)
	}
	slices.SortStableFunc(rows, func(a, b Row) int { return rank(a) - rank(b) })
}

package main

import (
	"context"
	"fmt"
)

// runCore measures L0 (the physical limit) and, interleaved with it, B1, so
// that B1's ratio to L0 compares runs made side by side.
func (b *bench) runCore(ctx context.Context) error {
	if err := setupL0(ctx, b.pg.pool); err != nil {
		return fmt.Errorf("L0 setup: %w", err)
	}
	type kind int
	const (
		l0Random kind = iota
		l0Hot
	)
	var (
		vs    []variant
		kinds []kind
	)
	for _, c := range b.cfg.clients {
		vs = append(vs, l0Variant(b.pg.pool, false, c), l0Variant(b.pg.pool, true, c))
		kinds = append(kinds, l0Random, l0Hot)
	}
	res := b.measure(ctx, "L0", vs)
	for i, v := range vs {
		switch kinds[i] {
		case l0Random, l0Hot:
			b.add(rateRow("L0 UPDATE limit", v.name, v.clients, "ops/s", res[i]))
			b.keep("L0", v.name, v.clients, res[i].rates)
			if v.clients == 1 {
				b.memRow("L0 UPDATE "+v.name, res[i])
			}
		}
	}
	b.add(notMeasured("B1 acquire + fenced write + release", "distinct names", 0, "cycles/s", "pglock/fencedwrite not merged yet"))
	return nil
}

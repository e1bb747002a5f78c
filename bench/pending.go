package main

import "context"

// Scenarios whose pgfence package has not been merged yet.

func (b *bench) runB3(context.Context) {
	b.add(notMeasured("B3 fenced vs unconditional UPDATE", "", 0, "ops/s", "fencedwrite not merged yet"))
}

package main

import "context"

// Scenarios whose pgfence package has not been merged yet.

const holderCommand = "__b5-holder"

func holderMain([]string) int { return 2 }

func (b *bench) runB2(context.Context) {
	b.add(notMeasured("B2 contended handoff", "", 0, "grants/s", "pglock not merged yet"))
}

func (b *bench) runB3(context.Context) {
	b.add(notMeasured("B3 fenced vs unconditional UPDATE", "", 0, "ops/s", "fencedwrite not merged yet"))
}

func (b *bench) runB5(context.Context) {
	b.add(notMeasured("B5 takeover after SIGKILL", "", 0, "ms", "pglock not merged yet"))
}

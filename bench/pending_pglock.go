//go:build !pgfence_pglock

package main

import "context"

const holderCommand = "__b5-holder"

func holderMain([]string) int { return 2 }

func (b *bench) runB2(context.Context) {
	b.add(notMeasured("B2 contended handoff, one name", "", 0, "grants/s", "pglock not merged yet"))
}

func (b *bench) runB5(context.Context) {
	b.add(notMeasured("B5 takeover after SIGKILL", "", 0, "ms", "pglock not merged yet"))
}

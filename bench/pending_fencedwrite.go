//go:build !(pgfence_pglock && pgfence_fencedwrite)

package main

import (
	"context"
	"errors"
)

// B1 and B3 need pglock and fencedwrite.

type b1Env struct{}

func (b *bench) setupB1(context.Context) (*b1Env, error) {
	return nil, errors.New("pglock/fencedwrite not merged yet")
}

func (e *b1Env) close() {}

func (b *bench) b1Variants(*b1Env, int) []variant { return nil }

func (b *bench) runB3(context.Context) {
	b.add(notMeasured("B3 fenced vs unconditional UPDATE", "", 0, "ops/s", "fencedwrite not merged yet"))
}

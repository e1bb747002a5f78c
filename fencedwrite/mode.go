package fencedwrite

import (
	"fmt"
)

// Mode chooses the fence comparison of a write.
type Mode int

const (
	// Strict writes only when fence < token: one write per row per grant. A
	// replay of the same write is refused with [pgfence.ErrAlreadyApplied], so a
	// retried write is harmless. This is the default.
	Strict Mode = iota
	// Reentrant writes when fence <= token: one grant may write the same row
	// again (and must, after a fenced read raised the fence to its token).
	Reentrant
)

// String returns "strict" or "reentrant", the names pgfence.guard uses too.
func (m Mode) String() string {
	switch m {
	case Strict:
		return "strict"
	case Reentrant:
		return "reentrant"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// op returns the SQL comparison of the mode.
func (m Mode) op() string {
	if m == Reentrant {
		return "OPERATOR(pg_catalog.<=)"
	}
	return "OPERATOR(pg_catalog.<)"
}

func (m Mode) valid() bool { return m == Strict || m == Reentrant }

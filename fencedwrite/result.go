package fencedwrite

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Result describes an applied fenced write.
type Result struct {
	// Fence is the row's fence after the write: the token that was sent.
	Fence int64
	// Inserted is true when an upsert inserted a new row.
	Inserted bool
}

// Check converts the row of a fenced statement written in the older
// "applied, fence" shape (a CTE with the write, then "applied, fence" from the
// write or, when it changed nothing, from the current row) into this
// package's errors. Statements that fencegen generates now raise their
// refusals themselves; for them use [TranslateError] on the error the
// generated method returns. Check remains for hand-written statements of the
// older shape:
//
//	row, err := q.MyFencedUpdate(ctx, pool, params)
//	err = fencedwrite.Check(fencedwrite.Strict, token, row.Applied, row.Fence, err)
//
// err is the error returned by the query: pgx.ErrNoRows becomes
// [ErrNotFound], a guard or generated refusal is translated. With applied
// false it returns *[StaleTokenError], [ErrAlreadyApplied], or
// [ErrConcurrentChange] when the fence read in the statement's snapshot
// cannot explain the refusal (a concurrent writer; re-read and decide).
// Check returns nil only when the write was applied.
func Check(mode Mode, token int64, applied bool, fence int64, err error) error {
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		}
		return TranslateError(err)
	}
	if applied {
		return nil
	}
	if cerr := classify(mode, token, fence); cerr != nil {
		return cerr
	}
	return ErrConcurrentChange
}

// classify explains a refused write from the row's fence. It returns nil when
// the fence does not explain the refusal (fence < token, or == token in
// reentrant mode): the row changed after the statement's snapshot.
func classify(mode Mode, token, fence int64) error {
	switch {
	case fence > token:
		return &StaleTokenError{Token: token, Fence: fence}
	case fence == token && mode == Strict:
		return ErrAlreadyApplied
	}
	return nil
}

// refused explains a refused write. found and fence come from the statement
// itself; when they do not explain the refusal, reread fetches the row's
// fence with a fresh snapshot (one more round trip, only in that race).
func refused(ctx context.Context, mode Mode, token int64, found bool, fence int64,
	reread func(context.Context) (bool, int64, error)) error {
	if !found {
		return ErrNotFound
	}
	if err := classify(mode, token, fence); err != nil {
		return err
	}
	found, fence, err := reread(ctx)
	if err != nil {
		return TranslateError(err)
	}
	if !found {
		return ErrNotFound
	}
	if err := classify(mode, token, fence); err != nil {
		return err
	}
	return ErrConcurrentChange
}

func checkToken(token int64) error {
	if token <= 0 {
		return fmt.Errorf("%w (got %d)", ErrInvalidToken, token)
	}
	return nil
}

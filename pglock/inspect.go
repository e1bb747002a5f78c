package pglock

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// LockInfo is a snapshot of one lock row, read with [Inspect].
type LockInfo struct {
	Name      string    // the lock name, as given to Inspect
	Token     int64     // latest grant's token; 0 = never granted
	Holder    string    // "" when released
	ExpiresAt time.Time // database clock; zero when released
	Held      bool      // holder set and expires_at > now() on the database clock
	DBNow     time.Time // the database's now() when read
}

// Inspect reads the row of lock name from db. A name that was never granted
// returns a zero LockInfo with Name set and no error. The answer is advisory:
// it may change right after it is read.
//
// A nil db or an invalid name gives a [*pgfence.Error] matching
// [pgfence.ErrInvalid]; a database failure a [*pgfence.Error] whose cause is
// the driver's error.
func Inspect(ctx context.Context, db pgfence.DBTX, name string) (LockInfo, error) {
	return inspectAs(ctx, "pglock.Inspect", db, name)
}

// inspectAs is Inspect for the exported call op.
func inspectAs(ctx context.Context, op string, db pgfence.DBTX, name string) (LockInfo, error) {
	if nilcheck.IsNil(db) {
		return LockInfo{}, invalid(op, "db", "nil database handle")
	}
	if err := validateName(op, name); err != nil {
		return LockInfo{}, err
	}
	h, err := dbsqlc.New().LockHolder(ctx, db, name)
	if errors.Is(err, pgx.ErrNoRows) {
		return LockInfo{Name: name}, nil
	}
	if err != nil {
		return LockInfo{}, dbError(op, name, err)
	}
	info := LockInfo{Name: h.Name, Token: h.Token, Held: h.Held, DBNow: h.DbNow}
	if h.Holder != nil {
		info.Holder = *h.Holder
	}
	if h.ExpiresAt != nil {
		info.ExpiresAt = *h.ExpiresAt
	}
	return info, nil
}
